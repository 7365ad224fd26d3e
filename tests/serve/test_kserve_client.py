"""The Open Inference Protocol under /v2, spoken by KServe's own Python SDK (`kserve.InferenceRESTClient` with
`RESTConfig(protocol="v2")`) to the gateway under a real uvicorn: server and model health, metadata (validated
by the SDK's v2 data models), inference with JSON and binary tensors and with encoded images as BYTES, the
classification extension and an error. Reference: onnxruntime on the exported file (the gateway's backend, run
here directly) and Triton's classification format.

The SDK pins its own web stack, so it may live in another environment: VIT_SERVE_KSERVE_PYTHON names that
environment's python (.ci/run makes one); without it the test uses this interpreter when it has `kserve`, and
skips otherwise. A VIT_SERVE_KSERVE_PYTHON that cannot import kserve fails the test (CI must not skip it).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gateway_helpers import LABELS, live_server, settings_for

from vit_serve.preprocess import preprocess
from vit_serve.runtime.backends.onnxruntime import OnnxRuntimeBackend

SCRIPT = Path(__file__).with_name("kserve_client_script.py")
TOL = 1e-5


@pytest.fixture(scope="module")
def answers(kserve_python, request, tmp_path_factory) -> dict:
    python = kserve_python  # before the export: a skip costs nothing
    tiny_onnx, photos = request.getfixturevalue("tiny_onnx"), request.getfixturevalue("photos")
    folder = tmp_path_factory.mktemp("kserve")
    backend = OnnxRuntimeBackend(tiny_onnx, device="cpu", threads=1)
    pixels = torch.stack([preprocess(b, backend.info.preprocess) for b in photos.values()]).numpy()
    np.save(folder / "pixels.npy", pixels)
    for i, data in enumerate(photos.values()):
        (folder / f"image_{i}.bin").write_bytes(data)
    with live_server(settings_for(tiny_onnx)) as url:
        done = subprocess.run([python, str(SCRIPT), url, "tiny", str(folder)], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    logits, heat = backend.explain(pixels)
    return {"got": json.loads(done.stdout), "logits": backend.classify(pixels), "explain_logits": logits,
            "rollout": heat}


def _ok(got: dict, key: str):
    value = got[key]
    assert not (isinstance(value, dict) and "exception" in value), f"{key}: {value}"
    return value


def _tensor(out: dict, name: str) -> np.ndarray:
    t = out[name]
    assert t["datatype"] == "FP32"
    return np.asarray(t["data"], np.float32).reshape(t["shape"])


def test_health_and_model_readiness(answers):
    got = answers["got"]
    assert _ok(got, "server_live") is True  # a JSONDecodeError on an empty body
    assert _ok(got, "server_ready") is True
    assert _ok(got, "model_ready") is True and _ok(got, "other_model_ready") is False
    assert got["live"] == {"live": True} and got["ready"] == {"ready": True}
    assert got["model_ready_body"] == {"name": "tiny", "ready": True}


def test_metadata_fits_kserves_data_models(answers):
    got = answers["got"]
    assert _ok(got, "server_metadata")["name"] == "vit-serve"
    assert {"binary_tensor_data", "classification"} <= set(got["server_metadata"]["extensions"])
    meta = _ok(got, "model_metadata")
    assert meta["name"] == "tiny" and meta["versions"] == ["1"]
    assert {t["name"]: (t["datatype"], t["shape"]) for t in meta["inputs"]} == {
        "pixel_values": ("FP32", [-1, 3, 32, 48]), "image": ("BYTES", [-1])}
    assert {t["name"]: (t["datatype"], t["shape"]) for t in meta["outputs"]} == {
        "logits": ("FP32", [-1, 10]), "rollout": ("FP32", [-1, 2, 3])}


@pytest.mark.parametrize("case", ["json", "binary", "all_outputs_binary", "images_binary", "images_json"])
def test_inference_equals_onnxruntime(answers, case):
    out = _ok(answers["got"], case)
    logits = _tensor(out, "logits")
    # No outputs named: the explain graph runs (logits + rollout), as the gateway's backend does.
    err = float(np.abs(logits - answers["explain_logits" if case == "all_outputs_binary" else "logits"]).max())
    print(f"KServe SDK, {case}: max |Δ logit| vs onnxruntime = {err:.2e}")
    assert logits.shape == (3, 10) and err <= TOL
    if case == "all_outputs_binary":
        assert set(out) == {"logits", "rollout"}
        rollout_err = float(np.abs(_tensor(out, "rollout") - answers["rollout"]).max())
        print(f"KServe SDK, rollout: max |Δ| vs onnxruntime = {rollout_err:.2e}")
        assert rollout_err <= 1e-6
    else:
        assert set(out) == {"logits"}


def test_classification_and_errors(answers):
    got = answers["got"]
    out = _ok(got, "classification")["logits"]
    assert (out["datatype"], out["shape"]) == ("BYTES", [3, 3])
    for row, ref in zip(np.array(out["data"]).reshape(3, 3), answers["logits"], strict=True):
        order = np.argsort(-ref, kind="stable")[:3]
        parsed = [entry.split(":") for entry in row]  # Triton's "value:index:label"
        assert [(int(i), label) for _, i, label in parsed] == [(int(i), LABELS[i]) for i in order]
        np.testing.assert_allclose([float(v) for v, _, _ in parsed], ref[order], atol=5e-6 + TOL)
    error = got["unknown_output"]
    assert error.get("status") == 400 and "unknown output 'probs'" in error["exception"], error
