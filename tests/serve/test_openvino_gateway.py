"""A gateway serving the tiny export with `--backend openvino`: over HTTP (/classify, /explain), /v2 and gRPC its
answers equal onnxruntime's within the precision's bounds (f32: 1e-4, the rollout through the explain graph too;
the CPU's native precision: the same top-1 and cosine >= 0.999), and /models shows the precision, the device the
plugin reports and the accuracy gate's numbers."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import NamedTuple

import httpx
import numpy as np
import pytest
from gateway_helpers import live_app, run, serving, settings_for

from vit_serve.accuracy_bounds import BOUNDS

ov = pytest.importorskip("openvino")
grpcclient = pytest.importorskip("tritonclient.grpc")


class Live(NamedTuple):
    url: str
    grpc: str


@pytest.fixture(scope="module", params=["f32", "auto"])
def served(request, tiny_onnx) -> Iterator[tuple[Live, str]]:
    """The gateway on OpenVINO in `precision` (auto: the plugin's native), gRPC on; (addresses, precision)."""
    settings = settings_for(tiny_onnx, backend="openvino", precision=request.param, openvino_cache_dir="",
                            grpc_port=0)
    with live_app(settings) as (url, app):
        yield Live(url, app.state.grpc.address), request.param


def _expected_precision(asked: str) -> str:
    native = ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()
    return "fp32" if asked == "f32" or native == "f32" else {"bf16": "bf16", "f16": "fp16"}[native]


def _assert_within(got: np.ndarray, ref: np.ndarray, precision: str) -> None:
    """f32: within 1e-4 of onnxruntime; a reduced precision: its bounds (the same top-1, cosine)."""
    if precision == "fp32":
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
        return
    flat_got, flat_ref = got.reshape(len(got), -1), ref.reshape(len(ref), -1)
    assert (flat_got.argmax(1) == flat_ref.argmax(1)).all()
    cos = (flat_got * flat_ref).sum(1) / (np.linalg.norm(flat_got, axis=1) * np.linalg.norm(flat_ref, axis=1))
    assert cos.min() >= BOUNDS[precision][1], cos


def test_models_shows_precision_device_and_accuracy(served):
    live, asked = served
    version = httpx.get(f"{live.url}/models").json()["models"][0]["versions"][0]
    precision = _expected_precision(asked)
    assert version["backend"] == "openvino" and version["state"] == "READY"
    assert version["precision"] == precision
    assert version["device"] == ov.Core().get_property("CPU", "FULL_DEVICE_NAME")
    if precision == "fp32":
        assert version["accuracy"] is None
    else:
        acc = version["accuracy"]
        assert acc["ok"] and not acc["forced"] and acc["precision"] == precision and acc["n"] >= 30
        assert acc["agreement"] >= acc["min_agreement"] == BOUNDS[precision][0]
        assert acc["cosine"] >= acc["min_cosine"] == BOUNDS[precision][1]
        assert isinstance(acc["rollout_max_abs"], float)  # the explain graph's maps against f32's, reported


def test_v2_and_grpc_equal_onnxruntime(served, backend, pixels):
    live, asked = served
    precision = _expected_precision(asked)
    body = {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": list(pixels.shape),
                        "data": pixels.ravel().tolist()}], "outputs": [{"name": "logits"}, {"name": "rollout"}]}
    r = httpx.post(f"{live.url}/v2/models/tiny/infer", json=body, timeout=60)
    assert r.status_code == 200, r.text
    http = {o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"]) for o in r.json()["outputs"]}
    ref_logits, ref_rollout = backend.explain(pixels)
    _assert_within(http["logits"], ref_logits, precision)
    _assert_within(http["rollout"], ref_rollout, precision)
    client = grpcclient.InferenceServerClient(live.grpc)
    try:
        inp = grpcclient.InferInput("pixel_values", list(pixels.shape), "FP32")
        inp.set_data_from_numpy(pixels)
        result = client.infer("tiny", [inp], outputs=[grpcclient.InferRequestedOutput("logits")])
    finally:
        client.close()
    _assert_within(result.as_numpy("logits"), backend.classify(pixels), precision)


def test_classify_and_explain_over_http_equal_onnxruntime(served, backend, pixels, photos):
    live, asked = served
    precision = _expected_precision(asked)
    ref_logits, ref_rollout = backend.explain(pixels)
    for i, (name, data) in enumerate(photos.items()):
        got = httpx.post(f"{live.url}/classify?top_k=10", files={"file": (name, data)}, timeout=60)
        assert got.status_code == 200, got.text
        scores = np.zeros(10)
        for p in got.json()["predictions"]:
            scores[p["index"]] = p["score"]
        z = ref_logits[i].astype(np.float64)
        softmax = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        _assert_within(scores[None], softmax[None], precision)
        heat = httpx.post(f"{live.url}/explain?format=json", files={"file": (name, data)}, timeout=60)
        assert heat.status_code == 200, heat.text
        _assert_within(np.array(heat.json()["map"])[None], ref_rollout[i:i + 1], precision)


def test_a_models_config_toml_picks_openvino_in_a_repository(tiny_onnx, tmp_path):
    """REPO/ov/config.toml says runtime = "openvino" (f32); REPO/plain has none: onnxruntime serves it."""
    for name in ("ov", "plain"):
        version = tmp_path / name / "1"
        version.mkdir(parents=True)
        for f in tiny_onnx.parent.iterdir():
            if f.name.startswith("tiny"):
                shutil.copy(f, version / f.name)
    (tmp_path / "ov" / "config.toml").write_text('runtime = "openvino"\nprecision = "f32"\n')

    async def scenario():
        async with serving(settings_for(tmp_path, openvino_cache_dir="")) as (client, _):
            return (await client.get("/models")).json()

    versions = {m["name"]: m["versions"][0] for m in run(scenario())["models"]}
    assert versions["ov"]["backend"] == "openvino" and versions["ov"]["precision"] == "fp32"
    assert versions["ov"]["device"] == ov.Core().get_property("CPU", "FULL_DEVICE_NAME")
    assert versions["plain"]["backend"] == "onnxruntime" and versions["plain"]["device"] == "cpu"
