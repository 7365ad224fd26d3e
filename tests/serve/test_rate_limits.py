"""Rate limits and priority levels per API key (issue 22, point 3): a keys file with names, levels and token
buckets; a key over its rate gets 429 with `Retry-After` and the IETF draft's `RateLimit-*` headers (gRPC:
RESOURCE_EXHAUSTED with `retry-after` trailing metadata), one bucket per key shared by HTTP and gRPC; /metrics
counts each key by its name, never by the key or its hash. Against a real gateway under uvicorn (httpx, grpcio
with tritonclient's generated stubs) and a real `vit-serve serve` refusing a bad keys file; the bucket itself
against an independent computation (GCRA, in exact fractions)."""

from __future__ import annotations

import hashlib
import random
import time
from fractions import Fraction
from math import ceil, floor

import httpx
import pytest
from gateway_helpers import live_app, metric, settings_for

from vit_serve.serve.admission import DEFAULT_PRIORITY, Caller
from vit_serve.serve.keys import key_entry
from vit_serve.serve.rate_limit import Rate, TokenBucket
from vit_serve.serve.security import KeyRing, rated

LIMITED, OTHER, GRPC_KEY = "limited-key-7c41", "other-key-0e93", "grpc-key-b2d8"
OTHER_HEX = hashlib.sha256(OTHER.encode()).hexdigest()
JPEG = {"Content-Type": "image/jpeg"}


@pytest.fixture(scope="module")
def gateway(tiny_ckpt, tmp_path_factory):
    """A gateway (HTTP and gRPC) whose keys file holds a limited key (1 request/s, bursts of 2), a key given as its
    hash with no limit and no name, and a limited key for the gRPC test; yields (URL, gRPC address)."""
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# name, level, rate\n{LIMITED} name=batch priority=3 rate=1 burst=2\n\n"
                    f"sha256:{OTHER_HEX}\n{GRPC_KEY}  name=grpc-batch  rate=1  burst=2\n")
    with live_app(settings_for(tiny_ckpt, api_keys_file=str(keys), grpc_port=0)) as (url, app):
        yield url, app.state.grpc.address


def _numbers(r: httpx.Response) -> dict[str, str | None]:
    return {k: r.headers.get(k) for k in ("Retry-After", "RateLimit-Limit", "RateLimit-Remaining",
                                          "RateLimit-Reset", "RateLimit-Policy")}


def test_over_rate_requests_get_429_with_the_drafts_headers(gateway, photos):
    url, _ = gateway
    a, b = {"X-API-Key": LIMITED}, {"Authorization": f"Bearer {OTHER}"}
    with httpx.Client(base_url=url, timeout=60) as c:
        probes = [c.get("/healthz", headers=a).status_code for _ in range(4)]  # probes do not count
        quick = [c.get("/v2/models/tiny", headers=a), c.get("/v2/models/tiny", headers=a),
                 c.get("/v2/models/tiny", headers=a),
                 c.post("/classify", content=photos["coffee.jpg"], headers={**JPEG, **a})]
        others = [c.get("/v2/models/tiny", headers=b) for _ in range(6)]
        time.sleep(int(quick[2].headers["RateLimit-Reset"]))  # the bucket is full again
        later = c.post("/classify", content=photos["coffee.jpg"], headers={**JPEG, **a})
        text = c.get("/metrics", headers=b).text  # /metrics needs a key (it is not rated)
    assert probes == [200] * 4
    assert [r.status_code for r in quick] == [200, 200, 429, 429], [r.text for r in quick]
    policy = "1;w=1;burst=2"
    # A full bucket of 2, 1 token a second: 1 left and full in 1 s, then none and full in 2 s.
    assert _numbers(quick[0]) == {"Retry-After": None, "RateLimit-Limit": "2", "RateLimit-Remaining": "1",
                                  "RateLimit-Reset": "1", "RateLimit-Policy": policy}
    assert _numbers(quick[1]) == {"Retry-After": None, "RateLimit-Limit": "2", "RateLimit-Remaining": "0",
                                  "RateLimit-Reset": "2", "RateLimit-Policy": policy}
    for refused in quick[2:]:  # a token back within 1 s, the bucket full within 2 s
        assert _numbers(refused) == {"Retry-After": "1", "RateLimit-Limit": "2", "RateLimit-Remaining": "0",
                                     "RateLimit-Reset": "2", "RateLimit-Policy": policy}
    assert "rate limit" in quick[2].json()["error"] and "rate limit" in quick[3].json()["detail"]  # their envelopes
    assert later.status_code == 200 and later.json()["predictions"]
    assert later.headers["RateLimit-Remaining"] == "1"
    assert [r.status_code for r in others] == [200] * 6 and all("RateLimit-Limit" not in r.headers for r in others)
    # Counted by name (the unnamed key: "key-" and 8 hex digits of its hash), never by the key or the whole hash.
    assert metric(text, "vit_serve_key_requests_total", key="batch", result="accepted") == 3
    assert metric(text, "vit_serve_key_requests_total", key="batch", result="rate_limited") == 2
    assert metric(text, "vit_serve_key_requests_total", key=f"key-{OTHER_HEX[:8]}", result="accepted") == 6
    assert metric(text, "vit_serve_key_requests_total", key=f"key-{OTHER_HEX[:8]}", result="rate_limited") == 0
    assert LIMITED not in text and OTHER not in text and OTHER_HEX not in text


def test_grpc_over_rate_is_resource_exhausted_with_retry_after(gateway):
    """The same bucket over gRPC and HTTP: once gRPC calls have emptied it, HTTP is refused too."""
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc.service_pb2_grpc import GRPCInferenceServiceStub

    url, address = gateway
    md = (("x-api-key", GRPC_KEY),)
    outcomes, refusal = [], None
    with grpc.insecure_channel(address) as channel:
        stub = GRPCInferenceServiceStub(channel)
        live = [stub.ServerLive(pb.ServerLiveRequest(), metadata=md, timeout=30).live for _ in range(4)]
        for _ in range(3):
            try:
                stub.ModelMetadata(pb.ModelMetadataRequest(name="tiny"), metadata=md, timeout=30)
                outcomes.append("OK")
            except grpc.RpcError as e:
                outcomes.append(e.code().name)
                refusal = e
    over_http = httpx.get(f"{url}/v2/models/tiny", headers={"X-API-Key": GRPC_KEY}, timeout=60)
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {OTHER}"}, timeout=60).text
    assert live == [True] * 4  # the probes do not count
    assert outcomes == ["OK", "OK", "RESOURCE_EXHAUSTED"], outcomes
    assert refusal is not None and "rate limit" in refusal.details()
    trailing = dict(refusal.trailing_metadata())
    assert trailing["retry-after"] == "1" and trailing["ratelimit-remaining"] == "0"
    assert trailing["ratelimit-policy"] == "1;w=1;burst=2"
    assert over_http.status_code == 429 and over_http.headers["Retry-After"] == "1"
    assert metric(text, "vit_serve_key_requests_total", key="grpc-batch", result="accepted") == 2
    assert metric(text, "vit_serve_key_requests_total", key="grpc-batch", result="rate_limited") == 2


def test_a_bad_keys_file_line_refuses_the_start_in_one_line(capsys, tiny_ckpt, tmp_path):
    from vit_serve.cli import main

    keys = tmp_path / "keys.txt"
    keys.write_text(f"{OTHER}\n{LIMITED} name=batch rate=fast\n")
    assert main(["serve", str(tiny_ckpt), "--api-keys-file", str(keys)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vit-serve serve: error: "), err
    assert f"the key file {keys}, line 2, field 'rate=fast': rate must be a number" in err
    assert LIMITED not in err


@pytest.mark.parametrize(("line", "says"), [
    ("k priority=0", "field 'priority=0': priority must be an integer >= 1"),
    ("k rate=-1", "field 'rate=-1': rate must be a number of requests per second > 0"),
    ("k rate=inf", "field 'rate=inf': rate must be"),
    ("k rate=2 burst=0", "field 'burst=0': burst must be an integer >= 1"),
    ("k burst=3", "burst needs rate="),
    ("k name=a/b", "field 'name=a/b': a name is"),
    ("k colour=red", "field 'colour': not one of name=, priority=, rate=, burst="),
    ("k rate=1 rate=2", "field 'rate': given twice"),
    ("secret half-of-key", "field 2: not one of"),  # the rest of a key with a space is not echoed
])
def test_bad_fields_are_named(line, says):
    with pytest.raises(ValueError) as e:
        key_entry(line, "the key file f, line 7")
    assert str(e.value).startswith("the key file f, line 7, ") and says in str(e.value)
    assert "half-of-key" not in str(e.value)


def _caller(ring: KeyRing, key: str | None) -> Caller | None:
    identity = ring.identify(key)
    return None if identity is None else identity.caller


def test_fields_and_defaults(tmp_path):
    e = key_entry("k name=jobs priority=4 rate=2.5", "-")
    assert (e.name, e.priority, e.rate, e.burst) == ("jobs", 4, 2.5, 3)  # burst: ceil(rate)
    keys = tmp_path / "keys"
    keys.write_text("k name=jobs priority=4 rate=2.5\n")
    ring = KeyRing(keys_file=str(keys))
    assert _caller(ring, "k") == Caller("jobs", 4) and ring.take(ring.identify("k").scope).remaining == 2
    e = key_entry("k rate=0.2", "-")
    assert (e.rate, e.burst, e.priority) == (0.2, 1, None)  # no level given: the ring's default level
    assert e.name == "key-" + hashlib.sha256(b"k").hexdigest()[:8]
    from vit_serve.serve.settings import SecuritySettings

    ring = KeyRing.from_settings(SecuritySettings(api_keys=["given"]))
    assert _caller(ring, "given") == Caller("key-" + hashlib.sha256(b"given").hexdigest()[:8], DEFAULT_PRIORITY)
    assert _caller(ring, "wrong") is None and ring.take(ring.identify("given").scope) is None
    assert _caller(KeyRing(), None) == Caller()  # keys off: the anonymous caller
    assert rated("/classify") and rated("/v2/models/tiny/infer") and rated("/v2")
    assert not (rated("/v2/health/ready") or rated("/healthz") or rated("/metrics") or rated("/"))


def _gcra(times: list[float], per_s: Fraction, burst: int) -> list[tuple[bool, int, int, int | None]]:
    """The generic cell rate algorithm (ITU-T I.371), the token bucket's twin, in exact fractions: each request at
    t is allowed when its theoretical arrival time is at most (burst - 1) emission intervals ahead of t. ->
    (allowed, whole tokens left, seconds until full rounded up, retry-after rounded up or None)."""
    interval, tat, out = 1 / per_s, Fraction(0), []
    for time_s in times:
        t = Fraction(time_s)
        allowed = tat - t <= (burst - 1) * interval
        if allowed:
            tat = max(tat, t) + interval
        ahead = max(Fraction(0), tat - t)  # how long until the bucket is full
        tokens = burst - ahead * per_s
        retry = None if allowed else ceil(ahead - (burst - 1) * interval)
        out.append((allowed, floor(tokens), ceil(ahead), retry))
    return out


@pytest.mark.parametrize(("per_s", "burst"), [(Fraction(2), 2), (Fraction(1, 3), 1), (Fraction(7, 2), 5)])
def test_the_bucket_matches_gcra(per_s, burst):
    rng = random.Random(22)
    times, t = [], 0.0
    for _ in range(400):  # bursts and pauses
        t += rng.choice([rng.uniform(0, 0.05), rng.uniform(0, 0.5), rng.uniform(0, 3.0)])
        times.append(t)
    now = [0.0]
    bucket = TokenBucket(Rate(float(per_s), burst), clock=lambda: now[0])
    got = []
    for time_s in times:
        now[0] = time_s
        v = bucket.take()
        got.append((v.allowed, v.remaining, v.reset_s, v.retry_after_s))
    assert got == _gcra(times, per_s, burst)
    assert 0 < sum(g[0] for g in got) < len(got)  # both verdicts were met
