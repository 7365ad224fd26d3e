"""`BatchingRunner`: the queue (`pending`), one collector task choosing batches (`policy`, in the order its
docstring states), and the version's model instances (`instances`), over a local backend.

Requests wait in a bounded queue (full: `QueueFullError`). A request of more than `max_batch` images is queued as
consecutive parts of at most `max_batch` rows, each a queue entry; its answer is the parts' outputs joined, and a
part that fails or times out drops the parts not yet started. The collector waits for a batch to fill at most
`max_delay_ms` after its first request arrived, and only while more are known to be coming (`Arrival`): a lone
request never waits for nothing, and the model is never idle while requests wait. Batches run in the version's
model threads (`instances` of them where the backend allows it), so the event loop stays free. A request not
answered within `request_timeout_s` of being queued, or by its deadline, gets `DeadlineError`; its rows are
dropped if they have not started. A request whose caller went away (its task cancelled) leaves the queue and any
batch that has not started, and is reported cancelled at its stage, queue or infer (`RunnerBase.holding`). Time is
read from the injected clock only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from concurrent.futures import Executor

import numpy as np

from vit_serve.runtime.backends.base import LocalBackend
from vit_serve.runtime.batch_curve import BatchCurve
from vit_serve.runtime.errors import ServingError
from vit_serve.runtime.scheduling import policy
from vit_serve.runtime.scheduling.arrivals import STALL_S, Arrival
from vit_serve.runtime.scheduling.base import BatchingInfo, RunnerBase
from vit_serve.runtime.scheduling.clock import PERF_CLOCK, Clock
from vit_serve.runtime.scheduling.cost import CostModel
from vit_serve.runtime.scheduling.errors import NotReadyError, QueueFullError, deadline_exceeded
from vit_serve.runtime.scheduling.events import SchedulerEvents
from vit_serve.runtime.scheduling.execution import BatchRun
from vit_serve.runtime.scheduling.instances import Instances
from vit_serve.runtime.scheduling.pending import Entry, PendingQueue
from vit_serve.runtime.scheduling.result import Result
from vit_serve.runtime.scheduling.ticket import Ticket
from vit_serve.runtime.settings import RunnerLimits
from vit_serve.runtime.task import Task

log = logging.getLogger("vit_serve.serve")


class BatchingRunner(RunnerBase):
    """Queue + collector + the version's model threads."""

    def __init__(self, backend: LocalBackend, limits: RunnerLimits, events: SchedulerEvents | None,
                 executor: Executor, clock: Clock = PERF_CLOCK) -> None:
        super().__init__(backend, limits, events, executor, clock)
        self.local = backend
        self.delay_s = limits.max_delay_ms / 1e3  # 0: never wait for a batch to fill
        # batches the model may run at once (Triton's instance_group count), on a backend that allows it
        instances = limits.instances if backend.concurrent else 1
        if limits.instances > 1 and not backend.concurrent:
            log.warning("the %s backend runs one batch at a time: instances=%d is not used", backend.name,
                        limits.instances)
        self.cost = CostModel(limits.max_batch if limits.batching else 1, instances)
        self.pending = PendingQueue(limits.max_queue)
        self.group = Instances(instances, clock, self.events)  # the instance group and its batches
        self.seen: dict[int, float] = {}  # priority level -> when its latest request was queued
        self._collector: asyncio.Task[None] | None = None
        self._runs: set[asyncio.Task[None]] = set()

    @property
    def max_batch(self) -> int:
        """The largest batch it runs (the configured one, less where the batch curve says larger do not pay)."""
        return self.cost.max_batch

    @property
    def curve(self) -> BatchCurve | None:
        return self.cost.curve

    @property
    def instances(self) -> int:
        """Batches the model may run at once."""
        return self.group.count

    @property
    def measures_curve(self) -> bool:  # type: ignore[override]
        return self.max_batch > 1 and self.limits.batch_curve

    @property
    def batching(self) -> BatchingInfo:
        curve = self.curve.per_image_s if self.curve is not None else {}
        return BatchingInfo(self.max_batch, self.delay_s * 1e3, {b: 1 / s for b, s in sorted(curve.items())},
                            self.instances)

    def use_curve(self, curve: BatchCurve) -> None:
        """Batch as far as the model's measured batch curve says pays (`BatchCurve.limit`), and wait for a batch
        to fill only when it pays (`BatchCurve.worth_waiting`); the configured max_batch stays the ceiling."""
        self.cost.use_curve(curve)
        if not curve.worth_waiting:
            self.delay_s = 0.0

    def snapshot(self) -> policy.QueueSnapshot:
        return policy.QueueSnapshot(self.pending.snapshot(), dict(self.seen))

    def start(self) -> None:
        if self._collector is None:
            self._collector = asyncio.get_running_loop().create_task(self._collect(), name="vit-serve-batcher")

    async def stop(self) -> None:
        if self._collector is not None:
            # Cancelled until it is done: Python 3.11's asyncio.wait_for returns the inner result instead of
            # raising when a cancellation and the awaited event coincide, so one cancel() can be swallowed.
            while not self._collector.done():
                self._collector.cancel()
                await asyncio.wait({self._collector}, timeout=0.05)
            with contextlib.suppress(asyncio.CancelledError):
                await self._collector
            self._collector = None
        for item in [*self.group.entries, *self.pending]:
            if not item.future.done():
                item.future.set_exception(NotReadyError("the model is being unloaded"))
        for run in list(self._runs):
            run.cancel()
        self.pending.clear()
        self.group.clear()
        self.events.queued(0)

    def refuse_waiting(self, error: ServingError) -> int:
        """Answer every request still waiting (not in a running batch) with `error`; how many there were."""
        waiting = list(self.pending)
        self._drop(*waiting)
        for item in waiting:
            if not item.future.done():
                item.future.set_exception(error)
        return len(waiting)

    @property
    def depth(self) -> int:
        """Requests waiting (not yet in a running batch)."""
        return len(self.pending)

    def coming(self, level: int | None = None, now: float | None = None) -> int:
        """Requests announced and not yet queued that count as coming (`live_arrivals`: not stalled, at most
        max_batch x instances), at `level` or a more urgent one (all levels without one)."""
        now = self.clock.now() if now is None else now
        return self.arrivals.coming(now, self.max_batch * self.group.count, level)

    @property
    def running(self) -> int:
        """Images in the batches the model is running now."""
        return sum(item.rows for item in self.group.entries)

    async def submit(self, task: Task, x: np.ndarray, arrival: Arrival | None = None,
                     ticket: Ticket | None = None) -> Result:
        """x [n, 3, H, W] float32 -> this request's outputs (in parts of at most max_batch rows); QueueFullError /
        DeadlineError."""
        ticket = self._admit(ticket, arrival)
        loop, now = asyncio.get_running_loop(), self.clock.now()
        deadline = min(ticket.deadline or math.inf, now + self.timeout_s)
        items = [Entry(task, part, loop.create_future(), ticket, deadline, now) for part in self.parts(x)]
        try:
            self._make_room(items)
            if ticket.deadline is not None:  # else nothing to refuse: skip counting the queue (each request pays it)
                ahead = self.pending.ahead(task, lambda i: i.order < items[0].order)
                self._refuse_unless_in_time(task, ticket, ahead, x.shape[0], now)
        except ServingError:
            if arrival is not None:
                arrival.done()
            raise
        self.pending.add(items)
        self.seen[ticket.priority] = now
        self.events.queued(len(self.pending))
        ticket.at("queue")
        if arrival is not None:
            arrival.done()
        self.arrivals.news.set()
        with self.holding(ticket):
            try:
                wait = self._wait_s(ticket)
                if len(items) == 1:
                    return await asyncio.wait_for(items[0].future, wait)
                results = await asyncio.wait_for(asyncio.gather(*(item.future for item in items)), wait)
            except TimeoutError:
                self._drop(*items)
                raise self._timed_out(ticket) from None
            except BaseException:  # a part failed (the others not started are dropped), or the client went away
                self._drop(*items)
                raise
        return Result.joined(list(results))

    def _make_room(self, items: list[Entry]) -> None:
        """Room in the queue for `items`: shed the least urgent, newest requests waiting at a level below theirs
        (each refused with QueueFullError), or refuse `items` when that is not enough."""
        shed = self.pending.to_shed(len(items), items[0].level)
        if shed is None:
            raise self._full(f"queue full ({self.pending.max_queue} requests waiting)")
        self._drop(*shed)
        for item in shed:
            self.events.shed()
            if not item.future.done():
                item.future.set_exception(QueueFullError(
                    "shed for more urgent requests (the queue is full); retry later", retry_after=self.retry_after))

    def check_arrival(self, task: Task, ticket: Ticket) -> None:
        """As the request arrives, before its body is read: refuse it now if the work already ahead of it (what
        waits at its level or a more urgent one, and every request being read or decoded, itself among them)
        leaves no time before its deadline, or if the queue is full with nothing less urgent to shed."""
        level = ticket.priority
        if self.pending.to_shed(1, level) is None:  # nothing is shed yet: the request may never arrive
            raise self._full(f"queue full ({self.pending.max_queue} requests waiting)")
        if ticket.deadline is None:
            return
        ahead = self.pending.ahead(task, lambda i: i.level <= level)
        now = self.clock.now()
        coming = self.coming(level, now)  # itself among them (just announced: not stalled)
        self._refuse_unless_in_time(task, ticket, ahead + max(0, coming - 1), 1, now)

    def _refuse_unless_in_time(self, task: Task, ticket: Ticket, ahead: int, rows: int, now: float) -> None:
        finish = policy.finish_at(self.snapshot(), self.group.snapshot(), self.cost, now, task.kind, ahead, rows)
        if ticket.deadline is not None and finish is not None and finish > ticket.deadline:
            self.events.rejected("deadline")
            raise deadline_exceeded(f"{(ticket.deadline - now) * 1e3:.0f} ms left, and the batches "
                                    f"ahead of it need about {(finish - now) * 1e3:.0f} ms")

    def _drop(self, *items: Entry) -> None:
        self.pending.drop(*items)
        self.events.queued(len(self.pending))

    async def _collect(self) -> None:
        while True:
            try:
                await self._next_batch()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not stall every later request
                log.exception("batcher error")

    def _expire(self) -> None:
        """Drop the requests waiting past their deadline, or too close to it for one more batch."""
        late = self.pending.late(self.clock.now(), lambda i: policy.margin_s(i, self.cost))
        if not late:
            return
        self._drop(*late)
        for item in late:
            if not item.future.done():
                item.future.set_exception(self._timed_out(item.ticket))

    async def _next_batch(self) -> None:
        await self.group.wait_free()  # every instance busy: choose the next batch when one is free
        self._expire()
        if self.group.grant(self.pending.first().order if self.pending else None):
            await asyncio.sleep(0)  # the batch resumes before the next is chosen
            return
        if not self.pending:
            self.arrivals.news.clear()
            await self.arrivals.news.wait()
            return
        first = self.pending.first()
        wait = policy.kept_for_urgent(self.snapshot(), self.group.snapshot(), first,
                                      BatchRun.stageable(self.local, first), self.clock.now())
        if wait > 0:
            await _first_of((self.group.freed, self.arrivals.news), wait)  # an instance, a request, or quiet
            return
        if not await self._filled(first):
            return
        batch = self._take(first.task)
        run = asyncio.get_running_loop().create_task(BatchRun(self, first.task, batch).run())
        self._runs.add(run)
        run.add_done_callback(self._runs.discard)
        await asyncio.sleep(0)  # let the run take its lane before the next batch is chosen

    async def _filled(self, first: Entry) -> bool:
        """Wait for `first`'s batch to fill (see the module's docstring); False when `first` left or a more
        urgent request came meanwhile (start over)."""
        if self.max_batch <= 1 or self.delay_s <= 0 or self.pending.rows(first.task) >= self.max_batch:
            return True
        deadline = first.t0 + self.delay_s
        while self.coming() > 0 and (remaining := deadline - self.clock.now()) > 0:
            self.arrivals.news.clear()
            try:  # no longer than until the newest of them would count as stalled: then count again
                await asyncio.wait_for(self.arrivals.news.wait(), min(remaining, STALL_S))
            except TimeoutError:
                continue
            if first not in self.pending or self.pending.first() is not first:
                return False
            if self.pending.rows(first.task) >= self.max_batch:
                break
        return True

    def _take(self, task: Task) -> list[Entry]:
        """Remove and return the batch of `task` (`policy.batch_limit`, `policy.choose`)."""
        ordered = self.pending.of_task(task)
        limit = policy.batch_limit(self.snapshot(), self.group.snapshot(), self.cost, ordered, self.clock.now())
        batch = policy.choose(ordered, limit)
        self.pending.take(batch)
        self.events.queued(len(self.pending))
        return batch


async def _first_of(events: tuple[asyncio.Event, ...], timeout: float) -> None:
    """Until one of `events` is set (cleared first), or `timeout` seconds pass."""
    for e in events:
        e.clear()
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
