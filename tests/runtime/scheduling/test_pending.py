"""The pending queue: order, room and shedding, expiry, take."""

from __future__ import annotations

import pytest
from test_policy import NOW, entry

from vit_serve.runtime.scheduling.pending import PendingQueue
from vit_serve.runtime.scheduling.ticket import SHADOW
from vit_serve.runtime.task import CLASSIFY, EMBED


def filled(*entries, max_queue: int = 8) -> PendingQueue:
    q = PendingQueue(max_queue)
    q.add(list(entries))
    return q


@pytest.mark.parametrize("specs, first", [
    ([(2, None, 0), (1, None, 1)], 1),  # the most urgent level
    ([(1, None, 0), (1, None, 1)], 0),  # then the oldest (equal requests keep their order)
    ([(1, None, 0), (1, 500, 1)], 1),  # an earlier deadline goes first within a level
    ([(1, 500, 0), (2, 100, 1)], 0),  # never across levels
])
def test_the_first_is_the_most_urgent_then_earliest_deadline_then_oldest(specs, first):
    entries = [entry(level, deadline_ms=d, t0=NOW + ms / 1e3) for level, d, ms in specs]
    assert filled(*entries).first() is entries[first]


@pytest.mark.parametrize("levels, max_queue, newcomer, shed", [
    ([1, 1], 3, 1, []),  # room
    ([1, 1, 1], 3, 1, None),  # full, nothing less urgent: refused
    ([2, 3, 2], 3, 1, [1]),  # the least urgent first
    ([2, 2, 2], 3, 1, [2]),  # then the newest
    ([2, SHADOW, 2], 3, 2, [1]),  # shadow copies below every level
    ([2, 2, 2], 3, 2, None),  # only below the newcomer's level
])
def test_a_full_queue_sheds_the_least_urgent_newest_below_the_newcomer(levels, max_queue, newcomer, shed):
    entries = [entry(level, t0=NOW + i) for i, level in enumerate(levels)]
    got = filled(*entries, max_queue=max_queue).to_shed(1, newcomer)
    assert got == (None if shed is None else [entries[i] for i in shed])


def test_late_entries_expire_by_their_deadline_less_their_margin():
    entries = [entry(deadline_ms=100), entry(deadline_ms=300), entry()]
    q = filled(*entries)
    assert q.late(NOW + 0.05, lambda e: 0.0) == []
    assert q.late(NOW + 0.1, lambda e: 0.0) == [entries[0]]
    assert q.late(NOW + 0.1, lambda e: 0.25) == entries[:2]
    assert q.late(NOW + 31, lambda e: 0.0) == entries  # the request timeout too


def test_rows_are_counted_per_task_as_entries_come_and_go():
    a, b, c = entry(rows=2), entry(rows=3), entry(rows=1)
    c.task = EMBED
    q = filled(a, b, c)
    assert (q.rows(CLASSIFY), q.rows(EMBED), len(q)) == (5, 1, 3)
    q.take([a])
    q.drop(c, c)  # dropping twice is harmless
    assert (q.rows(CLASSIFY), q.rows(EMBED), len(q)) == (3, 0, 1)
    assert q.of_task(CLASSIFY) == [b] and q.ahead(CLASSIFY, lambda e: True) == 3
    assert q.clear() == [b] and len(q) == 0
