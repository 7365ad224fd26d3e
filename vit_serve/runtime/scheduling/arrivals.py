"""Requests on their way to the queue (body being read, image being decoded): the batcher may wait for them, and
deadlines count them as work ahead, while they keep coming.

An upload being read counts as coming while its latest bytes came at most `STALL_S` ago (the stalled-arrival
rule, `live_arrivals`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from vit_serve.runtime.scheduling.ticket import DEFAULT_PRIORITY

# A live upload's bytes come every few milliseconds, and a lost segment stalls it for one TCP retransmission
# timeout (200 ms at least on Linux); one stalled longer is slow or abusive. Taking a live upload for stalled
# costs little (it joins the next batch); the other way round, batches wait and deadlines are refused for uploads
# that may never come.
STALL_S = 0.25


def live_arrivals(heard: Iterable[tuple[int, float | None]], now: float, cap: int, level: int | None = None,
                  stall_s: float = STALL_S) -> int:
    """How many announced requests count as coming at `now`: those at `level` or a more urgent one (every level
    without one) whose latest bytes came within `stall_s` (a time of None: no body being read, e.g. one being
    decoded, never stalls), at most `cap` (the batches the model can run next hold no more). `heard`: (level,
    when its latest bytes came) per request."""
    n = sum(1 for lv, t in heard if (level is None or lv <= level) and (t is None or now - t <= stall_s))
    return min(n, cap)


class Arrivals:
    """A runner's announced requests not yet queued, and the event its collector waits on for news (one came,
    one left, one was queued)."""

    def __init__(self) -> None:
        self.incoming: set[Arrival] = set()
        self.news = asyncio.Event()

    def __len__(self) -> int:
        return len(self.incoming)

    def coming(self, now: float, cap: int, level: int | None = None) -> int:
        """`live_arrivals` of the announced requests."""
        return live_arrivals(((a.priority, a.heard) for a in self.incoming), now, cap, level)


class Arrival:
    """A request on its way to the queue (body being read, image being decoded): the collector may wait for it.

    Use as a context manager around reading + decoding + `submit(..., arrival)`; it stops counting when the
    request is queued or when it fails before that. `priority`: its level as far as known (the caller's key).
    While its body is read, `heard_from(clock)` tells when its latest bytes came (an object with `last`, seconds
    on the scheduler's clock): once they stall it no longer counts as coming (`live_arrivals`).
    """

    def __init__(self, arrivals: Arrivals, priority: int = DEFAULT_PRIORITY) -> None:
        self._arrivals: Arrivals | None = arrivals
        self.priority = priority
        self.clock: Any = None  # when its latest bytes came (`last`), while its body is read
        arrivals.incoming.add(self)

    @property
    def heard(self) -> float | None:
        """When its latest bytes came (None: not reading a body: it does not stall)."""
        return None if self.clock is None else self.clock.last

    def heard_from(self, clock: Any) -> None:
        """Age this arrival by `clock.last` (the request's body clock) from now on; None: never."""
        self.clock = clock

    def done(self) -> None:
        if self._arrivals is not None:
            self._arrivals.incoming.discard(self)
            self._arrivals.news.set()  # the collector re-checks whether to keep waiting
            self._arrivals = None

    def __enter__(self) -> Arrival:
        return self

    def __exit__(self, *exc: object) -> None:
        self.done()
