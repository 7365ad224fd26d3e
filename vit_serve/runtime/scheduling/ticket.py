"""One request's terms with the queue: who sent it, how urgent it is, when it must be answered by, which session
it belongs to, where it is now and whether its caller went away (`Ticket`).

Priority levels are Triton's: 1 is the most urgent and a larger number waits behind a smaller one. A caller's
level comes from its key; a request may lower its own (`lowered`: /v2 `parameters.priority`, gRPC's `priority`
parameter) but never raise it. Shadow copies run at `SHADOW`, below every level: they are the first work shed.

Deadlines are counted from the request's arrival; the earliest wins (`within`). A request whose deadline has
passed, or that the batcher predicts it cannot answer in time, is refused (`DeadlineError`) instead of being run
late. Times are seconds on the scheduler's clock (`clock.PerfClock`: `time.perf_counter()`).

Stages (where a request was when its caller went away): read (its body), decode, queue, infer (its batch had
started: the answer is thrown away). Whoever notices the caller leave says so (`caller_left`) before cancelling
the request's work; the runner holding it then (queue, infer) reports it, else whoever noticed: once either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from vit_serve.runtime.errors import InvalidValueError
from vit_serve.runtime.scheduling.clock import PERF_CLOCK
from vit_serve.runtime.scheduling.errors import deadline_exceeded

Stage = Literal["read", "decode", "queue", "infer"]
STAGES: tuple[Stage, ...] = ("read", "decode", "queue", "infer")
DEFAULT_PRIORITY = 1  # Triton's most urgent level; a key without a level has this one
SHADOW = 1 << 30  # below every level a key may have
ANONYMOUS = "anonymous"  # the caller's name without API keys


@dataclass(frozen=True)
class Caller:
    """Who sent a request, as the queue sees it: the key's name (metrics are labelled by it, never by the key)
    and its priority level."""

    name: str = ANONYMOUS
    priority: int = DEFAULT_PRIORITY


@dataclass(eq=False)
class Ticket:
    """A request's terms (set as it arrives) and its progress (updated as it goes), one object per request."""

    arrived: float = field(default_factory=PERF_CLOCK.now)  # clock seconds
    deadline: float | None = None  # clock seconds; None: the runner's request_timeout_s alone
    caller: Caller = field(default_factory=Caller)
    priority: int = DEFAULT_PRIORITY
    session: str | None = None  # X-Session-Id: sticky canary routing
    shadow: bool = False  # a shadow copy: nobody waits for its answer
    stage: Stage = "read"
    model: str = ""
    version: str = ""
    cancelled: bool = False  # its caller went away
    held: bool = False  # in a runner's queue or batch: the runner reports its cancellation (`caller_left`)
    # what a bad term is refused with (the gateway's subclass carries the same 422 and message)
    invalid: ClassVar[type[InvalidValueError]] = InvalidValueError

    def __post_init__(self) -> None:
        self.priority = max(self.priority, self.caller.priority)

    # ---- terms ------------------------------------------------------------------------------------------

    def identify(self, caller: Caller) -> None:
        """The request comes from `caller` (the key check knows): its level is at most as urgent as the key's."""
        self.caller = caller
        self.priority = max(self.priority, caller.priority)

    def within(self, seconds: float | None, what: str) -> None:
        """Tighten the deadline to `seconds` after arrival (None: no change); 422 for a negative value."""
        if seconds is None:
            return
        if not seconds >= 0:  # NaN too
            raise self.invalid(f"{what} must be a number >= 0")
        deadline = self.arrived + seconds
        self.deadline = deadline if self.deadline is None else min(self.deadline, deadline)

    def within_ms(self, ms: float | None, what: str) -> None:
        """A deadline in milliseconds (`?timeout_ms=`, `X-Request-Timeout-Ms`): None or 0 is none (as Triton's
        `timeout` 0), else `within`; 422 for a negative or non-finite value."""
        if ms is None or ms == 0:
            return
        if not math.isfinite(ms):
            raise self.invalid(f"{what} must be a finite number of milliseconds >= 0 (0: no deadline)")
        self.within(ms / 1e3, what)

    def lowered(self, level: Any, levels: int) -> None:
        """Apply a request's own priority level: it may lower (a larger number) but never raise the key's; 0 or
        None keeps it (Triton's default); 422 beyond `levels` (VIT_SERVE_PRIORITY_LEVELS)."""
        if level is None or level == 0:
            return
        if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= levels:
            raise self.invalid(f"priority must be an integer from 0 to {levels} (1 is the most urgent; 0: the "
                           f"key's level; VIT_SERVE_PRIORITY_LEVELS is {levels})")
        self.priority = max(self.priority, level, self.caller.priority)

    def v2_parameters(self, parameters: dict[str, Any], levels: int) -> None:
        """`parameters.timeout` (microseconds; 0: none) and `parameters.priority` (at most `levels`) of a /v2 or
        gRPC request."""
        timeout = parameters.get("timeout")
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 <= timeout < math.inf:
                raise self.invalid("parameters.timeout is in microseconds: a finite number >= 0 (0: no "
                                   "timeout)")
            if timeout > 0:
                self.within(timeout / 1e6, "parameters.timeout")
        self.lowered(parameters.get("priority"), levels)

    # ---- progress ---------------------------------------------------------------------------------------

    def remaining(self, now: float | None = None) -> float | None:
        """Seconds left before the deadline at `now` (default: `PERF_CLOCK.now()`; None: no deadline; <= 0:
        past)."""
        if self.deadline is None:
            return None
        return self.deadline - (PERF_CLOCK.now() if now is None else now)

    def check_deadline(self, where: str, now: float | None = None) -> None:
        """`DeadlineError` now if the deadline has already passed."""
        left = self.remaining(now)
        if left is not None and left <= 0:
            raise deadline_exceeded(f"{where}, {-left * 1e3:.0f} ms after it")

    def at(self, stage: Stage) -> None:
        """The request has reached `stage`."""
        self.stage = stage

    def caller_left(self) -> bool:
        """Its caller went away (said before its work is cancelled): whether whoever noticed counts it. Once a
        request is counted at most: False when it was said before, and False while a runner holds it (`held`),
        for the runner reports it (`SchedulerEvents.cancelled`) as the cancellation reaches it."""
        if self.cancelled:
            return False
        self.cancelled = True
        return not self.held
