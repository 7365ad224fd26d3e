"""A fake backend, a hand-driven model thread and a recorder of events, for the scheduler's unit tests.

`TableBackend` takes each batch's time from a table (rows -> milliseconds) and moves the `FakeClock` by it as it
runs; it can run in stages (for preemption) and fail on given batches. `ManualExecutor` is the model thread: a
submitted call waits until the test runs it (`run_next`), so a batch is "running" exactly as long as the test
says. `Harness` drives a runner: `settle()` lets the event loop run every task that is ready (no timer, no real
time), nothing ever sleeps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import deque
from collections.abc import Callable, Generator
from typing import Any

import numpy as np

from vit_serve.runtime.backends.base import LocalBackend, ModelInfo
from vit_serve.runtime.scheduling import Arrival, BatchingRunner, FakeClock, Ticket
from vit_serve.runtime.settings import RunnerLimits
from vit_serve.runtime.task import CLASSIFY, Outputs, Task


class TableBackend(LocalBackend):
    """A model whose batch of n images takes `ms[n]` milliseconds of the fake clock (else `ms_per_row` x n).

    Its logits are each image's first pixel (so a test tells whose rows came back); `calls` logs what ran:
    ("whole", kind, rows) per whole batch, ("stage", kind, rows) per stage; `fail_on`: the rows of batches that
    raise; `stages`: a batch runs as that many equal stages when staged (0: only whole)."""

    name = "table"

    def __init__(self, clock: FakeClock, ms: dict[int, float] | None = None, ms_per_row: float = 10.0,
                 stages: int = 0, fail_on: tuple[int, ...] = (), concurrent: bool = True) -> None:
        self.clock, self.ms, self.ms_per_row = clock, ms or {}, ms_per_row
        self.stages, self.fail_on, self.concurrent = stages, fail_on, concurrent
        self.calls: list[tuple[str, str, int]] = []

    @property
    def info(self) -> ModelInfo:  # type: ignore[override]
        raise AssertionError("not needed by the scheduler")

    def batch_ms(self, rows: int) -> float:
        return self.ms.get(rows, self.ms_per_row * rows)

    def classify(self, x: np.ndarray) -> np.ndarray:
        return x[:, 0, 0, :1].copy()

    def run(self, task: Task, x: np.ndarray) -> Outputs:
        self.calls.append(("whole", task.kind, x.shape[0]))
        self.clock.advance_ms(self.batch_ms(x.shape[0]))
        if x.shape[0] in self.fail_on:
            raise RuntimeError(f"batch of {x.shape[0]} failed")
        return {"logits": self.classify(x)}

    def staged(self, task: Task, x: np.ndarray) -> Generator[None, None, Outputs] | None:
        if self.stages == 0:
            return None
        return self._stages(task, x)

    def _stages(self, task: Task, x: np.ndarray) -> Generator[None, None, Outputs]:
        for _ in range(self.stages):
            self.calls.append(("stage", task.kind, x.shape[0]))
            self.clock.advance_ms(self.batch_ms(x.shape[0]) / self.stages)
            yield
        return {"logits": self.classify(x)}


class ManualExecutor(concurrent.futures.Executor):
    """A model thread run by hand: each submitted call waits until `run_next` runs it, in the caller's thread."""

    def __init__(self) -> None:
        self.waiting: deque[tuple[concurrent.futures.Future, Callable[..., Any], tuple]] = deque()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.waiting.append((future, fn, args))
        return future

    def run_next(self) -> None:
        future, fn, args = self.waiting.popleft()
        try:
            result = fn(*args)
        except Exception as e:
            # without its traceback (its frames hold the runner's coroutines, in a cycle through the futures
            # that carry it): finalized later, in the middle of pytest rewriting a module's AST, they break
            # CPython 3.11.7's AST recursion check (a SystemError at the end of the session)
            future.set_exception(e.with_traceback(None))
        else:
            future.set_result(result)


def image(value: float, rows: int = 1) -> np.ndarray:
    """`rows` 4x4 images whose first pixel is `value` (+ their row index)."""
    x = np.zeros((rows, 3, 4, 4), np.float32)
    x[:, 0, 0, 0] = value + np.arange(rows)
    return x


class Harness:
    """A `BatchingRunner` over a `TableBackend`, a `ManualExecutor` and a `FakeClock` (milliseconds)."""

    def __init__(self, backend_args: dict[str, Any] | None = None, **limits: Any) -> None:
        self.clock = FakeClock(1000.0)
        self.backend = TableBackend(self.clock, **(backend_args or {}))
        self.thread = ManualExecutor()
        self.events = Log()
        self.runner = BatchingRunner(self.backend, RunnerLimits(**limits), self.events, self.thread, self.clock)
        self.tasks: dict[str, asyncio.Task] = {}

    def ticket(self, level: int = 1, deadline_ms: float | None = None) -> Ticket:
        now = self.clock.now()
        return Ticket(arrived=now, priority=level, deadline=None if deadline_ms is None else now + deadline_ms / 1e3)

    async def settle(self) -> None:
        """Let every ready task run until none is (no timers: the scheduler's waits here are on events)."""
        for _ in range(50):
            await asyncio.sleep(0)

    async def submit(self, name: str, level: int = 1, deadline_ms: float | None = None, rows: int = 1,
                     arrival: Arrival | None = None) -> None:
        """Submit request `name` (announced as `arrival`) 1 ms after the one before, and let the runner take it
        in."""
        self.clock.advance_ms(1)
        value = float(len(self.tasks) * 10)
        self.tasks[name] = asyncio.create_task(self.runner.submit(
            CLASSIFY, image(value, rows), arrival, self.ticket(level, deadline_ms)))
        await self.settle()

    async def step(self) -> None:
        """Run the model thread's next call, then let the runner react."""
        self.thread.run_next()
        await self.settle()

    async def drain(self) -> list[list[str]]:
        """Run the model thread until it is idle: the requests answered after each call, in order (one list per
        batch; a stage that answers nobody gives none)."""
        answered: list[list[str]] = []
        done = {n for n, t in self.tasks.items() if t.done()}
        while self.thread.waiting:
            await self.step()
            now_done = [n for n, t in self.tasks.items() if t.done() and n not in done]
            done.update(now_done)
            if now_done:
                answered.append(now_done)
        return answered

    def sizes(self, names: list[str]) -> list[int]:
        """The batch size each of `names` was answered in."""
        return [self.tasks[n].result().batch_size for n in names]

    def outcome(self, name: str) -> str:
        """"ok <batch size>", the error's class name, "cancelled" or "pending"."""
        t = self.tasks[name]
        if not t.done():
            return "pending"
        if t.cancelled():
            return "cancelled"
        if t.exception() is not None:
            return type(t.exception()).__name__
        return f"ok {t.result().batch_size}"


class Log:
    """Every event a runner reported (`SchedulerEvents`), in order."""

    def __init__(self) -> None:
        self.depths: list[int] = []
        self.refusals: list[str] = []
        self.batches: list[tuple[str, int]] = []
        self.preemptions = 0
        self.cancellations: list[str] = []

    def queued(self, depth: int) -> None:
        self.depths.append(depth)

    def running(self, rows: int) -> None:
        pass

    def rejected(self, reason: str) -> None:
        self.refusals.append(reason)

    def shed(self) -> None:
        self.refusals.append("shed")

    def batch(self, kind: str, rows: int, waits_s: list[float]) -> None:
        self.batches.append((kind, rows))

    def ran(self, kind: str, seconds: float) -> None:
        pass

    def preempted(self) -> None:
        self.preemptions += 1

    def cancelled(self, stage: str) -> None:
        self.cancellations.append(stage)
