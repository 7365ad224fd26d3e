"""Each model's traffic policy as the repository keeps it (vit_serve.serve.traffic.TrafficSplits): the flags over
the model's config, the repository API's policy winning until the model is unloaded, and the draw that routes by
it. No model is loaded: the versions in service are stand-ins, the split only picks among them."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from vit_serve.serve.traffic import TrafficPolicy, TrafficSplits

SERVED = {1: "v1", 2: "v2", 3: "v3"}


def splits(weights=None, shadows=None) -> TrafficSplits:
    return TrafficSplits(weights or {}, shadows or {}, lambda name: SERVED, CollectorRegistry())


@pytest.mark.parametrize(("flags", "config", "expected"), [
    ({}, None, None),  # no split: the newest in service
    ({}, {1: 50.0, 2: 50.0}, {1: 50.0, 2: 50.0}),  # the config's
    ({"m": {2: 100.0}}, {1: 50.0, 2: 50.0}, {2: 100.0}),  # the flag wins over the config
    ({"other": {2: 100.0}}, {1: 100.0}, {1: 100.0}),  # another model's flag is not this one's
])
def test_flags_over_config(flags, config, expected) -> None:
    t = splits(flags)
    t.configure("m", config, None)
    policy = t.get("m")
    assert (None if policy is None else dict(policy.weights)) == expected
    assert t.versions("m") == frozenset(expected or ())


def test_the_shadow_is_named_too() -> None:
    t = splits(shadows={"m": (3, 25.0)})
    t.configure("m", {1: 100.0}, None)
    assert t.versions("m") == {1, 3}
    assert t.get("m").shadow.share == 25.0


def test_the_api_policy_wins_until_the_model_is_unloaded() -> None:
    t = splits()
    t.configure("m", {1: 100.0}, None)
    t.set("m", TrafficPolicy.of("m", {2: 100.0}))
    t.configure("m", {1: 100.0}, None)  # a poll, a reload: the API's policy stays
    assert dict(t.get("m").weights) == {2: 100.0}
    t.reset("m")
    t.configure("m", {1: 100.0}, None)
    assert dict(t.get("m").weights) == {1: 100.0}


@pytest.mark.parametrize(("weights", "served", "expected"), [
    (None, SERVED, "v3"),  # no split: the newest
    ({1: 100.0}, SERVED, "v1"),
    ({2: 100.0}, {1: "v1", 3: "v3"}, "v3"),  # the weighted version is not in service: the newest that is
    ({1: 0.0, 2: 100.0}, SERVED, "v2"),
])
def test_choose(weights, served, expected) -> None:
    t = splits()
    t.configure("m", weights, None)
    assert {t.choose("m", served, session) for session in (None, "a", "b", "c")} == {expected}


def test_a_session_sticks_to_its_draw() -> None:
    t = splits()
    t.configure("m", {1: 50.0, 2: 50.0}, None)
    draws = {s: t.choose("m", SERVED, s) for s in map(str, range(40))}
    assert draws == {s: t.choose("m", SERVED, s) for s in map(str, range(40))}
    assert set(draws.values()) == {"v1", "v2"}
