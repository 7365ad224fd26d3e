"""A version's model instances (Triton's instance_group count: batches that run at once) and the preemption of
batches run in stages.

Each running batch holds an instance (`Lane`). A less urgent batch run in stages (the torch backend's encoder
blocks) gives its instance up between two stages when more urgent work waits and every instance is busy
(`Instances.yield_lane`), and waits, partly done, until the collector hands one back (`Instances.grant`: before
any new batch of its level or below).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from vit_serve.runtime.scheduling.clock import Clock
from vit_serve.runtime.scheduling.events import SchedulerEvents
from vit_serve.runtime.scheduling.pending import Entry


@dataclass(eq=False)
class Lane:
    """A batch holding a model instance, when it started (less the time it was paused: its predicted end counts
    from it), and whether it runs in stages (it gives the instance up to more urgent work)."""

    batch: list[Entry]
    started: float
    staged: bool = False

    @property
    def level(self) -> int:
        return self.batch[0].level

    @property
    def kind(self) -> str:
        return self.batch[0].task.kind

    @property
    def rows(self) -> int:
        return sum(i.rows for i in self.batch)


@dataclass(eq=False)
class Paused:
    """A staged batch that gave its instance to more urgent work, waiting for the collector to give one back."""

    lane: Lane
    resume: asyncio.Future[None]

    @property
    def order(self) -> tuple[int, float, float]:
        return self.lane.batch[0].order


@dataclass(frozen=True)
class InstanceSnapshot:
    """The instances as the batching policy sees them: how many, and the batches running on them."""

    count: int
    lanes: tuple[Lane, ...]

    @property
    def idle(self) -> int:
        return self.count - len(self.lanes)


class Instances:
    """The running batches (`lanes`), the paused ones, and the event the collector waits on for a free one."""

    def __init__(self, count: int, clock: Clock, events: SchedulerEvents) -> None:
        self.count = count
        self.clock = clock
        self.events = events
        self.lanes: list[Lane] = []  # the batches running now
        self.paused: list[Paused] = []  # staged batches waiting for an instance (`yield_lane`)
        self.freed = asyncio.Event()

    def snapshot(self) -> InstanceSnapshot:
        return InstanceSnapshot(self.count, tuple(self.lanes))

    @property
    def busy(self) -> bool:
        """Every instance runs a batch."""
        return len(self.lanes) >= self.count

    @property
    def entries(self) -> list[Entry]:
        """The requests in the batches the model is running now (paused ones included)."""
        return [item for lane in [*self.lanes, *(p.lane for p in self.paused)] for item in lane.batch]

    async def wait_free(self) -> None:
        """Until an instance is free."""
        while self.busy:
            self.freed.clear()
            await self.freed.wait()

    def occupy(self, lane: Lane) -> None:
        self.lanes.append(lane)

    def release(self, lane: Lane) -> None:
        """`lane`'s batch is over (or was cancelled): its instance is free, if it held one."""
        if lane in self.lanes:
            self.lanes.remove(lane)
            self.freed.set()

    def urgent_waits(self, level: int, waiting: list[Entry]) -> bool:
        """A request (of `waiting`) or a paused batch more urgent than `level` waits, and every instance is busy."""
        return self.busy and (any(i.level < level for i in waiting) or any(p.lane.level < level for p in self.paused))

    async def yield_lane(self, lane: Lane, run_s: float) -> None:
        """Give `lane`'s instance to the collector, and wait until it hands one back (`grant`); `run_s`: the
        batch's model time so far."""
        self.lanes.remove(lane)
        paused = Paused(lane, asyncio.get_running_loop().create_future())
        self.paused.append(paused)
        self.freed.set()
        self.events.preempted()
        try:
            await paused.resume
        except BaseException:
            if paused in self.paused:
                self.paused.remove(paused)
            else:  # granted, then cancelled before it ran on
                self.release(lane)
            raise
        lane.started = self.clock.now() - run_s

    def grant(self, first_waiting: tuple[int, float, float] | None) -> bool:
        """Hand a free instance back to the most urgent paused batch when nothing waiting is more urgent (its
        work is partly done; `first_waiting`: the order of the most urgent waiting request); whether one was."""
        if not self.paused:
            return False
        paused = min(self.paused, key=lambda p: p.order)
        if first_waiting is not None and first_waiting < paused.order:
            return False
        self.paused.remove(paused)
        self.lanes.append(paused.lane)
        paused.resume.set_result(None)
        return True

    def clear(self) -> None:
        self.lanes = []
        self.paused = []
