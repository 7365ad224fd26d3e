"""What a runner reports as it goes (`SchedulerEvents`): the gateway counts them in Prometheus
(`vit_serve.serve.metrics.RunnerEvents`); `NoEvents` drops them (offline prediction, tests). The scheduler itself
imports no metrics library.

Refusal reasons: queue_full (no room), shed (made room for a more urgent request), deadline (passed, or not to be
met), timeout (no answer within the request timeout).
"""

from __future__ import annotations

from typing import Literal, Protocol

Reason = Literal["queue_full", "shed", "deadline", "timeout"]


class SchedulerEvents(Protocol):
    def queued(self, depth: int) -> None:
        """Requests waiting now (after one was queued, taken, dropped or shed)."""

    def running(self, rows: int) -> None:
        """Images in the batches the model runs now."""

    def rejected(self, reason: Reason) -> None:
        """A request refused or dropped (`Reason`)."""

    def shed(self) -> None:
        """A waiting request shed for a more urgent one (the gateway counts it as rejected "shed")."""

    def batch(self, kind: str, rows: int, waits_s: list[float]) -> None:
        """A batch of `rows` images of a task kind starts; `waits_s`: each request's time in the queue."""

    def ran(self, kind: str, seconds: float) -> None:
        """A batch's run time, from its start to its outputs."""

    def preempted(self) -> None:
        """A batch run in stages gave its model instance to more urgent work."""

    def cancelled(self, stage: str) -> None:
        """A request whose caller went away, at the stage it had reached."""


class NoEvents:
    """Events dropped."""

    def queued(self, depth: int) -> None:
        pass

    def running(self, rows: int) -> None:
        pass

    def rejected(self, reason: Reason) -> None:
        pass

    def shed(self) -> None:
        pass

    def batch(self, kind: str, rows: int, waits_s: list[float]) -> None:
        pass

    def ran(self, kind: str, seconds: float) -> None:
        pass

    def preempted(self) -> None:
        pass

    def cancelled(self, stage: str) -> None:
        pass
