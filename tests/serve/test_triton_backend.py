"""The gateway on the Triton backend, against a real tritonserver (the one bundled in nvidia-pytriton).

One module: a tiny random ViT (Ti/16, depth 2, 32x32, 10 labelled classes) exported with
`vit-export --format onnx,triton`; one server on its Python-backend models (`tiny_py`, `tiny_explain_py`: the
exported ONNX run by onnxruntime inside Triton); the gateway app served by a real uvicorn on a free port.
References: onnxruntime on the exported file, the PyTorch model with `vit_serve.explain.rollout`, and the
sidecar's preprocessing contract through `vit_serve.preprocess` (the one preprocessing function).
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from gateway_helpers import live_server
from vit_export.parity import session
from vit_export.tritonserver import TritonServer, available

import vit_serve
from vit_serve.explain import rollout
from vit_serve.preprocess import PreprocessConfig, load_image, preprocess
from vit_serve.serve.backends.base import BackendUnavailableError
from vit_serve.serve.backends.triton import TritonBackend, parse_url
from vit_serve.serve.settings import ServeSettings

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("onnxruntime")
pytest.importorskip("tritonclient.http.aio")
pytest.importorskip("tritonclient.grpc.aio")

LABELS = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
NAME = "tiny"
RES = 32
MODEL = f"{NAME}_py"
TOL = 1e-5


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    p = np.exp(z - z.max())
    return p / p.sum()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _counters(metrics_url: str, model: str) -> dict[str, float]:
    """Triton's per-model counters (nv_inference_count, nv_inference_exec_count, ...) from its /metrics."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    found = re.findall(rf'^(nv_inference_\w+)\{{[^}}]*model="{model}"[^}}]*\}} (\S+)$', text, re.M)
    return {k: float(v) for k, v in found}


@pytest.fixture(scope="module")
def exported(tmp_path_factory, export_tiny):
    d = tmp_path_factory.mktemp("triton_backend")
    # A 20 ms batching window, so that concurrent requests reliably meet in Triton's queue.
    rc, ckpt = export_tiny(d, RES, 7, LABELS, "--format", "onnx,triton", "--out", str(d / "exports"),
                           "--repo", str(d / "repo"), "--name", NAME, "--queue-delay-us", "20000")
    assert rc == 0
    sidecar = json.loads((d / "exports" / f"{NAME}.json").read_text())
    return {"repo": d / "repo", "onnx": d / "exports" / f"{NAME}.onnx", "model": vit_serve.load(ckpt),
            "preprocess": PreprocessConfig.from_dict(sidecar["preprocess"])}


@pytest.fixture(scope="module")
def server(exported):
    reason = available()
    if reason:
        pytest.skip(f"no tritonserver here: {reason}")
    srv = TritonServer(exported["repo"], models=[MODEL, f"{NAME}_explain_py"])
    srv.start(timeout=90)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def gateway(server) -> Iterator[str]:
    """The gateway's base URL: the app on the Triton backend under a real uvicorn in a thread."""
    settings = ServeSettings(model=MODEL, backend="triton", triton_url=server.http_url, threads=1,
                             decode_workers=2, request_timeout_s=10)
    with live_server(settings) as url:
        yield url


@pytest.fixture(scope="module")
def reference(exported, photos) -> dict[str, dict]:
    """Per photo: the preprocessed tensor [1, 3, H, W] and onnxruntime's logits [K] on the exported file."""
    sess = session(exported["onnx"], threads=1)
    out = {}
    for name, data in photos.items():
        x = preprocess(load_image(data), exported["preprocess"])[None].numpy()
        out[name] = {"x": x, "logits": sess.run(["logits"], {"pixel_values": x})[0][0]}
    return out


def _post(url: str, path: str, data: bytes, name: str, **params) -> httpx.Response:
    kind = "image/png" if name.endswith(".png") else "image/jpeg"
    return httpx.post(f"{url}{path}", params=params, files={"file": (name, data, kind)}, timeout=30)


def _check_predictions(body: dict, logits: np.ndarray) -> float:
    """The gateway's predictions equal softmax(logits) of the reference, best first; returns max |Δ score|."""
    p = _softmax(logits)
    got = body["predictions"]
    assert [g["index"] for g in got] == list(np.argsort(-p, kind="stable")[: len(got)])
    assert [g["label"] for g in got] == [LABELS[g["index"]] for g in got]
    worst = max(abs(g["score"] - p[g["index"]]) for g in got)
    assert worst <= TOL
    return worst


def test_backend_reads_the_model_from_its_config(server, exported):
    """ModelInfo comes from the "vit_serve" parameter of the config; gRPC and HTTP agree with onnxruntime."""
    x = np.random.default_rng(0).standard_normal((3, 3, RES, RES)).astype(np.float32)
    ref = session(exported["onnx"], threads=1).run(["logits"], {"pixel_values": x})[0]
    infos = []
    for url in (server.http_url, f"grpc://{server.grpc_url}"):
        backend = TritonBackend(MODEL, url, startup_timeout_s=10)
        info = backend.info
        infos.append(info)
        assert (info.resolution, info.patch_size, info.num_classes, info.labels) == ((RES, RES), 16, 10, LABELS)
        assert info.preprocess == exported["preprocess"]
        assert info.explain and info.rollout == {"head_fusion": "mean", "discard_ratio": 0.9}
        assert backend.ready()

        async def calls(b=backend):
            logits = await asyncio.gather(*(b.aclassify(x[i:i + 1]) for i in range(3)))
            both = await b.aexplain(x)
            await b.aclose()
            return np.concatenate(logits), both

        logits, (ex_logits, heat) = asyncio.run(calls())
        assert np.abs(logits - ref).max() <= TOL and np.abs(ex_logits - ref).max() <= TOL
        assert heat.shape == (3, RES // 16, RES // 16)
        assert np.abs(backend.classify(x) - ref).max() <= TOL  # the sync form (scripts, warm-up)
        with pytest.raises(NotImplementedError, match="torch backend"):
            backend.grad_rollout(x[:1])
    assert infos[0].preprocess == infos[1].preprocess and infos[0].labels == infos[1].labels


def test_backend_errors(server):
    with pytest.raises(ValueError, match="scheme"):
        parse_url("ftp://127.0.0.1:1")
    assert parse_url("localhost:8000") == ("http", "localhost:8000")
    assert parse_url("grpc://triton") == ("grpc", "triton:8001")
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailableError, match=r"'missing_py'.*not ready"):
        TritonBackend("missing_py", server.http_url, startup_timeout_s=0.5)
    with pytest.raises(BackendUnavailableError, match="not ready"):  # nothing listens there
        TritonBackend(MODEL, f"http://127.0.0.1:{_free_port()}", startup_timeout_s=0.5)
    assert time.monotonic() - t0 < 5
    with pytest.raises(ValueError, match=f"not a logits model.*serve {NAME}_py"):  # the explain model
        TritonBackend(f"{NAME}_explain_py", server.http_url, startup_timeout_s=5)


def test_classify_photos_matches_onnxruntime(gateway, photos, reference):
    for name, data in photos.items():
        r = _post(gateway, "/classify", data, name, top_k=10)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == MODEL and body["resolution"] == [RES, RES] and len(body["predictions"]) == 10
        print(f"\n{name}: max |Δ score| vs onnxruntime {_check_predictions(body, reference[name]['logits']):.1e}")


def test_explain_matches_pytorch_rollout(gateway, photos, reference, exported):
    model = exported["model"]
    for name, data in photos.items():
        r = _post(gateway, "/explain", data, name, format="json")
        assert r.status_code == 200, r.text
        body = r.json()
        with torch.no_grad():
            logits, attn = model(torch.from_numpy(reference[name]["x"]), return_attention=True)
        want = rollout(attn, (RES // 16, RES // 16), model.num_prefix_tokens, model.cfg.pool, "mean", 0.9).map[0]
        assert body["grid"] == [2, 2] and body["head_fusion"] == "mean" and body["discard_ratio"] == 0.9
        diff = np.abs(np.array(body["map"]) - want.numpy()).max()
        assert diff <= TOL
        print(f"\n{name}: max |Δ rollout| vs PyTorch {diff:.1e}")
        _check_predictions(body, logits[0].numpy())
    # The same map for an image kept from POST /classify; PNG overlay; settings the graph lacks are refused.
    r = _post(gateway, "/classify", photos["chelsea.jpg"], "chelsea.jpg")
    again = httpx.get(f"{gateway}/explain", params={"id": r.json()["id"], "format": "json"}, timeout=30)
    assert again.status_code == 200 and again.json()["map"] == body["map"]
    png = httpx.get(f"{gateway}/explain", params={"id": r.json()["id"]}, timeout=30)
    assert png.status_code == 200 and png.content[:8] == b"\x89PNG\r\n\x1a\n"
    for params in ({"method": "grad_rollout"}, {"head_fusion": "max"}):
        bad = _post(gateway, "/explain", photos["chelsea.jpg"], "chelsea.jpg", format="json", **params)
        assert bad.status_code == 400, bad.text


def test_concurrent_requests_are_batched_by_triton(gateway, server, photos, reference):
    n = 24
    names = list(photos) * (n // len(photos))
    before = _counters(server.metrics_url, MODEL)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gateway, timeout=30) as client:
            return await asyncio.gather(*(client.post("/classify", params={"top_k": 10},
                                                      files={"file": (nm, photos[nm], "image/jpeg")})
                                          for nm in names))

    responses = asyncio.run(burst())
    after = _counters(server.metrics_url, MODEL)
    for nm, r in zip(names, responses, strict=True):
        assert r.status_code == 200, r.text
        _check_predictions(r.json(), reference[nm]["logits"])
    requests = after["nv_inference_count"] - before["nv_inference_count"]
    executions = after["nv_inference_exec_count"] - before["nv_inference_exec_count"]
    print(f"\n{n} concurrent /classify -> Triton: {requests:.0f} inferences in {executions:.0f} executions")
    assert requests == n
    assert executions < requests


def test_gateway_survives_a_triton_restart(gateway, server, photos, reference):
    """Triton goes away: /readyz and /classify answer 503; it comes back on the same ports: both recover,
    without restarting the gateway."""
    data, name = photos["astronaut.png"], "astronaut.png"
    assert httpx.get(f"{gateway}/readyz", timeout=5).status_code == 200
    server.stop()
    try:
        r = httpx.get(f"{gateway}/readyz", timeout=10)
        assert r.status_code == 503 and r.json()["ready"] is False
        r = _post(gateway, "/classify", data, name)
        assert r.status_code == 503, r.text
        assert "unavailable" in r.json()["detail"] and r.headers.get("retry-after")
    finally:
        t0 = time.monotonic()
        server.start(timeout=90)
        started = time.monotonic() - t0
    deadline = time.monotonic() + 20
    while httpx.get(f"{gateway}/readyz", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the gateway did not become ready within 20 s of Triton's restart"
        time.sleep(0.05)
    ready_after = time.monotonic() - t0 - started
    r = _post(gateway, "/classify", data, name, top_k=10)
    assert r.status_code == 200, r.text
    _check_predictions(r.json(), reference[name]["logits"])
    print(f"\nTriton restarted in {started:.2f} s; gateway ready {ready_after:.3f} s after that")
