"""The stalled-arrival rule: announced requests count as coming while their bytes keep coming."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from vit_serve.runtime.scheduling import STALL_S, live_arrivals
from vit_serve.runtime.scheduling.arrivals import Arrival, Arrivals

NOW = 100.0
HEARD = [(1, NOW), (2, NOW - STALL_S / 2), (2, NOW - 2 * STALL_S), (3, None), (2, None)]


@pytest.mark.parametrize("now, cap, level, coming", [
    (NOW, 10, None, 4),  # every level; the one silent for 2 x STALL_S does not count
    (NOW, 10, 1, 1),  # at level 1 or a more urgent one
    (NOW, 10, 2, 3),
    (NOW, 2, None, 2),  # at most the cap
    (NOW + 2 * STALL_S, 10, None, 2),  # later, only those not reading a body
    (NOW + STALL_S, 10, None, 3),  # exactly STALL_S since its bytes: still coming
])
def test_an_announced_request_counts_while_its_bytes_keep_coming(now, cap, level, coming):
    assert live_arrivals(HEARD, now, cap=cap, level=level) == coming
    assert live_arrivals([], now, cap=cap, level=level) == 0


def test_an_arrival_counts_from_its_announcement_until_it_is_done():
    async def scenario():
        arrivals = Arrivals()
        body = SimpleNamespace(last=NOW)
        with Arrival(arrivals, priority=2) as a:
            a.heard_from(body)
            during = (len(arrivals), arrivals.coming(NOW, 8), arrivals.coming(NOW, 8, level=1))
            body.last = NOW - 1.0  # its upload stalled
            stalled = arrivals.coming(NOW, 8)
        return during, stalled, len(arrivals), arrivals.news.is_set()

    assert asyncio.run(scenario()) == ((1, 1, 0), 0, 0, True)
