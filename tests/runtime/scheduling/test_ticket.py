"""A request's ticket: its level may only be lowered, its deadline only tightened."""

from __future__ import annotations

import math

import pytest

from vit_serve.runtime.errors import InvalidValueError
from vit_serve.runtime.scheduling import Caller, DeadlineError, Ticket


@pytest.mark.parametrize("key_level, asked, level", [
    (1, None, 1), (1, 0, 1), (1, 3, 3), (3, 1, 3),  # never above the key's
])
def test_a_request_may_lower_its_level_but_never_raise_it(key_level, asked, level):
    ticket = Ticket(caller=Caller("k", key_level))
    ticket.lowered(asked, levels=5)
    assert ticket.priority == level


@pytest.mark.parametrize("asked", [6, -1, 1.5, True, "2"])
def test_a_level_beyond_the_levels_is_refused(asked):
    with pytest.raises(InvalidValueError, match="priority must be an integer from 0 to 5"):
        Ticket().lowered(asked, levels=5)


@pytest.mark.parametrize("terms, deadline_s", [
    ([], None),
    ([("ms", 0)], None),  # 0: no deadline (Triton's meaning)
    ([("ms", 500)], 0.5),
    ([("ms", 500), ("s", 0.2)], 0.2),  # the earliest wins
    ([("s", 0.2), ("ms", 500)], 0.2),
    ([("v2", {"timeout": 300_000})], 0.3),  # microseconds
])
def test_the_earliest_deadline_wins(terms, deadline_s):
    ticket = Ticket(arrived=10.0)
    for kind, value in terms:
        {"ms": lambda v: ticket.within_ms(v, "t"), "s": lambda v: ticket.within(v, "t"),
         "v2": lambda v: ticket.v2_parameters(v, 5)}[kind](value)
    assert (None if ticket.deadline is None else ticket.deadline - 10.0) == pytest.approx(deadline_s)


@pytest.mark.parametrize("ms", [-1, math.inf, math.nan])
def test_a_bad_deadline_is_refused(ms):
    with pytest.raises(InvalidValueError):
        Ticket().within_ms(ms, "timeout_ms")


def test_a_passed_deadline_is_refused_with_how_late():
    ticket = Ticket(arrived=10.0, deadline=10.5)
    assert ticket.remaining(10.2) == pytest.approx(0.3)
    ticket.check_deadline("on arrival", now=10.4)
    with pytest.raises(DeadlineError, match=r"deadline has passed \(on arrival, 100 ms after it\)"):
        ticket.check_deadline("on arrival", now=10.6)
