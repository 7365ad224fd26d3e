"""The Open Inference Protocol under /v2, spoken by Triton's own client (`tritonclient.http`) to a real uvicorn:
metadata, health, inference with JSON and binary tensors (outputs equal the backend's own), encoded images as
BYTES, and errors as `{"error"}`."""

from __future__ import annotations

import gzip
import json

import httpx
import numpy as np
import pytest
import torch
from gateway_helpers import live_server, settings_for

from vit_serve.explain import rollout
from vit_serve.preprocess import preprocess
from vit_serve.serve.backends.onnxruntime import OnnxRuntimeBackend

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402


@pytest.fixture(scope="module")
def server(tiny_onnx):
    with live_server(settings_for(tiny_onnx)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    c = httpclient.InferenceServerClient(server.removeprefix("http://"), network_timeout=60)
    yield c
    c.close()


@pytest.fixture(scope="module")
def backend(tiny_onnx):
    return OnnxRuntimeBackend(tiny_onnx, device="cpu", threads=1)


@pytest.fixture(scope="module")
def pixels(photos, backend) -> np.ndarray:
    return torch.stack([preprocess(b, backend.info.preprocess) for b in photos.values()]).numpy()


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("tiny")
    assert not client.is_model_ready("other")
    server = client.get_server_metadata()
    assert server["name"] == "vit-serve" and "binary_tensor_data" in server["extensions"]
    meta = client.get_model_metadata("tiny")
    assert meta["name"] == "tiny" and meta["versions"] == ["1"]
    assert {i["name"]: (i["datatype"], i["shape"]) for i in meta["inputs"]} == {
        "pixel_values": ("FP32", [-1, 3, 32, 48]), "image": ("BYTES", [-1])}
    assert {o["name"]: (o["datatype"], o["shape"]) for o in meta["outputs"]} == {
        "logits": ("FP32", [-1, 10]), "rollout": ("FP32", [-1, 2, 3])}
    assert client.get_model_metadata("tiny", "1")["name"] == "tiny"
    with pytest.raises(InferenceServerException, match="unknown model 'other'"):
        client.get_model_metadata("other")


@pytest.mark.parametrize("binary", [True, False])
def test_infer_pixel_values_equals_backend_logits(client, backend, pixels, binary):
    inp = httpclient.InferInput("pixel_values", list(pixels.shape), "FP32")
    inp.set_data_from_numpy(pixels, binary_data=binary)
    out = httpclient.InferRequestedOutput("logits", binary_data=binary)
    result = client.infer("tiny", [inp], outputs=[out], request_id="r1")
    logits = result.as_numpy("logits")
    assert logits.shape == (3, 10) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, backend.classify(pixels), atol=1e-5)
    response = result.get_response()
    assert response["id"] == "r1" and response["model_name"] == "tiny"
    assert [o["name"] for o in response["outputs"]] == ["logits"]
    assert ("parameters" in response["outputs"][0]) is binary  # binary_data_size only for raw outputs
    assert result.as_numpy("rollout") is None
    versioned = client.infer("tiny", [inp], model_version="1", outputs=[out])
    np.testing.assert_array_equal(versioned.as_numpy("logits"), logits)
    with pytest.raises(InferenceServerException, match="no version '2'"):
        client.infer("tiny", [inp], model_version="2", outputs=[out])


def test_infer_without_outputs_returns_all_and_rollout_is_right(client, backend, pixels, tiny_model):
    inp = httpclient.InferInput("pixel_values", list(pixels.shape), "FP32")
    inp.set_data_from_numpy(pixels)
    result = client.infer("tiny", [inp])  # no outputs named: all of them, raw
    logits, heat = backend.explain(pixels)
    np.testing.assert_allclose(result.as_numpy("logits"), logits, atol=1e-5)
    np.testing.assert_allclose(result.as_numpy("rollout"), heat, atol=1e-6)
    with torch.no_grad():
        _, attn = tiny_model(torch.from_numpy(pixels), return_attention=True)
    np.testing.assert_allclose(result.as_numpy("rollout"), rollout(attn, (2, 3), 1, "token", "mean", 0.9).map,
                               atol=1e-5)


def test_infer_encoded_images_as_bytes(client, backend, photos, pixels):
    images = np.array(list(photos.values()), dtype=np.object_)
    for binary in (True, False):
        inp = httpclient.InferInput("image", [len(images)], "BYTES")
        inp.set_data_from_numpy(images, binary_data=True)
        result = client.infer("tiny", [inp], outputs=[httpclient.InferRequestedOutput("logits", binary_data=binary)])
        np.testing.assert_allclose(result.as_numpy("logits"), backend.classify(pixels), atol=1e-5)


def test_infer_errors(client, pixels):
    inp = httpclient.InferInput("pixel_values", [1, 3, 16, 16], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 3, 16, 16), np.float32))
    with pytest.raises(InferenceServerException, match=r"shape \[B, 3, 32, 48\]"):
        client.infer("tiny", [inp])
    good = httpclient.InferInput("pixel_values", list(pixels.shape), "FP32")
    good.set_data_from_numpy(pixels)
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.infer("nope", [good])
    with pytest.raises(InferenceServerException, match="unknown output 'probs'"):
        client.infer("tiny", [good], outputs=[httpclient.InferRequestedOutput("probs")])
    with pytest.raises(InferenceServerException, match=r"head_fusion=mean and discard_ratio=0\.9 only"):
        client.infer("tiny", [good], outputs=[httpclient.InferRequestedOutput("rollout")],
                     parameters={"head_fusion": "max"})
    corrupt = httpclient.InferInput("image", [1], "BYTES")
    corrupt.set_data_from_numpy(np.array([b"not an image"], dtype=np.object_))
    with pytest.raises(InferenceServerException, match="not an image"):
        client.infer("tiny", [corrupt])


def test_plain_http_json_nested_data_and_gzip(server, backend, pixels):
    request = {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [1, 3, 32, 48],
                           "data": pixels[:1].tolist()}], "outputs": [{"name": "logits"}]}
    r = httpx.post(f"{server}/v2/models/tiny/infer", json=request, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    out = r.json()["outputs"][0]
    assert out["shape"] == [1, 10] and out["datatype"] == "FP32"
    np.testing.assert_allclose(out["data"], backend.classify(pixels[:1])[0], atol=1e-5)
    zipped = httpx.post(f"{server}/v2/models/tiny/infer", content=gzip.compress(json.dumps(request).encode()),
                        headers={"Content-Encoding": "gzip"}, timeout=60)
    assert zipped.json() == r.json()
    wrong = httpx.post(f"{server}/v2/models/tiny/infer", content=b"{}", headers={"Content-Encoding": "br"})
    assert wrong.status_code == 415 and "Content-Encoding" in wrong.json()["error"]
