"""The scheduler: how a model version's requests are queued, batched and run, with no web framework, no RPC and
no metrics library (it reports `events`; the gateway counts them). `runner_for` picks the runner a backend needs.

- `ticket`: a request's level, deadline, caller and cancellation.
- `result`: a request's answer from its runner.
- `arrivals`: requests on their way, and the stalled-arrival rule.
- `clock`: the only source of time (`PerfClock`, `FakeClock`).
- `errors`: `QueueFullError`, `DeadlineError`, `NotReadyError`.
- `pending`: the queue: order, room and shedding, expiry, take.
- `cost`: what a batch takes.
- `policy`: the batching decisions, pure, in order.
- `instances`: model instances and the preemption of staged runs.
- `execution`: one batch's run.
- `events`: what a runner reports.
- `base`, `batching`, `direct`: what the runners share; `BatchingRunner`; `DirectRunner` (a server that batches).
"""

from __future__ import annotations

from concurrent.futures import Executor

from vit_serve.runtime.backends.base import Backend, LocalBackend, RemoteBackend
from vit_serve.runtime.scheduling.arrivals import STALL_S, Arrival, live_arrivals
from vit_serve.runtime.scheduling.base import BatchingInfo
from vit_serve.runtime.scheduling.batching import BatchingRunner
from vit_serve.runtime.scheduling.clock import PERF_CLOCK, Clock, FakeClock, PerfClock
from vit_serve.runtime.scheduling.direct import DirectRunner
from vit_serve.runtime.scheduling.errors import DeadlineError, NotReadyError, QueueFullError
from vit_serve.runtime.scheduling.events import NoEvents, SchedulerEvents
from vit_serve.runtime.scheduling.policy import ACTIVE_S
from vit_serve.runtime.scheduling.result import Result
from vit_serve.runtime.scheduling.ticket import DEFAULT_PRIORITY, SHADOW, Caller, Ticket
from vit_serve.runtime.settings import RunnerLimits

__all__ = [
    "ACTIVE_S", "DEFAULT_PRIORITY", "PERF_CLOCK", "SHADOW", "STALL_S", "Arrival", "BatchingInfo", "BatchingRunner",
    "Caller", "Clock", "DeadlineError", "DirectRunner", "FakeClock", "NoEvents", "NotReadyError", "PerfClock",
    "QueueFullError", "Result", "Runner", "SchedulerEvents", "Ticket", "live_arrivals", "runner_for",
]

Runner = BatchingRunner | DirectRunner


def runner_for(backend: Backend, limits: RunnerLimits, events: SchedulerEvents | None, executor: Executor,
               clock: Clock = PERF_CLOCK) -> Runner:
    """A direct runner for a backend whose server batches (Triton), a batching runner for the others."""
    if isinstance(backend, RemoteBackend):
        return DirectRunner(backend, limits, events, executor, clock)
    assert isinstance(backend, LocalBackend)
    return BatchingRunner(backend, limits, events, executor, clock)
