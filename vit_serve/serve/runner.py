"""How a model version is driven: a batching runner (local backends) or a direct one (a server that batches).

`BatchingRunner`: requests wait in a bounded queue (full: `QueueFullError`, answered 503 + Retry-After). A request
of more than `max_batch` images (`max_images_per_request` allows it) is queued as consecutive parts of at most
`max_batch` rows, each a queue entry, so that no batch the model runs is larger than `max_batch`; its answer is the
parts' outputs joined, and a part that fails or times out drops the parts not yet started. One collector task takes
the oldest request and every waiting request with the same `Task`, up to `max_batch` images. It waits for more at
most `max_delay_ms` after the oldest one arrived, and only while more are known to be coming (`Arrival`: requests
whose body is being read or decoded): a lone request never waits for nothing, and the model is never idle while
requests wait (whatever queued up during a run goes straight into the next). With the model's batch curve
(`use_curve`: its time per image by batch size, measured at warm-up, `vit_serve.runtime.batch_curve`), a batch
holds no more rows than pay, and the collector waits for a batch to fill only where waiting pays (on a CPU where
batch 1 is as fast per image as batch 8 it never waits). Batches run in the version's own model thread, so the
model runs one batch at a time and the event loop stays free; with `instances` n (Triton's instance_group count)
the version has n model threads and up to n batches run at once, the next batch chosen when one of them is free. A
request not answered within `request_timeout_s` of being queued gets `GatewayTimeoutError` (504); its rows are
dropped if they have not started.

`DirectRunner` (Triton, whose server batches): each request is sent as it comes, in the same parts of at most
`max_batch` rows, with the same limits (at most `max_queue` parts outstanding, the same timeout).

Every request comes with its `Admission` (`vit_serve.serve.admission`: priority level, deadline, caller). The
batching runner takes the most urgent level first, and within a level the earliest deadline (a request without one
has its queueing time + `request_timeout_s`, so that equal requests keep their arrival order). A request whose
deadline has passed, or that cannot finish in time behind the work ahead of it (by the batch curve scaled to how
fast recent batches ran, else their run time per image; the work shared among the instances, and where batching pays
a full batch's time kept for its own), is refused with `GatewayTimeoutError` (504): as it arrives, before its body
is read (`check_arrival`, the routes that take an upload), and again at the queue; one that reaches its deadline, or
too near it for its own batch, while waiting is dropped before its batch starts, instead of being run late. A batch
holds one level only (urgent work never waits for less urgent rows topping up its batch), and no more rows than its
first request's deadline leaves time for (with room for how far recent batches missed their predicted time); while a
more urgent level has traffic, a less urgent batch holds one image (the urgent level's next request waits behind no
more than that) and, where the backend runs the task in stages (`LocalBackend.staged`: the torch backend's encoder
blocks), runs a stage at a time in the model thread: when a more urgent request waits and every instance is busy,
it gives its instance up between two stages and waits, partly done, until the collector hands one back (before
any new batch of its level or below). Where batching does not pay, a batch takes no more than its share of the
waiting rows of its level among the instances that would finish them first (`_share`). A full queue sheds its
least urgent, newest request (503 + Retry-After) for a more urgent one;
shadow copies (`admission.SHADOW`) are below every level. A request whose caller went away (its task cancelled:
`hangup`, a gRPC cancel) leaves the queue and any batch that has not started.

Both take the same `RunnerLimits` (`vit_serve.runtime.settings`: the gateway's, or those of the model's own
config) and report to the version's `ModelMetrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from vit_serve.runtime.backends.base import Backend, CallOptions, LocalBackend, RemoteBackend, Staged
from vit_serve.runtime.batch_curve import BatchCurve
from vit_serve.runtime.settings import RunnerLimits
from vit_serve.runtime.task import Outputs, Task
from vit_serve.serve.admission import DEFAULT_PRIORITY, Admission, deadline_exceeded
from vit_serve.serve.errors import GatewayError, GatewayTimeoutError, NotReadyError, QueueFullError
from vit_serve.serve.metrics import ModelMetrics

log = logging.getLogger("vit_serve.serve")
T = TypeVar("T")

# A level counts as active while one of its requests arrived this recently: less urgent batches hold one image
# meanwhile. 2 s is some six gaps between arrivals of a level at a few requests a second (a Poisson gap
# that long is rarer than 1 in 300), short enough to let the less urgent level batch again soon after.
ACTIVE_S = 2.0
# An upload being read counts as coming (the batcher may wait for it; deadlines count it as work ahead) while its
# latest bytes came at most this long ago. A live upload's bytes come every few milliseconds, and a lost segment
# stalls it for one TCP retransmission timeout (200 ms at least on Linux); one stalled longer is slow or abusive.
# Taking a live upload for stalled costs little (it joins the next batch); the other way round, batches wait and
# deadlines are refused for uploads that may never come.
STALL_S = 0.25


def live_arrivals(heard: Iterable[tuple[int, float | None]], now: float, cap: int, level: int | None = None,
                  stall_s: float = STALL_S) -> int:
    """How many announced requests count as coming at `now`: those at `level` or a more urgent one (every level
    without one) whose latest bytes came within `stall_s` (a time of None: no body being read, e.g. one being
    decoded, never stalls), at most `cap` (the batches the model can run next hold no more). `heard`: (level,
    when its latest bytes came) per request."""
    n = sum(1 for lv, t in heard if (level is None or lv <= level) and (t is None or now - t <= stall_s))
    return min(n, cap)


@dataclass(frozen=True)
class Result:
    """A request's slice of its batch's outputs, with its queue wait, the batch's run time and size."""

    outputs: Outputs
    queue_ms: float
    infer_ms: float
    batch_size: int

    @staticmethod
    def joined(parts: list[Result]) -> Result:
        """The answer of a request run as several parts: their outputs concatenated in order, the longest queue
        wait, the model time of all of them, the largest batch."""
        if len(parts) == 1:
            return parts[0]
        outputs = {k: np.concatenate([p.outputs[k] for p in parts]) for k in parts[0].outputs}
        return Result(outputs, max(p.queue_ms for p in parts), sum(p.infer_ms for p in parts),
                      max(p.batch_size for p in parts))

    def timing_ms(self, decode_ms: float, total_ms: float) -> dict[str, float]:
        """The answer's `timing_ms` (schemas.Timing): decode, queue, infer, total and the batch size."""
        return {"decode": decode_ms, "queue": self.queue_ms, "infer": self.infer_ms, "total": total_ms,
                "batch_size": self.batch_size}


class Arrival:
    """A request on its way to the queue (body being read, image being decoded): the collector may wait for it.

    Use as a context manager around reading + decoding + `submit(..., arrival)`; it stops counting when the
    request is queued or when it fails before that. `priority`: its level as far as known (the caller's key).
    While its body is read, `heard_from(clock)` tells when its latest bytes came (an object with `last`,
    `time.perf_counter()` seconds): once they stall it no longer counts as coming (`live_arrivals`).
    """

    def __init__(self, batcher: BatchingRunner | DirectRunner, priority: int = DEFAULT_PRIORITY) -> None:
        self._batcher: BatchingRunner | DirectRunner | None = batcher
        self.priority = priority
        self.clock: Any = None  # when its latest bytes came (`last`), while its body is read
        batcher._incoming.add(self)

    @property
    def heard(self) -> float | None:
        """When its latest bytes came (None: not reading a body: it does not stall)."""
        return None if self.clock is None else self.clock.last

    def heard_from(self, clock: Any) -> None:
        """Age this arrival by `clock.last` (the request's body clock) from now on; None: never."""
        self.clock = clock

    def done(self) -> None:
        if self._batcher is not None:
            self._batcher._incoming.discard(self)
            self._batcher._arrival.set()  # the collector re-checks whether to keep waiting
            self._batcher = None

    def __enter__(self) -> Arrival:
        return self

    def __exit__(self, *exc: object) -> None:
        self.done()


@dataclass(eq=False)
class _Lane:
    """A batch holding a model instance, when it started (less the time it was paused: `_busy_s` predicts its
    end from it), and whether it runs in stages (it gives the instance up to more urgent work)."""

    batch: list[_Item]
    started: float
    staged: bool = False

    @property
    def level(self) -> int:
        return self.batch[0].admission.priority


@dataclass(eq=False)
class _Paused:
    """A staged batch that gave its instance to more urgent work (`_yield_lane`), waiting for the collector to
    give one back (`resume`)."""

    lane: _Lane
    resume: asyncio.Future[None]

    @property
    def order(self) -> tuple[int, float, float]:
        return self.lane.batch[0].order


@dataclass(eq=False, repr=False)  # no repr: deque.remove's "not in deque" error formats it (numpy's printer)
class _Item:
    task: Task
    x: np.ndarray  # [n, 3, H, W]
    future: asyncio.Future[Result]
    admission: Admission
    deadline: float  # perf_counter seconds: the admission's, else queued + request_timeout_s
    t0: float = field(default_factory=time.perf_counter)

    @property
    def rows(self) -> int:
        return self.x.shape[0]

    @property
    def order(self) -> tuple[int, float, float]:
        """The most urgent level first, then the earliest deadline, then the oldest."""
        return self.admission.priority, self.deadline, self.t0


class _Runner:
    """What both runners share: the limits, the metrics, the model thread, the arrivals."""

    def __init__(self, backend: Backend, limits: RunnerLimits, metrics: ModelMetrics, executor: Executor) -> None:
        self.backend = backend
        self.executor = executor
        self.metrics = metrics
        self.limits = limits
        self.timeout_s = limits.request_timeout_s
        self.retry_after = str(limits.retry_after_s)
        self._arrival = asyncio.Event()
        self._incoming: set[Arrival] = set()  # Arrivals not yet queued

    def arriving(self, priority: int = DEFAULT_PRIORITY) -> Arrival:
        """Announce a request (at level `priority`) that will be submitted once its image is decoded."""
        return Arrival(self, priority)

    def parts(self, x: np.ndarray) -> list[np.ndarray]:
        """x split into consecutive views of at most max_batch rows (x itself when it fits)."""
        n = self.limits.max_batch
        return [x] if x.shape[0] <= n else [x[i:i + n] for i in range(0, x.shape[0], n)]

    @property
    def incoming(self) -> int:
        """Requests announced and not yet queued (stalled uploads too)."""
        return len(self._incoming)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` in the model thread (between batches): loading, warm-up, maintenance."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _full(self, what: str) -> QueueFullError:
        self.metrics.rejected("queue_full").inc()
        return QueueFullError(f"{what}; retry later", headers={"Retry-After": self.retry_after})

    def _timed_out(self, admission: Admission | None = None) -> GatewayTimeoutError:
        if admission is not None and admission.deadline is not None and \
                admission.deadline <= admission.arrived + self.timeout_s:
            self.metrics.rejected("deadline").inc()
            return deadline_exceeded("while it waited for the model")
        self.metrics.rejected("timeout").inc()
        return GatewayTimeoutError(f"no answer within {self.timeout_s:g} s (VIT_SERVE_REQUEST_TIMEOUT_S)")

    def _admit(self, admission: Admission | None, arrival: Arrival | None) -> Admission:
        """The request's admission (a default one: no deadline, the default level), refused with 504 here if its
        deadline has already passed."""
        admission = admission or Admission()
        left = admission.remaining()
        if left is not None and left <= 0:
            if arrival is not None:
                arrival.done()
            self.metrics.rejected("deadline").inc()
            raise deadline_exceeded(f"before it reached the queue, {-left * 1e3:.0f} ms after it")
        return admission

    def _wait_s(self, admission: Admission) -> float:
        """How long the request may wait for its answer: the request timeout, or less to its deadline, a little
        before it (at most 10 ms) so that the 504 leaves before the client's own clock, and a gRPC call's, runs out."""
        left = admission.remaining()
        if left is None:
            return self.timeout_s
        return max(0.0, min(self.timeout_s, left - min(0.01, 0.05 * left)))


class DirectRunner(_Runner):
    """Each request straight to the backend (a server that batches on its own), at most max_queue outstanding."""

    def __init__(self, backend: RemoteBackend, limits: RunnerLimits, metrics: ModelMetrics,
                 executor: Executor) -> None:
        super().__init__(backend, limits, metrics, executor)
        self.remote = backend
        self._outstanding = 0

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        self.metrics.queue_depth.set(0)

    @property
    def depth(self) -> int:
        """Requests sent and not answered."""
        return self._outstanding

    @property
    def running(self) -> int:
        return self._outstanding

    async def submit(self, task: Task, x: np.ndarray, arrival: Arrival | None = None,
                     admission: Admission | None = None) -> Result:
        admission = self._admit(admission, arrival)
        if arrival is not None:
            arrival.done()
        parts = self.parts(x)
        if self._outstanding + len(parts) > self.limits.max_queue:
            raise self._full(f"{self.limits.max_queue} requests outstanding")
        self._outstanding += len(parts)
        self.metrics.queue_depth.set(self._outstanding)
        admission.at("infer")  # sent: the server has it (a cancel closes the call: the Triton backend)
        try:
            options = CallOptions(admission.remaining(),
                                  0 if admission.priority == DEFAULT_PRIORITY else admission.priority)
            results = await asyncio.wait_for(asyncio.gather(*(self._send(task, p, options) for p in parts)),
                                             self._wait_s(admission))
        except TimeoutError:
            raise self._timed_out(admission) from None
        return Result.joined(list(results))

    def check_arrival(self, task: Task, admission: Admission) -> None:
        """Nothing to predict: the server queues (its deadline goes with the call)."""

    def refuse_waiting(self, error: GatewayError) -> int:
        """Nothing waits here: the server queues (0)."""
        return 0

    async def _send(self, task: Task, x: np.ndarray, options: CallOptions) -> Result:
        t0 = time.perf_counter()
        try:
            outputs = await self.remote.run(task, x, options)
        finally:
            self._outstanding -= 1
            self.metrics.queue_depth.set(self._outstanding)
        infer_ms = (time.perf_counter() - t0) * 1e3
        self.metrics.batch_size(task.kind).observe(x.shape[0])
        self.metrics.inference(task.kind).observe(infer_ms / 1e3)
        return Result(outputs, 0.0, infer_ms, x.shape[0])


class BatchingRunner(_Runner):
    """Queue + collector + the version's single model thread."""

    def __init__(self, backend: LocalBackend, limits: RunnerLimits, metrics: ModelMetrics,
                 executor: Executor) -> None:
        super().__init__(backend, limits, metrics, executor)
        self.local = backend
        self.max_batch = limits.max_batch if limits.batching else 1  # the largest batch run (`use_curve`)
        self.delay_s = limits.max_delay_ms / 1e3  # 0: never wait for a batch to fill
        self.curve: BatchCurve | None = None
        self.max_queue = limits.max_queue
        self._pending: deque[_Item] = deque()
        self._rows: dict[Task, int] = {}  # waiting rows per task
        self._collector: asyncio.Task[None] | None = None
        # batches the model may run at once (Triton's instance_group count), on a backend that allows it
        self.instances = limits.instances if backend.concurrent else 1
        if limits.instances > 1 and not backend.concurrent:
            log.warning("the %s backend runs one batch at a time: instances=%d is not used", backend.name,
                        limits.instances)
        self._lanes: list[_Lane] = []  # the batches running now
        self._paused: list[_Paused] = []  # staged batches waiting for an instance (`_yield_lane`)
        self._lane_free = asyncio.Event()
        self._runs: set[asyncio.Task[None]] = set()
        self._row_s: dict[str, float] = {}  # recent run time per image, per task kind (an EWMA), for deadlines
        self._slow: dict[str, float] = {}  # recent run time / the batch curve's, per task kind (an EWMA)
        self._overrun: dict[str, float] = {}  # recent run time over its prediction, relative, per task kind (EWMA)
        self._seen: dict[int, float] = {}  # priority level -> when its latest request was queued

    # ---- lifecycle -------------------------------------------------------------------------------------

    def use_curve(self, curve: BatchCurve) -> None:
        """Batch as far as the model's measured batch curve says pays (`BatchCurve.limit`), and wait for a batch
        to fill only when it pays (`BatchCurve.worth_waiting`); the configured max_batch stays the ceiling."""
        self.curve = curve
        self.max_batch = min(self.max_batch, curve.limit)
        if not curve.worth_waiting:
            self.delay_s = 0.0

    def start(self) -> None:
        if self._collector is None:
            self._collector = asyncio.get_running_loop().create_task(self._collect(), name="vit-serve-batcher")

    async def stop(self) -> None:
        if self._collector is not None:
            self._collector.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._collector
            self._collector = None
        for item in [*self._running, *self._pending]:
            if not item.future.done():
                item.future.set_exception(NotReadyError("the model is being unloaded"))
        for run in list(self._runs):
            run.cancel()
        self._pending.clear()
        self._lanes = []
        self._paused = []
        self._rows.clear()
        self.metrics.queue_depth.set(0)

    def refuse_waiting(self, error: GatewayError) -> int:
        """Answer every request still waiting (not in the running batch) with `error`; how many there were."""
        waiting = list(self._pending)
        self._drop(*waiting)
        for item in waiting:
            if not item.future.done():
                item.future.set_exception(error)
        return len(waiting)

    @property
    def depth(self) -> int:
        """Requests waiting (not yet in a running batch)."""
        return len(self._pending)

    def coming(self, level: int | None = None, now: float | None = None) -> int:
        """Requests announced and not yet queued that count as coming (`live_arrivals`: not stalled, at most
        max_batch x instances), at `level` or a more urgent one (all levels without one)."""
        now = time.perf_counter() if now is None else now
        return live_arrivals(((a.priority, a.heard) for a in self._incoming), now, self.max_batch * self.instances,
                             level)

    @property
    def _running(self) -> list[_Item]:
        """The requests in the batches the model is running now (paused ones included)."""
        return [item for lane in [*self._lanes, *(p.lane for p in self._paused)] for item in lane.batch]

    @property
    def running(self) -> int:
        """Images in the batches the model is running now."""
        return sum(item.rows for item in self._running)

    # ---- requests --------------------------------------------------------------------------------------

    async def submit(self, task: Task, x: np.ndarray, arrival: Arrival | None = None,
                     admission: Admission | None = None) -> Result:
        """x [n, 3, H, W] float32 -> this request's outputs (in parts of at most max_batch rows); QueueFullError
        (503) / GatewayTimeoutError (504)."""
        admission = self._admit(admission, arrival)
        parts = self.parts(x)
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        deadline = min(admission.deadline or math.inf, now + self.timeout_s)
        items = [_Item(task, part, loop.create_future(), admission, deadline, now) for part in parts]
        try:
            self._make_room(items)
            self._refuse_late(items, now)
        except GatewayError:
            if arrival is not None:
                arrival.done()
            raise
        self._pending.extend(items)
        self._seen[admission.priority] = now
        self._rows[task] = self._rows.get(task, 0) + x.shape[0]
        self.metrics.queue_depth.set(len(self._pending))
        admission.at("queue")
        if arrival is not None:
            arrival.done()
        self._arrival.set()
        try:
            wait = self._wait_s(admission)
            if len(items) == 1:
                return await asyncio.wait_for(items[0].future, wait)
            results = await asyncio.wait_for(asyncio.gather(*(item.future for item in items)), wait)
        except TimeoutError:
            self._drop(*items)
            raise self._timed_out(admission) from None
        except BaseException:  # a part failed (the others not started are dropped), or the client went away
            self._drop(*items)
            raise
        return Result.joined(list(results))

    def _room_for(self, entries: int, level: int) -> list[_Item]:
        """The waiting requests to shed so that `entries` more at `level` fit the queue: the least urgent,
        newest first, below `level` only (none when they fit); 503 when not enough are below it."""
        over = len(self._pending) + entries - self.max_queue
        if over <= 0:
            return []
        below = sorted((i for i in self._pending if i.admission.priority > level),
                       key=lambda i: (-i.admission.priority, -i.t0))
        if len(below) < over:
            raise self._full(f"queue full ({self.max_queue} requests waiting)")
        return below[:over]

    def _make_room(self, items: list[_Item]) -> None:
        """Room in the queue for `items`: shed the least urgent, newest requests waiting at a level below theirs
        (each answered 503 + Retry-After), or refuse `items` (503) when that is not enough."""
        shed = self._room_for(len(items), items[0].admission.priority)
        self._drop(*shed)
        for item in shed:
            self.metrics.rejected("shed").inc()
            if not item.future.done():
                item.future.set_exception(QueueFullError(
                    "shed for more urgent requests (the queue is full); retry later",
                    headers={"Retry-After": self.retry_after}))

    def _batch_s(self, task: Task, rows: int) -> float | None:
        """Seconds one batch of `rows` images of `task` takes: the model's batch curve scaled by how much slower
        than it the task's recent batches ran (the machine's other work, the other instances, another task's
        head), else the recent time per image x rows; None before the task's first batch."""
        per_row = self._row_s.get(task.kind)
        if per_row is None:
            return None
        slow = self._slow.get(task.kind)
        curve_s = self.curve.batch_s(rows) if self.curve is not None else None
        return curve_s * slow if curve_s is not None and slow is not None else per_row * rows

    def _sure_batch_s(self, task: Task, rows: int) -> float | None:
        """`_batch_s` with room for how far recent batches ran over their prediction (three times the mean
        relative overrun): what a batch that must end before a deadline is given. Under a storm the model's time
        per batch varies with the front end's load; a batch predicted to just fit then often ends late, for a
        request already answered 504 (the model's time spent for nobody)."""
        batch = self._batch_s(task, rows)
        return None if batch is None else batch * (1.0 + 3.0 * self._overrun.get(task.kind, 0.0))

    def _work_s(self, task: Task, rows: int) -> float | None:
        """How long `rows` waiting images of `task` keep the model busy: batches of up to max_batch rows, shared
        among the instances (None before the task's first batch)."""
        full, rest = divmod(rows, self.max_batch)
        batch, tail = self._batch_s(task, self.max_batch), self._batch_s(task, rest) if rest else 0.0
        if batch is None or tail is None:
            return None
        return (full * batch + tail) / self.instances

    def _own_rows(self, rows: int) -> int:
        """The batch a request's own rows are predicted to run in: a full one where batching pays (the batch
        curve says so), so that a request admitted near its deadline still leaves the time for one; else its
        own rows."""
        return max(rows, self.max_batch) if self.curve is not None and self.curve.worth_waiting else rows

    def _margin_s(self, item: _Item) -> float:
        """The time before its deadline a waiting request is given up: its own rows' run time (`_sure_batch_s`),
        for a deadline of its own (it could not finish), none for the request timeout alone."""
        if item.admission.deadline is None:
            return 0.0
        return self._sure_batch_s(item.task, item.rows) or 0.0

    def _refuse_late(self, items: list[_Item], now: float) -> None:
        """504 now for a request with a deadline that the batches ahead of it leave no time to meet (by the run
        time of recent batches; nothing is predicted before the first batch of its task)."""
        first = items[0]
        if first.admission.deadline is None:  # nothing to refuse: skip counting the queue (each request pays it)
            return
        ahead = sum(i.rows for i in self._pending if i.task == first.task and i.order < first.order)
        self._refuse_unless_in_time(first.task, first.admission, ahead, sum(i.rows for i in items), now)

    def check_arrival(self, task: Task, admission: Admission) -> None:
        """As the request arrives, before its body is read: 504 now if the work already ahead of it (what waits
        at its level or a more urgent one, and every request being read or decoded, itself among them: it is
        announced) leaves no time before its deadline. Under a storm this refuses at the cost of the headers
        alone; without it the doomed requests are still read and decoded, on the cores the model needs. A full
        queue with nothing less urgent to shed refuses it the same way (503), deadline or not."""
        level = admission.priority
        self._room_for(1, level)  # nothing is shed yet: the request may never arrive
        if admission.deadline is None:
            return
        ahead = sum(i.rows for i in self._pending if i.task == task and i.admission.priority <= level)
        now = time.perf_counter()
        coming = self.coming(level, now)  # itself among them (just announced: not stalled)
        self._refuse_unless_in_time(task, admission, ahead + max(0, coming - 1), 1, now)

    def _refuse_unless_in_time(self, task: Task, admission: Admission, ahead: int, rows: int, now: float) -> None:
        """504 (counted `deadline`) if the batches running, the `ahead` images of `task` before it and then its
        own batch (`_own_rows`) cannot end before the admission's deadline; never when the model is idle (nothing
        to predict from, or nothing ahead: run it, and learn)."""
        work, own = self._work_s(task, ahead), self._batch_s(task, self._own_rows(rows))
        if admission.deadline is None or work is None or own is None or not (self._lanes or self._pending):
            return
        finish = now + self._busy_s(now) + work + own
        if finish > admission.deadline:
            self.metrics.rejected("deadline").inc()
            raise deadline_exceeded(f"{(admission.deadline - now) * 1e3:.0f} ms left, and the batches "
                                    f"ahead of it need about {(finish - now) * 1e3:.0f} ms")

    def _busy_s(self, now: float) -> float:
        """Seconds until a model instance is free for the next batch: 0 while one is idle, else the soonest end
        of the batches running (`_left_s`)."""
        if len(self._lanes) < self.instances:
            return 0.0
        return min(self._left_s(lane, now) for lane in self._lanes)

    def _left_s(self, lane: _Lane, now: float) -> float:
        """Seconds until `lane`'s batch is predicted to end (`_batch_s` from its start; 0 without an estimate or
        once past it)."""
        run_s = self._batch_s(lane.batch[0].task, sum(i.rows for i in lane.batch)) or 0.0
        return max(0.0, run_s - (now - lane.started))

    def _rows_in_time(self, first: _Item) -> int:
        """The most rows a batch led by `first` may hold and still end before its deadline (`_sure_batch_s`;
        max_batch without a deadline or an estimate; at least its own)."""
        if first.admission.deadline is None or first.task.kind not in self._row_s:
            return self.max_batch
        left = first.deadline - time.perf_counter()
        fits = [k for k in range(first.rows + 1, self.max_batch + 1)
                if (self._sure_batch_s(first.task, k) or 0.0) <= left]
        return max([first.rows, *fits])

    def _rows_beside_urgent(self, level: int) -> int:
        """The most rows a batch of `level` may hold: one while a more urgent level is active (`ACTIVE_S`), so
        that the urgent level's next request waits behind one image of less urgent work at most (the runner
        does not pre-empt a batch); max_batch when none is. On a CPU a batch's time grows with its rows, and
        batches of one cost the less urgent level a few percent of throughput (ViT-S/16 here: 0.148 s an image
        at batch 1, 0.134 at 8)."""
        return 1 if self._urgent_active_s(level) > 0 else self.max_batch

    def _urgent_active_s(self, level: int) -> float:
        """Seconds until every level more urgent than `level` goes quiet (`ACTIVE_S` after its latest request);
        0 when none is active."""
        now = time.perf_counter()
        return max((t + ACTIVE_S - now for lv, t in self._seen.items() if lv < level and now - t < ACTIVE_S),
                   default=0.0)

    def _kept_for_urgent(self, first: _Item) -> float:
        """With several instances, a batch led by `first` leaves one instance free while a more urgent level is
        active (`ACTIVE_S`), so that the urgent level's next request finds one free instead of waiting behind less
        urgent work: the seconds until that level goes quiet when the batch must wait, else 0 (one instance:
        never, the less urgent batch holds one image instead, `_rows_beside_urgent`; a batch run in stages
        never: it gives its instance back at the next stage, `_yield_lane`)."""
        if self.instances == 1 or len(self._lanes) < self.instances - 1 or self._stageable(first):
            return 0.0
        return self._urgent_active_s(first.admission.priority)

    def _stageable(self, item: _Item) -> bool:
        """Whether the backend runs `item`'s task in stages (`LocalBackend.staged`; the generator is made, never
        started)."""
        stages = self.local.staged(item.task, item.x)
        if stages is None:
            return False
        stages.close()
        return True

    def _stages_for(self, task: Task, x: np.ndarray, level: int) -> Staged | None:
        """The batch's run in stages while a more urgent level than its own is active (it may have to give its
        instance to that level's next request), else None: run whole (one call into the model: a trace's whole
        forward without the GIL)."""
        return self.local.staged(task, x) if self._urgent_active_s(level) > 0 else None

    def _urgent_waits(self, level: int) -> bool:
        """A request (or a paused batch) more urgent than `level` waits, and every instance is busy."""
        return len(self._lanes) >= self.instances and (
            any(i.admission.priority < level for i in self._pending)
            or any(p.lane.level < level for p in self._paused))

    async def _yield_lane(self, lane: _Lane, run_s: float) -> None:
        """Give `lane`'s instance to the collector, and wait until it hands one back (`_grant`); `run_s`: the
        batch's model time so far."""
        self._lanes.remove(lane)
        paused = _Paused(lane, asyncio.get_running_loop().create_future())
        self._paused.append(paused)
        self._lane_free.set()
        self.metrics.preempted.inc()
        try:
            await paused.resume
        except BaseException:
            if paused in self._paused:
                self._paused.remove(paused)
            elif lane in self._lanes:  # granted, then cancelled before it ran on
                self._lanes.remove(lane)
                self._lane_free.set()
            raise
        lane.started = time.perf_counter() - run_s

    def _grant(self) -> bool:
        """Hand a free instance back to the most urgent paused batch when nothing waiting is more urgent (its
        work is partly done); whether one was."""
        if not self._paused:
            return False
        paused = min(self._paused, key=lambda p: p.order)
        if self._pending and min(i.order for i in self._pending) < paused.order:
            return False
        self._paused.remove(paused)
        self._lanes.append(paused.lane)
        paused.resume.set_result(None)
        return True

    def _drop(self, *items: _Item) -> None:
        for item in items:
            with contextlib.suppress(ValueError):
                self._pending.remove(item)
                self._rows[item.task] -= item.rows
        self.metrics.queue_depth.set(len(self._pending))

    # ---- the collector ---------------------------------------------------------------------------------

    async def _collect(self) -> None:
        while True:
            try:
                await self._next_batch()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not stall every later request
                log.exception("batcher error")

    def _expire(self) -> None:
        """Drop the requests waiting past their deadline, or too close to it for one more batch (504)."""
        now = time.perf_counter()
        late = [i for i in self._pending if i.deadline <= now + self._margin_s(i)]
        if not late:
            return
        self._drop(*late)
        for item in late:
            if not item.future.done():
                item.future.set_exception(self._timed_out(item.admission))

    async def _next_batch(self) -> None:
        while len(self._lanes) >= self.instances:  # every instance busy: choose the next batch when one is free
            self._lane_free.clear()
            await self._lane_free.wait()
        self._expire()
        if self._grant():
            await asyncio.sleep(0)  # the batch resumes before the next is chosen
            return
        if not self._pending:
            self._arrival.clear()
            await self._arrival.wait()
            return
        first = min(self._pending, key=lambda i: i.order)
        if (wait := self._kept_for_urgent(first)) > 0:
            self._lane_free.clear()  # wait for a lane to free, a request to come, or the urgent level to go quiet
            self._arrival.clear()
            waiters = [asyncio.ensure_future(e.wait()) for e in (self._lane_free, self._arrival)]
            try:
                await asyncio.wait(waiters, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()
            return
        if self.max_batch > 1 and self.delay_s > 0 and self._rows[first.task] < self.max_batch:
            deadline = first.t0 + self.delay_s
            while self.coming() > 0 and (remaining := deadline - time.perf_counter()) > 0:
                self._arrival.clear()
                try:  # no longer than until the newest of them would count as stalled: then count again
                    await asyncio.wait_for(self._arrival.wait(), min(remaining, STALL_S))
                except TimeoutError:
                    continue
                if first not in self._pending or min(self._pending, key=lambda i: i.order) is not first:
                    return  # the first request left, or a more urgent one came: start over
                if self._rows[first.task] >= self.max_batch:
                    break
        batch = self._take(first.task)
        run = asyncio.get_running_loop().create_task(self._run(first.task, batch))
        self._runs.add(run)
        run.add_done_callback(self._runs.discard)
        await asyncio.sleep(0)  # let the run take its lane before the next batch is chosen

    def _take(self, task: Task) -> list[_Item]:
        """Remove and return the most urgent items of `task`: the first always, then others of its level while
        they fit (a batch is not topped up with less urgent work, which would make the urgent wait for it), and
        no more rows than the first's deadline leaves time for."""
        batch: list[_Item] = []
        rows = 0
        ordered = sorted((i for i in self._pending if i.task == task), key=lambda i: i.order)
        level = ordered[0].admission.priority
        limit = min(self._rows_in_time(ordered[0]), self._rows_beside_urgent(level),
                    self._share(task, level, sum(i.rows for i in ordered if i.admission.priority == level)))
        for item in ordered:
            if not batch or (item.admission.priority == level and rows + item.rows <= limit):
                batch.append(item)
                rows += item.rows
        taken = set(map(id, batch))
        self._pending = deque(i for i in self._pending if id(i) not in taken)
        self._rows[task] -= rows
        self.metrics.queue_depth.set(len(self._pending))
        return batch

    def _share(self, task: Task, level: int, waiting: int) -> int:
        """The rows a batch of `level` takes of the `waiting` rows of `task` at its level, with several instances
        where batching does not pay (on a CPU a batch's time grows with its rows): each row goes to the instance
        that would finish it first (idle now, running a less urgent batch in stages, which gives it up, or
        predicted free at the end of its batch), this batch's instance among them, so that a burst runs on every
        instance at once instead of as one long batch beside an idle one. All of them without an estimate."""
        per_row = self._batch_s(task, 1)
        if self.instances == 1 or per_row is None or (self.curve is not None and self.curve.worth_waiting):
            return waiting
        now = time.perf_counter()
        ends = [0.0] * (self.instances - len(self._lanes))  # this batch's instance first, then the other idle ones
        for lane in self._lanes:  # a less urgent staged batch gives its instance up: free now
            ends.append(0.0 if lane.staged and lane.level > level else self._left_s(lane, now))
        mine = 0
        for _ in range(waiting):
            first = min(range(len(ends)), key=ends.__getitem__)
            ends[first] += per_row
            mine += first == 0
        return max(1, mine)

    def _timed_run(self, task: Task, x: np.ndarray) -> tuple[Outputs, float]:
        """The backend's run in the model thread, and its own time (not the wait for the thread)."""
        t0 = time.perf_counter()
        outputs = self.local.run(task, x)
        return outputs, time.perf_counter() - t0

    @staticmethod
    def _timed_step(stages: Staged) -> tuple[Outputs | None, float]:
        """One stage of a staged run in the model thread: (the outputs after the last stage, else None; its time)."""
        t0 = time.perf_counter()
        try:
            next(stages)
        except StopIteration as done:
            return done.value, time.perf_counter() - t0
        return None, time.perf_counter() - t0

    async def _run_stages(self, stages: Staged, lane: _Lane) -> tuple[Outputs | None, float]:
        """A staged run, a stage at a time in the model thread: before each stage, the instance goes to more urgent
        work waiting for one (`_yield_lane`), and the run stops (None) once every request in it has gone (hung
        up, timed out). (outputs, model seconds)."""
        loop, level, run_s = asyncio.get_running_loop(), lane.level, 0.0
        try:
            while True:
                outputs, step_s = await loop.run_in_executor(self.executor, self._timed_step, stages)
                run_s += step_s
                if outputs is not None:
                    return outputs, run_s
                if all(item.future.done() for item in lane.batch):
                    return None, run_s
                if self._urgent_waits(level):
                    await self._yield_lane(lane, run_s)
        finally:
            with contextlib.suppress(ValueError):  # cancelled (unloaded) while a step still runs in its thread
                stages.close()

    async def _run(self, task: Task, batch: list[_Item]) -> None:
        batch = [item for item in batch if not item.future.done()]  # left since they were taken
        if not batch:
            return
        x = batch[0].x if len(batch) == 1 else np.concatenate([item.x for item in batch])
        rows = x.shape[0]
        start = time.perf_counter()
        for item in batch:
            self.metrics.queue_wait.observe(start - item.t0)
            item.admission.at("infer")
        self.metrics.batch_size(task.kind).observe(rows)
        stages = self._stages_for(task, x, batch[0].admission.priority)
        lane = _Lane(batch, start, staged=stages is not None)
        self._lanes.append(lane)
        self.metrics.in_flight.set(self.running)
        try:
            if stages is None:
                outputs, run_s = await asyncio.get_running_loop().run_in_executor(
                    self.executor, self._timed_run, task, x)
            else:
                staged, run_s = await self._run_stages(stages, lane)
                if staged is None:
                    return  # nobody is left to answer
                outputs = staged
        except Exception as e:
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(e)
            return
        finally:
            if lane in self._lanes:
                self._lanes.remove(lane)
                self._lane_free.set()
            self.metrics.in_flight.set(self.running)
        end = time.perf_counter()
        self.metrics.inference(task.kind).observe(end - start)
        if (predicted := self._batch_s(task, rows)) is not None and predicted > 0:  # before this batch updates it
            # faster than predicted is no risk to a deadline; one stall (a page fault storm, a GC) counts as 100%
            last, over = self._overrun.get(task.kind), min(1.0, max(0.0, run_s / predicted - 1.0))
            self._overrun[task.kind] = over if last is None else 0.7 * last + 0.3 * over
        last, per_row = self._row_s.get(task.kind), run_s / rows
        self._row_s[task.kind] = per_row if last is None else 0.7 * last + 0.3 * per_row
        if self.curve is not None and (curve_s := self.curve.batch_s(rows)):
            last, slow = self._slow.get(task.kind), run_s / curve_s
            self._slow[task.kind] = slow if last is None else 0.7 * last + 0.3 * slow
        offset = 0
        for item in batch:
            if not item.future.done():  # not timed out meanwhile
                part = {k: v[offset:offset + item.rows] for k, v in outputs.items()}
                item.future.set_result(Result(part, (start - item.t0) * 1e3, (end - start) * 1e3, rows))
            offset += item.rows


Runner = BatchingRunner | DirectRunner


def runner_for(backend: Backend, limits: RunnerLimits, metrics: ModelMetrics, executor: Executor) -> Runner:
    """A direct runner for a backend whose server batches (Triton), a batching runner for the others."""
    if isinstance(backend, RemoteBackend):
        return DirectRunner(backend, limits, metrics, executor)
    assert isinstance(backend, LocalBackend)
    return BatchingRunner(backend, limits, metrics, executor)
