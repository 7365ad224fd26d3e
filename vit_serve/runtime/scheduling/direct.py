"""`DirectRunner`: a backend whose server batches (Triton). Each request is sent as it comes, in parts of at most
`max_batch` rows, with the batching runner's limits (at most `max_queue` parts outstanding, the same timeout)."""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

import numpy as np

from vit_serve.runtime.backends.base import CallOptions, RemoteBackend
from vit_serve.runtime.errors import ServingError
from vit_serve.runtime.scheduling.arrivals import Arrival
from vit_serve.runtime.scheduling.base import RunnerBase
from vit_serve.runtime.scheduling.clock import PERF_CLOCK, Clock
from vit_serve.runtime.scheduling.events import SchedulerEvents
from vit_serve.runtime.scheduling.result import Result
from vit_serve.runtime.scheduling.ticket import DEFAULT_PRIORITY, Ticket
from vit_serve.runtime.settings import RunnerLimits
from vit_serve.runtime.task import Task


class DirectRunner(RunnerBase):
    """Each request straight to the backend (a server that batches on its own), at most max_queue outstanding."""

    def __init__(self, backend: RemoteBackend, limits: RunnerLimits, events: SchedulerEvents | None,
                 executor: Executor, clock: Clock = PERF_CLOCK) -> None:
        super().__init__(backend, limits, events, executor, clock)
        self.remote = backend
        self._outstanding = 0

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        self.events.queued(0)

    @property
    def depth(self) -> int:
        """Requests sent and not answered."""
        return self._outstanding

    @property
    def running(self) -> int:
        return self._outstanding

    async def submit(self, task: Task, x: np.ndarray, arrival: Arrival | None = None,
                     ticket: Ticket | None = None) -> Result:
        ticket = self._admit(ticket, arrival)
        if arrival is not None:
            arrival.done()
        parts = self.parts(x)
        if self._outstanding + len(parts) > self.limits.max_queue:
            raise self._full(f"{self.limits.max_queue} requests outstanding")
        self._outstanding += len(parts)
        self.events.queued(self._outstanding)
        ticket.at("infer")  # sent: the server has it (a cancel closes the call: the Triton backend)
        with self.holding(ticket):  # a caller gone meanwhile: reported at infer
            try:
                options = CallOptions(ticket.remaining(self.clock.now()),
                                      0 if ticket.priority == DEFAULT_PRIORITY else ticket.priority)
                results = await asyncio.wait_for(asyncio.gather(*(self._send(task, p, options) for p in parts)),
                                                 self._wait_s(ticket))
            except TimeoutError:
                raise self._timed_out(ticket) from None
        return Result.joined(list(results))

    def check_arrival(self, task: Task, ticket: Ticket) -> None:
        """Nothing to predict: the server queues (its deadline goes with the call)."""

    def refuse_waiting(self, error: ServingError) -> int:
        """Nothing waits here: the server queues (0)."""
        return 0

    async def _send(self, task: Task, x: np.ndarray, options: CallOptions) -> Result:
        t0 = self.clock.now()
        try:
            outputs = await self.remote.run(task, x, options)
        finally:
            self._outstanding -= 1
            self.events.queued(self._outstanding)
        infer_ms = (self.clock.now() - t0) * 1e3
        self.events.batch(task.kind, x.shape[0], [])
        self.events.ran(task.kind, infer_ms / 1e3)
        return Result(outputs, 0.0, infer_ms, x.shape[0])
