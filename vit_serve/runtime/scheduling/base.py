"""What both runners share (`RunnerBase`): the limits, the clock, the events, the model thread, the arrivals,
and how a request is admitted, split into parts, and refused."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from vit_serve.runtime.backends.base import Backend
from vit_serve.runtime.scheduling.arrivals import Arrival, Arrivals
from vit_serve.runtime.scheduling.clock import PERF_CLOCK, Clock
from vit_serve.runtime.scheduling.errors import (
    DeadlineError,
    QueueFullError,
    deadline_exceeded,
    request_timed_out,
)
from vit_serve.runtime.scheduling.events import NoEvents, SchedulerEvents
from vit_serve.runtime.scheduling.ticket import DEFAULT_PRIORITY, Ticket
from vit_serve.runtime.settings import RunnerLimits

T = TypeVar("T")


@dataclass(frozen=True)
class BatchingInfo:
    """How a batching runner batches: its largest batch, its wait for one to fill, the measured images/s by batch
    size (empty: not measured) and its instances."""

    max_batch: int
    max_delay_ms: float
    images_per_s: dict[int, float] = field(default_factory=dict)
    instances: int = 1


class RunnerBase:
    """The limits, the clock, the events, the model thread, the arrivals."""

    measures_curve = False  # whether the version should measure its model's batch curve for it (`use_curve`)

    def __init__(self, backend: Backend, limits: RunnerLimits, events: SchedulerEvents | None, executor: Executor,
                 clock: Clock = PERF_CLOCK) -> None:
        self.backend = backend
        self.executor = executor
        self.events: SchedulerEvents = events if events is not None else NoEvents()
        self.clock = clock
        self.limits = limits
        self.timeout_s = limits.request_timeout_s
        self.retry_after = str(limits.retry_after_s)
        self.arrivals = Arrivals()

    @property
    def batching(self) -> BatchingInfo | None:
        """How it batches (None: it does not, the server does)."""
        return None

    def arriving(self, priority: int = DEFAULT_PRIORITY) -> Arrival:
        """Announce a request (at level `priority`) that will be submitted once its image is decoded."""
        return Arrival(self.arrivals, priority)

    def parts(self, x: np.ndarray) -> list[np.ndarray]:
        """x split into consecutive views of at most max_batch rows (x itself when it fits)."""
        n = self.limits.max_batch
        return [x] if x.shape[0] <= n else [x[i:i + n] for i in range(0, x.shape[0], n)]

    @property
    def incoming(self) -> int:
        """Requests announced and not yet queued (stalled uploads too)."""
        return len(self.arrivals)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` in the model thread (between batches): loading, warm-up, maintenance."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _full(self, what: str) -> QueueFullError:
        self.events.rejected("queue_full")
        return QueueFullError(f"{what}; retry later", retry_after=self.retry_after)

    def _timed_out(self, ticket: Ticket | None = None) -> DeadlineError:
        if ticket is not None and ticket.deadline is not None and ticket.deadline <= ticket.arrived + self.timeout_s:
            self.events.rejected("deadline")
            return deadline_exceeded("while it waited for the model")
        self.events.rejected("timeout")
        return request_timed_out(self.timeout_s)

    def _admit(self, ticket: Ticket | None, arrival: Arrival | None) -> Ticket:
        """The request's ticket (a default one: no deadline, the default level), refused here if its deadline has
        already passed."""
        ticket = ticket or Ticket(arrived=self.clock.now())
        left = ticket.remaining(self.clock.now())
        if left is not None and left <= 0:
            if arrival is not None:
                arrival.done()
            self.events.rejected("deadline")
            raise deadline_exceeded(f"before it reached the queue, {-left * 1e3:.0f} ms after it")
        return ticket

    @contextlib.contextmanager
    def holding(self, ticket: Ticket) -> Iterator[Ticket]:
        """The runner holds `ticket` (queued, or in a batch) while the block runs: a cancellation that reaches it
        there, its caller gone (`Ticket.caller_left`), is reported at the stage it reached (an unload's is not)."""
        ticket.held = True
        try:
            yield ticket
        except asyncio.CancelledError:
            if ticket.cancelled:
                self.events.cancelled(ticket.stage)
            raise
        finally:
            ticket.held = False

    def _wait_s(self, ticket: Ticket) -> float:
        """How long the request may wait for its answer: the request timeout, or less to its deadline, a little
        before it (at most 10 ms) so that the 504 leaves before the client's own clock, and a gRPC call's, runs
        out."""
        left = ticket.remaining(self.clock.now())
        if left is None:
            return self.timeout_s
        return max(0.0, min(self.timeout_s, left - min(0.01, 0.05 * left)))
