"""The batching decisions, as pure functions of (queue snapshot, instance snapshot, cost, now).

The batching runner takes them in this order:

As a request arrives (before its body is read) and again as it is queued:
  1. room: a full queue sheds its least urgent, newest requests below the newcomer's level
     (`PendingQueue.to_shed`), else refuses it (503);
  2. in time: a request with a deadline that the batches running, the work ahead of it and then its own batch
     cannot meet is refused (504; `finish_at`); never while the model is idle, nor before a first batch.
Each time an instance is free, the collector:
  3. expires the waiting requests past their deadline, or too near it for their own batch (`margin_s`);
  4. hands the instance back to a paused staged batch when nothing waiting is more urgent (`Instances.grant`);
  5. takes the most urgent waiting request as the batch's first, and with several instances keeps one free
     while a more urgent level is active, unless the batch would run in stages (`kept_for_urgent`);
  6. waits for the batch to fill, at most max_delay_ms after its first arrived and only while more requests are
     coming (`arrivals.live_arrivals`; where the batch curve says waiting does not pay, never);
  7. sizes the batch (`batch_limit`): one level only, no more rows than the first's deadline leaves time for
     (`rows_in_time`), one image while a more urgent level is active (`rows_beside_urgent`), and where batching
     does not pay, its share of its level's waiting rows among the instances (`share`); then `choose`s them;
  8. runs it in stages while a more urgent level is active (the backend allows it), else whole.
A level counts as active while one of its requests was queued within `ACTIVE_S`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vit_serve.runtime.scheduling.cost import CostModel
from vit_serve.runtime.scheduling.instances import InstanceSnapshot, Lane
from vit_serve.runtime.scheduling.pending import Entry

# 2 s is some six gaps between arrivals of a level at a few requests a second (a Poisson gap that long is rarer
# than 1 in 300), short enough to let the less urgent level batch again soon after.
ACTIVE_S = 2.0


@dataclass(frozen=True)
class QueueSnapshot:
    """The waiting requests, and when each level's latest request was queued."""

    entries: tuple[Entry, ...]
    seen: Mapping[int, float]


def urgent_active_s(seen: Mapping[int, float], level: int, now: float) -> float:
    """Seconds until every level more urgent than `level` goes quiet (`ACTIVE_S` after its latest request);
    0 when none is active."""
    return max((t + ACTIVE_S - now for lv, t in seen.items() if lv < level and now - t < ACTIVE_S), default=0.0)


def left_s(lane: Lane, cost: CostModel, now: float) -> float:
    """Seconds until `lane`'s batch is predicted to end (from its start; 0 without an estimate or once past)."""
    run_s = cost.batch_s(lane.kind, lane.rows) or 0.0
    return max(0.0, run_s - (now - lane.started))


def busy_s(instances: InstanceSnapshot, cost: CostModel, now: float) -> float:
    """Seconds until an instance is free for the next batch: 0 while one is idle, else the soonest end of the
    batches running."""
    if instances.idle > 0:
        return 0.0
    return min(left_s(lane, cost, now) for lane in instances.lanes)


def finish_at(queue: QueueSnapshot, instances: InstanceSnapshot, cost: CostModel, now: float, kind: str,
              ahead: int, rows: int) -> float | None:
    """When a request of `rows` images of `kind` is predicted to be answered: after the batches running, the
    `ahead` images before it and then its own batch (`CostModel.own_rows`). None when nothing can be predicted or
    the model is idle (nothing running or waiting: run it, and learn)."""
    work, own = cost.work_s(kind, ahead), cost.batch_s(kind, cost.own_rows(rows))
    if work is None or own is None or not (instances.lanes or queue.entries):
        return None
    return now + busy_s(instances, cost, now) + work + own


def margin_s(entry: Entry, cost: CostModel) -> float:
    """The time before its deadline a waiting request is given up: its own rows' run time (`sure_batch_s`), for a
    deadline of its own (it could not finish), none for the request timeout alone."""
    if entry.ticket.deadline is None:
        return 0.0
    return cost.sure_batch_s(entry.task.kind, entry.rows) or 0.0


def kept_for_urgent(queue: QueueSnapshot, instances: InstanceSnapshot, first: Entry, stageable: bool,
                    now: float) -> float:
    """With several instances, a batch led by `first` leaves one instance free while a more urgent level is
    active, so that the urgent level's next request finds one free instead of waiting behind less urgent work: the
    seconds until that level goes quiet when the batch must wait, else 0 (one instance: never, the less urgent
    batch holds one image instead, `rows_beside_urgent`; a batch run in stages never: it gives its instance back
    at the next stage)."""
    if instances.count == 1 or len(instances.lanes) < instances.count - 1 or stageable:
        return 0.0
    return urgent_active_s(queue.seen, first.level, now)


def rows_in_time(first: Entry, cost: CostModel, now: float) -> int:
    """The most rows a batch led by `first` may hold and still end before its deadline (`sure_batch_s`;
    max_batch without a deadline or an estimate; at least its own)."""
    if first.ticket.deadline is None or not cost.known(first.task.kind):
        return cost.max_batch
    left = first.deadline - now
    fits = [k for k in range(first.rows + 1, cost.max_batch + 1)
            if (cost.sure_batch_s(first.task.kind, k) or 0.0) <= left]
    return max([first.rows, *fits])


def rows_beside_urgent(queue: QueueSnapshot, level: int, cost: CostModel, now: float) -> int:
    """The most rows a batch of `level` may hold: one while a more urgent level is active, so that the urgent
    level's next request waits behind one image of less urgent work at most; max_batch when none is. On a CPU a
    batch's time grows with its rows, and batches of one cost the less urgent level a few percent of throughput
    (ViT-S/16 here: 0.148 s an image at batch 1, 0.134 at 8)."""
    return 1 if urgent_active_s(queue.seen, level, now) > 0 else cost.max_batch


def share(instances: InstanceSnapshot, cost: CostModel, kind: str, level: int, waiting: int, now: float) -> int:
    """The rows a batch of `level` takes of the `waiting` rows of `kind` at its level, with several instances
    where batching does not pay: each row goes to the instance that would finish it first (idle now, running a
    less urgent batch in stages, which gives it up, or predicted free at the end of its batch), this batch's
    instance among them, so that a burst runs on every instance at once instead of as one long batch beside an
    idle one. All of them without an estimate."""
    per_row = cost.batch_s(kind, 1)
    if instances.count == 1 or per_row is None or cost.pays_to_wait:
        return waiting
    ends = [0.0] * instances.idle  # this batch's instance first, then the other idle ones
    for lane in instances.lanes:  # a less urgent staged batch gives its instance up: free now
        ends.append(0.0 if lane.staged and lane.level > level else left_s(lane, cost, now))
    mine = 0
    for _ in range(waiting):
        first = min(range(len(ends)), key=ends.__getitem__)
        ends[first] += per_row
        mine += first == 0
    return max(1, mine)


def batch_limit(queue: QueueSnapshot, instances: InstanceSnapshot, cost: CostModel, ordered: Sequence[Entry],
                now: float) -> int:
    """The most rows the batch led by `ordered[0]` (its task's waiting entries, most urgent first) may hold."""
    first = ordered[0]
    waiting = sum(i.rows for i in ordered if i.level == first.level)
    return min(rows_in_time(first, cost, now), rows_beside_urgent(queue, first.level, cost, now),
               share(instances, cost, first.task.kind, first.level, waiting, now))


def choose(ordered: Sequence[Entry], limit: int) -> list[Entry]:
    """The batch: the first entry always, then others of its level while they fit in `limit` rows (a batch is not
    topped up with less urgent work, which would make the urgent wait for it)."""
    batch: list[Entry] = []
    rows = 0
    for item in ordered:
        if not batch or (item.level == ordered[0].level and rows + item.rows <= limit):
            batch.append(item)
            rows += item.rows
    return batch
