"""The batching decisions as pure functions: tables of (queue, instances, cost, now) -> decision."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest

from vit_serve.runtime.scheduling import policy
from vit_serve.runtime.scheduling.cost import CostModel
from vit_serve.runtime.scheduling.instances import InstanceSnapshot, Lane
from vit_serve.runtime.scheduling.pending import Entry
from vit_serve.runtime.scheduling.ticket import Ticket
from vit_serve.runtime.task import CLASSIFY

NOW = 100.0


def entry(level: int = 1, rows: int = 1, deadline_ms: float | None = None, t0: float = NOW) -> Entry:
    """A waiting request: its own deadline `deadline_ms` after NOW, else the request timeout's (30 s); the policy
    never reads its future (a plain one: no event loop)."""
    deadline = None if deadline_ms is None else NOW + deadline_ms / 1e3
    return Entry(CLASSIFY, np.zeros((rows, 3, 4, 4), np.float32), Future(),  # type: ignore[arg-type]
                 Ticket(arrived=t0, deadline=deadline, priority=level), deadline or t0 + 30.0, t0)


def cost(row_ms: float | None = None, max_batch: int = 8, instances: int = 1, overrun: float = 0.0) -> CostModel:
    model = CostModel(max_batch, instances)
    if row_ms is not None:
        model.seed("classify", row_ms / 1e3, overrun)
    return model


def lanes(*specs: tuple[int, int, float, bool], count: int = 1) -> InstanceSnapshot:
    """Running batches: (level, rows, started ms before NOW, staged)."""
    return InstanceSnapshot(count, tuple(Lane([entry(level, rows)], NOW - ago / 1e3, staged)
                                         for level, rows, ago, staged in specs))


def queue(*entries: Entry, seen: dict[int, float] | None = None) -> policy.QueueSnapshot:
    return policy.QueueSnapshot(tuple(entries), seen or {})


@pytest.mark.parametrize("seen_ms_ago, level, active_s", [
    ({}, 2, 0.0),
    ({1: 500}, 2, 1.5),  # level 1's latest request 0.5 s ago: active 1.5 s more
    ({1: 500}, 1, 0.0),  # nothing more urgent than level 1
    ({1: 2000}, 2, 0.0),  # quiet for ACTIVE_S
    ({1: 1500, 2: 100}, 3, 1.9),  # the latest of the more urgent levels
    ({3: 0}, 2, 0.0),  # a less urgent level never counts
])
def test_a_level_is_active_for_two_seconds_after_its_latest_request(seen_ms_ago, level, active_s):
    seen = {lv: NOW - ms / 1e3 for lv, ms in seen_ms_ago.items()}
    assert policy.urgent_active_s(seen, level, NOW) == pytest.approx(active_s)
    rows = policy.rows_beside_urgent(queue(seen=seen), level, cost(), NOW)
    assert rows == (1 if active_s > 0 else 8)


@pytest.mark.parametrize("entries, limit, chosen", [
    ([(1, 1), (1, 1), (1, 1)], 8, [0, 1, 2]),
    ([(1, 1), (1, 1), (1, 1)], 2, [0, 1]),
    ([(1, 1), (2, 1), (1, 1)], 8, [0, 2]),  # one level only: never topped up with less urgent rows
    ([(1, 3), (1, 4), (1, 2)], 5, [0, 2]),  # the next that fits
    ([(1, 6)], 2, [0]),  # the first always, whatever the limit
])
def test_a_batch_takes_the_first_then_its_level_while_it_fits(entries, limit, chosen):
    ordered = [entry(level, rows) for level, rows in entries]
    assert policy.choose(ordered, limit) == [ordered[i] for i in chosen]


@pytest.mark.parametrize("row_ms, overrun, deadline_ms, rows, expected", [
    (None, 0.0, 250, 1, 8),  # nothing known: max_batch
    (100, 0.0, None, 1, 8),  # no deadline of its own
    (100, 0.0, 250, 1, 2),
    (100, 0.0, 450, 1, 4),
    (100, 0.5, 250, 1, 1),  # batches ran 50% over: room for 2.5x
    (100, 0.0, 50, 3, 3),  # at least its own rows
    (10, 0.0, 1000, 1, 8),  # never more than max_batch
])
def test_a_batch_holds_no_more_rows_than_its_first_deadline_allows(row_ms, overrun, deadline_ms, rows, expected):
    first = entry(rows=rows, deadline_ms=deadline_ms)
    assert policy.rows_in_time(first, cost(row_ms, overrun=overrun), NOW) == expected


@pytest.mark.parametrize("count, running, level, waiting, row_ms, share", [
    (1, [], 1, 6, 100, 6),  # one instance: all of them
    (2, [], 1, 6, None, 6),  # no estimate: all of them
    (2, [], 1, 6, 100, 3),  # two idle instances: half each
    (3, [], 1, 7, 100, 3),  # the first instance gets the odd row
    (2, [(1, 1, 0, False)], 1, 4, 100, 3),  # the other instance busy for 100 ms: it finishes one row meanwhile
    (2, [(2, 1, 0, True)], 1, 4, 100, 2),  # a less urgent staged batch gives its instance up: free now
    (2, [(2, 1, 0, False)], 1, 4, 100, 3),  # ...a batch run whole does not
    (2, [], 1, 1, 100, 1),
])
def test_where_batching_does_not_pay_a_batch_takes_its_share_among_the_instances(count, running, level, waiting,
                                                                                  row_ms, share):
    snapshot = lanes(*running, count=count)
    assert policy.share(snapshot, cost(row_ms, instances=count), "classify", level, waiting, NOW) == share


@pytest.mark.parametrize("count, running, stageable, seen_ms_ago, kept_s", [
    (1, [], False, {1: 0}, 0.0),  # one instance: never (the batch holds one image instead)
    (2, [], False, {1: 0}, 0.0),  # both idle: this batch leaves one free anyway
    (2, [(1, 1, 0, False)], False, {1: 0}, 2.0),  # the last free instance: kept while level 1 is active
    (2, [(1, 1, 0, False)], True, {1: 0}, 0.0),  # a staged batch gives its instance back at its next stage
    (2, [(1, 1, 0, False)], False, {}, 0.0),  # no urgent level active
    (3, [(1, 1, 0, False)], False, {1: 500}, 0.0),  # two free: one is still kept after this batch
])
def test_with_several_instances_one_is_kept_free_for_an_active_urgent_level(count, running, stageable,
                                                                             seen_ms_ago, kept_s):
    seen = {lv: NOW - ms / 1e3 for lv, ms in seen_ms_ago.items()}
    first = entry(level=2)
    kept = policy.kept_for_urgent(queue(first, seen=seen), lanes(*running, count=count), first, stageable, NOW)
    assert kept == pytest.approx(kept_s)


@pytest.mark.parametrize("running, waiting, ahead, rows, row_ms, finish_ms", [
    ([], [], 0, 1, 100, None),  # idle: nothing to predict from (run it, and learn)
    ([(1, 1, 30, False)], [], 0, 1, None, None),  # no estimate yet
    ([(1, 1, 30, False)], [], 0, 1, 100, 170),  # 70 ms left of the running batch, then its own
    ([(1, 1, 30, False)], [1], 3, 1, 100, 470),  # and the 3 images ahead of it
    ([(1, 2, 0, False)], [1], 0, 2, 100, 400),
    ([(1, 1, 200, False)], [1], 0, 1, 100, 100),  # a batch past its predicted end: free now
])
def test_a_request_is_predicted_to_finish_after_the_work_ahead_and_its_own_batch(running, waiting, ahead, rows,
                                                                                   row_ms, finish_ms):
    finish = policy.finish_at(queue(*(entry(lv) for lv in waiting)), lanes(*running), cost(row_ms), NOW,
                              "classify", ahead, rows)
    assert (None if finish is None else round((finish - NOW) * 1e3)) == finish_ms


@pytest.mark.parametrize("row_ms, overrun, deadline_ms, rows, margin_ms", [
    (100, 0.0, None, 1, 0),  # the request timeout alone: no margin
    (100, 0.0, 500, 1, 100),
    (100, 0.0, 500, 2, 200),
    (100, 1.0, 500, 1, 400),
    (None, 0.0, 500, 1, 0),
])
def test_a_waiting_request_is_given_up_its_own_batchs_time_before_its_deadline(row_ms, overrun, deadline_ms,
                                                                               rows, margin_ms):
    margin = policy.margin_s(entry(rows=rows, deadline_ms=deadline_ms), cost(row_ms, overrun=overrun))
    assert round(margin * 1e3) == margin_ms
