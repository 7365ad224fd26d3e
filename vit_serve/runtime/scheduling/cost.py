"""What a batch costs (`CostModel`): seconds for a batch of n images of a task kind, from the model's batch curve
(`vit_serve.runtime.batch_curve`: its time per image by batch size, measured at warm-up) scaled by how much slower
than the curve recent batches ran, else the recent run time per image; with the margin a batch that must end
before a deadline is given (how far recent batches ran over their prediction).

Three moving averages per task kind (each new batch weighs 0.3): the time per image, the ratio to the curve, and
the relative overrun. Nothing is predicted before a kind's first batch (None): the runner then runs, and learns.
"""

from __future__ import annotations

from vit_serve.runtime.batch_curve import BatchCurve

WEIGHT, KEEP = 0.3, 0.7  # of the newest batch, of the average before it


def _averaged(last: float | None, new: float) -> float:
    return new if last is None else KEEP * last + WEIGHT * new


class CostModel:
    """Predicted batch times of one model version, per task kind. `max_batch`: the largest batch it runs (the
    configured one, at most the curve's `limit` once one is used); `instances`: batches that run at once."""

    def __init__(self, max_batch: int, instances: int = 1) -> None:
        self.max_batch = max_batch
        self.instances = instances
        self.curve: BatchCurve | None = None
        self._row_s: dict[str, float] = {}  # recent run time per image (for deadlines)
        self._slow: dict[str, float] = {}  # recent run time / the batch curve's
        self._overrun: dict[str, float] = {}  # recent run time over its prediction, relative

    def use_curve(self, curve: BatchCurve) -> None:
        """Predict from the model's measured batch curve; batches hold no more than it says pays."""
        self.curve = curve
        self.max_batch = min(self.max_batch, curve.limit)

    @property
    def pays_to_wait(self) -> bool:
        """Whether the curve says a fuller batch is faster per image (waiting for one pays)."""
        return self.curve is not None and self.curve.worth_waiting

    def seed(self, kind: str, row_s: float, overrun: float | None = None) -> None:
        """Take `kind`'s batches to cost `row_s` a row (and to overrun their prediction by `overrun`; None: as
        before), as if measured: a known cost before the first batch (a simulation, a test); later batches move
        it."""
        self._row_s[kind] = row_s
        if overrun is not None:
            self._overrun[kind] = overrun

    def forget(self, kind: str) -> None:
        """Back to knowing nothing of `kind`'s cost."""
        for table in (self._row_s, self._slow, self._overrun):
            table.pop(kind, None)

    def row_s(self, kind: str) -> float | None:
        """The recent run time per image of `kind` (None before its first batch)."""
        return self._row_s.get(kind)

    def known(self, kind: str) -> bool:
        return kind in self._row_s

    def batch_s(self, kind: str, rows: int) -> float | None:
        """Seconds one batch of `rows` images of `kind` takes: the batch curve scaled by how much slower than it
        the kind's recent batches ran (the machine's other work, the other instances, another task's head), else
        the recent time per image x rows; None before the kind's first batch."""
        per_row = self._row_s.get(kind)
        if per_row is None:
            return None
        slow = self._slow.get(kind)
        curve_s = self.curve.batch_s(rows) if self.curve is not None else None
        return curve_s * slow if curve_s is not None and slow is not None else per_row * rows

    def sure_batch_s(self, kind: str, rows: int) -> float | None:
        """`batch_s` with room for how far recent batches ran over their prediction (three times the mean
        relative overrun): what a batch that must end before a deadline is given. Under a storm the model's time
        per batch varies with the front end's load; a batch predicted to just fit then often ends late, for a
        request already answered 504 (the model's time spent for nobody)."""
        batch = self.batch_s(kind, rows)
        return None if batch is None else batch * (1.0 + 3.0 * self._overrun.get(kind, 0.0))

    def work_s(self, kind: str, rows: int) -> float | None:
        """How long `rows` waiting images of `kind` keep the model busy: batches of up to max_batch rows, shared
        among the instances (None before the kind's first batch)."""
        full, rest = divmod(rows, self.max_batch)
        batch, tail = self.batch_s(kind, self.max_batch), self.batch_s(kind, rest) if rest else 0.0
        if batch is None or tail is None:
            return None
        return (full * batch + tail) / self.instances

    def own_rows(self, rows: int) -> int:
        """The batch a request's own rows are predicted to run in: a full one where batching pays, so that a
        request admitted near its deadline still leaves the time for one; else its own rows."""
        return max(rows, self.max_batch) if self.pays_to_wait else rows

    def observe(self, kind: str, rows: int, run_s: float) -> None:
        """A batch of `rows` images of `kind` ran in `run_s` seconds: update the averages (the overrun against
        the prediction made before this batch)."""
        if (predicted := self.batch_s(kind, rows)) is not None and predicted > 0:
            # faster than predicted is no risk to a deadline; one stall (a page fault storm, a GC) counts as 100%
            self._overrun[kind] = _averaged(self._overrun.get(kind), min(1.0, max(0.0, run_s / predicted - 1.0)))
        self._row_s[kind] = _averaged(self._row_s.get(kind), run_s / rows)
        if self.curve is not None and (curve_s := self.curve.batch_s(rows)):
            self._slow[kind] = _averaged(self._slow.get(kind), run_s / curve_s)
