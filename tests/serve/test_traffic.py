"""Weighted canaries, sticky sessions, shadow traffic and the live agreement between versions (`traffic`,
`compare`), against a real uvicorn serving vit/1, vit/2 and vit/3: a tiny export and two copies with other random
weights (so their logits differ), compared with the versions' own ONNX files run offline with onnxruntime."""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import pytest
from gateway_helpers import LABELS, live_server, metric, settings_for

from vit_serve.runtime.discovery import parse_shadow, parse_weights
from vit_serve.serve.traffic import TrafficPolicy, stable_draw

KEY, ADMIN = "k-traffic-1", "admin-traffic-9"
USER, ROOT = {"X-API-Key": KEY}, {"X-API-Key": ADMIN}
RES = 32


def within_binomial(hits: int, n: int, p: float, z: float = 4.5) -> bool:
    """`hits` of `n` draws with probability `p` lie within z standard deviations of n p (4.5 sd: a false alarm
    about once in 150,000 runs)."""
    return abs(hits - n * p) <= z * math.sqrt(n * p * (1 - p))


# ---- the policy alone ------------------------------------------------------------------------------------


def test_parse_forms_and_refusals():
    assert parse_weights("1:90,2:10") == {1: 90.0, 2: 10.0}
    assert parse_weights("2") == {2: 1.0}
    assert parse_shadow("3") == (3, 100.0) and parse_shadow("3:25") == (3, 25.0)
    for bad in ("", "1:90,", "a:1", "1:-1", "1:0,2:0", "1:1,1:2", "1,2", "0:5", "1:nan"):
        with pytest.raises(ValueError):
            parse_weights(bad)
    for bad in ("x", "3:0", "3:101", "0", "3:a"):
        with pytest.raises(ValueError):
            parse_shadow(bad)
    from vit_serve.serve.settings import ServeSettings

    s = ServeSettings(model="m", traffic=["vit=1:90,2:10"], shadow=["vit=3:25"])
    assert s.repository.traffic_weights == {"vit": {1: 90.0, 2: 10.0}} and s.repository.shadows == {"vit": (3, 25.0)}
    for bad in ({"traffic": ["vit"]}, {"traffic": ["vit=1:-2"]}, {"shadow": ["vit=3:0"]},
                {"traffic": ["a=1", "a=2"]}):
        with pytest.raises(ValueError):
            ServeSettings(model="m", **bad)


def test_choose_weights_renormalisation_and_sticky():
    policy = TrafficPolicy.parse("vit", "1:90,2:10", "3")
    rng = random.Random(7)
    n = 2000
    counts = Counter(policy.choose({1, 2, 3}, None, rng) for _ in range(n))
    assert set(counts) == {1, 2}  # the shadow takes no requests
    assert within_binomial(counts[2], n, 0.10)
    assert policy.primary({1, 2, 3}) == 1 and policy.primary({2, 3}) == 2
    # a version out of service is left out, the rest renormalised; none in service: the newest
    skewed = TrafficPolicy.of("vit", {1: 60, 2: 20, 4: 20})
    counts = Counter(skewed.choose({1, 2}, None, rng) for _ in range(n))
    assert within_binomial(counts[2], n, 0.25)
    assert skewed.choose({5, 6}, None, rng) == 6
    # sticky: one session, one version, whatever the rng; sessions spread by weight
    assert len({policy.choose({1, 2}, "session-a", random.Random(i)) for i in range(50)}) == 1
    sessions = Counter(policy.choose({1, 2}, f"s{i}", rng) for i in range(n))
    assert within_binomial(sessions[2], n, 0.10)
    assert stable_draw("vit", "s1") != stable_draw("other", "s1")  # the model is part of the hash
    for bad in ({1: -1}, {1: 0}, {0: 1}):
        with pytest.raises(ValueError):
            TrafficPolicy.of("vit", bad)


# ---- a gateway serving three versions ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def repo(tmp_path_factory, export_tiny) -> Path:
    """vit/1, vit/2, vit/3: the tiny ViT at 32x32 exported once with logits and embedding (version 1), and the
    same graph with its weights perturbed by two other seeds (versions 2, 3): one export, three models."""
    import onnx
    from onnx import numpy_helper

    work = tmp_path_factory.mktemp("traffic-export")
    result, _ = export_tiny(work, RES, 1, LABELS, out=work / "out", name="model", outputs="logits,embedding")
    assert result.ok
    root = tmp_path_factory.mktemp("traffic-repo")
    for v in (1, 2, 3):
        folder = root / "vit" / str(v)
        folder.mkdir(parents=True)
        shutil.copy(result.onnx.with_suffix(".json"), folder / "model.json")
        graph = onnx.load(str(result.onnx))
        rng = np.random.default_rng(v)
        for init in graph.graph.initializer if v > 1 else ():
            w = numpy_helper.to_array(init)
            if w.dtype == np.float32 and w.size > 1:
                noisy = w + rng.normal(0, 0.5 * float(w.std()) + 1e-3, w.shape).astype(np.float32)
                init.CopyFrom(numpy_helper.from_array(noisy, init.name))
        onnx.save(graph, str(folder / "model.onnx"))
        side = json.loads((folder / "model.json").read_text())  # the manifest records the graph's new bytes
        side["file_sha256"] = hashlib.sha256((folder / "model.onnx").read_bytes()).hexdigest()
        (folder / "model.json").write_text(json.dumps(side))
    # the model's own split, which the flags of the `url` server override
    (root / "vit" / "config.pbtxt").write_text(_config("3", "1:50"))
    return root


def _config(traffic: str, shadow: str) -> str:
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as pb

    config = pb.ModelConfig(name="vit")
    config.parameters["traffic"].string_value = traffic
    config.parameters["shadow"].string_value = shadow
    return text_format.MessageToString(config)


def test_config_pbtxt_traffic(tmp_path):
    from vit_serve.runtime.discovery import scan

    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.safetensors").write_bytes(b"")
    (tmp_path / "m" / "config.pbtxt").write_text(_config("1:90,2:10", "3:25"))
    entry = scan(tmp_path)["m"]
    assert entry.error is None and entry.traffic == {1: 90.0, 2: 10.0} and entry.shadow == (3, 25.0)
    (tmp_path / "m" / "config.pbtxt").write_text(_config("1:-5", "3"))
    assert "traffic '1:-5'" in scan(tmp_path)["m"].error  # unusable, with the reason, as any bad config


@pytest.fixture(scope="module")
def offline(repo):
    """version -> x -> (logits, embedding), each version's model.onnx run with onnxruntime directly."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sessions = {v: ort.InferenceSession(str(repo / "vit" / str(v) / "model.onnx"), opts,
                                        providers=["CPUExecutionProvider"]) for v in (1, 2, 3)}

    def run(v: int, x: np.ndarray) -> dict[str, np.ndarray]:
        s = sessions[v]
        names = [o.name for o in s.get_outputs()]
        return dict(zip(names, s.run(names, {s.get_inputs()[0].name: x}), strict=True))

    return run


@pytest.fixture(scope="module")
def url(repo):
    settings = settings_for(repo, traffic=["vit=1:80,2:20"], shadow=["vit=3"], api_keys=[KEY],
                            admin_api_keys=[ADMIN])
    with live_server(settings) as base:
        yield base


def _x(seed: int, n: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 3, RES, RES)).astype(np.float32)


def _infer(client: httpx.Client, x: np.ndarray, version: int | None = None, embedding: bool = False,
           headers: dict | None = None) -> tuple[int, dict[str, np.ndarray]]:
    path = "/v2/models/vit/infer" if version is None else f"/v2/models/vit/versions/{version}/infer"
    outputs = [{"name": "logits"}] + ([{"name": "embedding"}] if embedding else [])
    body = {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": list(x.shape),
                        "data": x.ravel().tolist()}], "outputs": outputs}
    r = client.post(path, json=body, headers={**USER, **(headers or {})})
    assert r.status_code == 200, r.text
    got = r.json()
    return int(got["model_version"]), {o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"])
                                       for o in got["outputs"]}


def _post_traffic(client: httpx.Client, body: object, headers: dict = ROOT) -> httpx.Response:
    return client.post("/v2/repository/models/vit/traffic", json=body, headers=headers)


def _compare(client: httpx.Client) -> dict:
    r = client.get("/models/vit/compare", headers=USER)
    assert r.status_code == 200, r.text
    return r.json()


def _settle(client: httpx.Client, version: int, pairs: int) -> dict:
    """The compare entry of `version` once it has `pairs` pairs (its copies run in the background)."""
    deadline = time.monotonic() + 30
    while True:
        found = {e["version"]: e for e in _compare(client)["versions"]}.get(version)
        if found is not None and found["pairs"] >= pairs:
            return found
        assert time.monotonic() < deadline, f"version {version}: {found} after 30 s, waiting for {pairs} pairs"
        time.sleep(0.01)


def _dropped(client: httpx.Client) -> float:
    return metric(client.get("/metrics", headers=USER).text, "vit_serve_shadow_dropped_total", model="vit")


def _expected(pairs: list[tuple[dict, dict]]) -> dict:
    """The window's numbers computed offline from (primary outputs, other outputs) per request."""
    agree = [a["logits"].argmax(1) == b["logits"].argmax(1) for a, b in pairs]
    delta = [np.abs(a["logits"].astype(np.float64) - b["logits"]).mean(1) for a, b in pairs]
    cos = [np.sum(a["embedding"] * b["embedding"], 1) / (np.linalg.norm(a["embedding"], axis=1)
                                                          * np.linalg.norm(b["embedding"], axis=1))
           for a, b in pairs if "embedding" in a and "embedding" in b]
    return {"images": int(sum(len(a) for a in agree)), "top1_agreement": float(np.concatenate(agree).mean()),
            "logit_abs_delta": float(np.concatenate(delta).mean()),
            "embedding_cosine": float(np.concatenate(cos).mean()) if cos else None}


def test_flags_load_the_named_versions_and_show_the_policy(url):
    with httpx.Client(base_url=url, timeout=30) as client:
        models = client.get("/models", headers=USER).json()["models"]
        vit = next(m for m in models if m["name"] == "vit")
        assert [v["version"] for v in vit["versions"] if v["state"] == "READY"] == [1, 2, 3]  # not latest:1 alone
        assert vit["traffic"] == {"traffic": {"1": 80.0, "2": 20.0}, "shadow": {"version": 3, "share": 100.0},
                                  "primary": 1}


def test_shadow_pairs_equal_the_offline_computation(url, offline):
    """Every request goes to version 1, each copied to the shadow, version 3; the client gets version 1's own
    answer, and the window's numbers are those of the same pairs computed offline."""
    with httpx.Client(base_url=url, timeout=30) as client:
        assert _post_traffic(client, {"traffic": {"1": 100}, "shadow": {"version": 3}}).status_code == 200
        dropped = _dropped(client)
        pairs = []
        for i in range(12):
            x = _x(100 + i, n=2)
            version, got = _infer(client, x, embedding=i % 2 == 0)
            own = offline(1, x)
            assert version == 1
            np.testing.assert_allclose(got["logits"], own["logits"], atol=1e-4)  # never the shadow's answer
            assert not np.allclose(got["logits"], offline(3, x)["logits"], atol=1e-2)
            shadow = offline(3, x)
            if i % 2:
                own.pop("embedding"), shadow.pop("embedding")
            pairs.append((own, shadow))
            _settle(client, 3, i + 1)  # one copy at a time: none is dropped for a busy queue
        entry = _settle(client, 3, 12)
        assert _dropped(client) == dropped
        want = _expected(pairs)
        assert entry["role"] == "shadow" and entry["primary"] == 1 and entry["images"] == want["images"] == 24
        for k in ("top1_agreement", "logit_abs_delta", "embedding_cosine"):
            assert entry[k] == pytest.approx(want[k], abs=1e-4), k
        assert entry["primary_latency"]["p50_ms"] > 0 and entry["other_latency"]["p99_ms"] > 0
        text = client.get("/metrics", headers=USER).text
        assert metric(text, "vit_serve_compare_pairs_total", model="vit", version="3", role="shadow") >= 12
        assert metric(text, "vit_serve_compare_top1_agreement", model="vit", version="3") == pytest.approx(
            want["top1_agreement"], abs=1e-4)


def test_canary_pairs_with_the_primary(url, offline):
    """Version 1 as a canary of primary 2: its answers are copied to 2, and compared (no embeddings: null)."""
    with httpx.Client(base_url=url, timeout=30) as client:
        r = _post_traffic(client, {"traffic": {"2": 99, "1": 1}, "shadow": None})
        assert r.status_code == 200 and r.json()["primary"] == 2
        pairs = []
        for i in range(6):
            x = _x(200 + i)
            version, got = _infer(client, x, version=1)
            assert version == 1
            np.testing.assert_allclose(got["logits"], offline(1, x)["logits"], atol=1e-4)
            pairs.append(({"logits": offline(2, x)["logits"]}, {"logits": offline(1, x)["logits"]}))
            _settle(client, 1, i + 1)
        entry = _settle(client, 1, 6)
        want = _expected(pairs)
        assert entry["role"] == "canary" and entry["primary"] == 2 and entry["embedding_cosine"] is None
        assert entry["top1_agreement"] == pytest.approx(want["top1_agreement"], abs=1e-6)
        assert entry["logit_abs_delta"] == pytest.approx(want["logit_abs_delta"], abs=1e-4)


def test_weights_hold_over_http_and_the_shadow_never_answers(url, offline):
    with httpx.Client(base_url=url, timeout=30) as client:
        assert _post_traffic(client, {"traffic": {"1": 80, "2": 20}, "shadow": {"version": 3}}).status_code == 200
        n, counts = 240, Counter()
        x = _x(300)
        own = {v: offline(v, x)["logits"] for v in (1, 2)}
        for _ in range(n):
            version, got = _infer(client, x)
            counts[version] += 1
            np.testing.assert_allclose(got["logits"], own[version], atol=1e-4)
        assert set(counts) == {1, 2}
        assert within_binomial(counts[2], n, 0.20), counts
        # an explicit version still wins
        assert all(_infer(client, x, version=2)[0] == 2 for _ in range(10))


def test_sticky_sessions(url):
    with httpx.Client(base_url=url, timeout=30) as client:
        assert _post_traffic(client, {"traffic": {"1": 50, "2": 50}}).status_code == 200
        policy = TrafficPolicy.of("vit", {1: 50, 2: 50})
        seen = Counter()
        for s in range(24):
            session = f"client-{s}"
            got = {_infer(client, _x(s), headers={"X-Session-Id": session})[0] for _ in range(4)}
            assert got == {policy.choose({1, 2, 3}, session, random.Random())}
            seen[got.pop()] += 1
        assert set(seen) == {1, 2}


def test_post_traffic_refusals_and_atomic_switch(url):
    with httpx.Client(base_url=url, timeout=30) as client:
        assert _post_traffic(client, {"traffic": {"2": 1}}, headers=USER).status_code == 403
        assert client.post("/v2/repository/models/vit/traffic", json={"traffic": {"2": 1}}).status_code == 401
        for bad in ({"traffic": {"7": 1}}, {"traffic": {"1": -1}}, {"traffic": {"1": 0, "2": 0}},
                    {"traffic": {"x": 1}}, {"traffic": {"1": "lots"}}, {"traffic": [1]},
                    {"shadow": {"version": 9}}, {"shadow": {"version": 3, "share": 0}}, {"weights": {}}, [1]):
            r = _post_traffic(client, bad)
            assert r.status_code == 400 and r.json()["error"], (bad, r.text)
        assert _post_traffic(client, {"traffic": {"1": 1}}).status_code == 200
        assert client.post("/v2/repository/models/nope/traffic", json={}, headers=ROOT).status_code in (400, 404)
        x = _x(400)
        assert {_infer(client, x)[0] for _ in range(10)} == {1}
        r = _post_traffic(client, {"traffic": {"2": 1}})
        assert r.status_code == 200 and r.json() == {"traffic": {"2": 1.0}, "shadow": None, "primary": 2}
        assert {_infer(client, x)[0] for _ in range(10)} == {2}  # every request after the switch
        assert _compare(client)["policy"]["traffic"] == {"2": 1.0}


def test_under_load_every_copy_is_compared_or_counted_dropped(url, offline):
    """32 concurrent requests with a 100 % shadow: every client gets version 1's own answer, and each of the 32
    copies is either a compared pair or counted in vit_serve_shadow_dropped_total (busy queues shed them)."""
    import asyncio

    x = _x(500)
    own = offline(1, x)["logits"]
    body = {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": list(x.shape),
                        "data": x.ravel().tolist()}], "outputs": [{"name": "logits"}]}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            return await asyncio.gather(*(client.post("/v2/models/vit/infer", json=body, headers=USER)
                                          for _ in range(32)))

    with httpx.Client(base_url=url, timeout=30) as client:
        assert _post_traffic(client, {"traffic": {"1": 1}, "shadow": {"version": 3}}).status_code == 200
        dropped = _dropped(client)
        answers = asyncio.run(burst())
        for r in answers:
            assert r.status_code == 200 and r.json()["model_version"] == "1"
            np.testing.assert_allclose(np.asarray(r.json()["outputs"][0]["data"]).reshape(own.shape), own, atol=1e-4)
        deadline = time.monotonic() + 30
        while True:
            entry = {e["version"]: e for e in _compare(client)["versions"]}.get(3, {"pairs": 0})
            if entry["pairs"] + _dropped(client) - dropped >= 32 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert entry["pairs"] + _dropped(client) - dropped == 32
