"""The scheduler's one source of time: a `Clock` whose `now()` is seconds on a monotonic scale.

The runners, the pending queue and the cost model read time only through the clock they are given, so that
tests drive them with a `FakeClock` (set and advanced by hand) and never sleep. The gateway uses `PerfClock`:
`time.perf_counter()`, the scale of a `Ticket`'s arrival and deadline and of an upload's body clock.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Seconds on a monotonic scale."""

    def now(self) -> float: ...


class PerfClock:
    """`time.perf_counter()`."""

    def now(self) -> float:
        return time.perf_counter()


class FakeClock:
    """A clock that moves only when told (`advance`, `set`): tests and simulations."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds

    def advance_ms(self, ms: float) -> None:
        self.t += ms / 1e3


PERF_CLOCK = PerfClock()
