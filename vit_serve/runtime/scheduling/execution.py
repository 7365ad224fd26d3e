"""One batch's run on a model instance (`BatchRun`): whole (one call into the model, in its thread), or a stage at
a time while a more urgent level is active, giving its instance up between two stages when more urgent work
waits (`Instances.yield_lane`); then each request's slice of the outputs, and the cost model told how long it
took."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from concurrent.futures import Executor
from typing import Protocol

import numpy as np

from vit_serve.runtime.backends.base import LocalBackend, Staged
from vit_serve.runtime.scheduling import policy
from vit_serve.runtime.scheduling.clock import Clock
from vit_serve.runtime.scheduling.cost import CostModel
from vit_serve.runtime.scheduling.events import SchedulerEvents
from vit_serve.runtime.scheduling.instances import Instances, Lane
from vit_serve.runtime.scheduling.pending import Entry, PendingQueue
from vit_serve.runtime.scheduling.result import Result
from vit_serve.runtime.task import Outputs, Task


class Batcher(Protocol):
    """What a batch's run uses of its runner (`batching.BatchingRunner`)."""

    local: LocalBackend
    executor: Executor
    clock: Clock
    events: SchedulerEvents
    group: Instances
    pending: PendingQueue
    cost: CostModel
    seen: Mapping[int, float]

    @property
    def running(self) -> int: ...


class BatchRun:
    """The run of `batch` (entries of `task`) on one of `runner`'s instances."""

    def __init__(self, runner: Batcher, task: Task, batch: list[Entry]) -> None:
        self.runner, self.task, self.batch = runner, task, batch
        self.clock: Clock = runner.clock

    @staticmethod
    def stageable(backend: LocalBackend, item: Entry) -> bool:
        """Whether the backend runs `item`'s task in stages (`LocalBackend.staged`; the generator is made, never
        started)."""
        stages = backend.staged(item.task, item.x)
        if stages is None:
            return False
        stages.close()
        return True

    def _stages_for(self, x: np.ndarray, level: int) -> Staged | None:
        """The batch's run in stages while a more urgent level than its own is active (it may have to give its
        instance to that level's next request), else None: run whole (one call into the model: a trace's whole
        forward without the GIL)."""
        if policy.urgent_active_s(self.runner.seen, level, self.clock.now()) > 0:
            return self.runner.local.staged(self.task, x)
        return None

    def _timed_run(self, x: np.ndarray) -> tuple[Outputs, float]:
        """The backend's run in the model thread, and its own time (not the wait for the thread)."""
        t0 = self.clock.now()
        outputs = self.runner.local.run(self.task, x)
        return outputs, self.clock.now() - t0

    def _timed_step(self, stages: Staged) -> tuple[Outputs | None, float]:
        """One stage in the model thread: (the outputs after the last stage, else None; its time)."""
        t0 = self.clock.now()
        try:
            next(stages)
        except StopIteration as done:
            return done.value, self.clock.now() - t0
        return None, self.clock.now() - t0

    async def _run_stages(self, stages: Staged, lane: Lane) -> tuple[Outputs | None, float]:
        """A staged run, a stage at a time in the model thread: before each stage, the instance goes to more urgent
        work waiting for one, and the run stops (None) once every request in it has gone (hung up, timed out).
        (outputs, model seconds)."""
        loop, level, run_s, instances = asyncio.get_running_loop(), lane.level, 0.0, self.runner.group
        try:
            while True:
                outputs, step_s = await loop.run_in_executor(self.runner.executor, self._timed_step, stages)
                run_s += step_s
                if outputs is not None:
                    return outputs, run_s
                if all(item.future.done() for item in lane.batch):
                    return None, run_s
                if instances.urgent_waits(level, list(self.runner.pending)):
                    await instances.yield_lane(lane, run_s)
        finally:
            with contextlib.suppress(ValueError):  # cancelled (unloaded) while a step still runs in its thread
                stages.close()

    async def _outputs(self, x: np.ndarray, lane: Lane, stages: Staged | None) -> tuple[Outputs | None, float]:
        """Run the batch on `lane`'s instance, whole or in `stages`: (outputs, else None when nobody is left to
        answer; model seconds). A failure is every request's answer."""
        runner = self.runner
        runner.group.occupy(lane)
        runner.events.running(runner.running)
        try:
            if stages is None:
                return await asyncio.get_running_loop().run_in_executor(runner.executor, self._timed_run, x)
            return await self._run_stages(stages, lane)
        finally:
            runner.group.release(lane)
            runner.events.running(runner.running)

    async def run(self) -> None:
        batch = [item for item in self.batch if not item.future.done()]  # left since they were taken
        if not batch:
            return
        x = batch[0].x if len(batch) == 1 else np.concatenate([item.x for item in batch])
        rows, runner = x.shape[0], self.runner
        start = self.clock.now()
        for item in batch:
            item.ticket.at("infer")
        runner.events.batch(self.task.kind, rows, [start - item.t0 for item in batch])
        stages = self._stages_for(x, batch[0].level)
        try:
            outputs, run_s = await self._outputs(x, Lane(batch, start, staged=stages is not None), stages)
        except Exception as e:
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(e)
            return
        if outputs is None:
            return  # nobody is left to answer
        end = self.clock.now()
        runner.events.ran(self.task.kind, end - start)
        runner.cost.observe(self.task.kind, rows, run_s)
        offset = 0
        for item in batch:
            if not item.future.done():  # not timed out meanwhile
                part = {k: v[offset:offset + item.rows] for k, v in outputs.items()}
                item.future.set_result(Result(part, (start - item.t0) * 1e3, (end - start) * 1e3, rows))
            offset += item.rows
