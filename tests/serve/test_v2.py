"""The Open Inference Protocol under /v2, spoken by Triton's own client (`tritonclient.http`) to a real uvicorn:
metadata, health (Triton's status codes with KServe's JSON bodies), inference with JSON and binary tensors
(outputs equal the backend's own), encoded images as BYTES, the classification extension (`class_count`) against
a real tritonserver's answer for the same exported model, and errors as `{"error"}`."""

from __future__ import annotations

import gzip
import json
import re

import httpx
import numpy as np
import pytest
import torch
from gateway_helpers import LABELS, RES, live_server, run, serving, settings_for

import vit_serve
from vit_serve.explain import rollout

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
    with pytest.raises(InferenceServerException, match="no version 2 in service"):
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


def test_health_bodies_are_the_kserve_json_with_tritons_status_codes(server):
    """KServe's spec: {"live": true}, {"ready": true}, {"name", "ready"}; tritonclient reads the 200s above."""
    for path, body in [("/v2/health/live", {"live": True}), ("/v2/health/ready", {"ready": True}),
                       ("/v2/models/tiny/ready", {"name": "tiny", "ready": True}),
                       ("/v2/models/tiny/versions/1/ready", {"name": "tiny", "ready": True})]:
        r = httpx.get(f"{server}{path}", timeout=30)
        assert (r.status_code, r.headers["content-type"], r.json()) == (200, "application/json", body), path
    r = httpx.get(f"{server}/v2/models/other/ready", timeout=30)
    assert r.status_code == 404 and "unknown model 'other'" in r.json()["error"]
    assert "classification" in httpx.get(f"{server}/v2", timeout=30).json()["extensions"]


# Triton's classification strings: std::to_string(float) is printf's %f (six decimals).
CLASS_STRING = re.compile(r"(-?\d+\.\d{6}|-?inf|-?nan):(\d+)(?::(.*))?")


def _parse_classes(row) -> list[tuple[float, int, str | None]]:
    out = []
    for entry in row:
        m = CLASS_STRING.fullmatch(entry.decode() if isinstance(entry, bytes) else entry)
        assert m, entry
        out.append((float(m.group(1)), int(m.group(2)), m.group(3)))
    return out


@pytest.mark.parametrize("binary", [True, False])
def test_class_count_gives_tritons_classification(client, backend, pixels, binary):
    inp = httpclient.InferInput("pixel_values", list(pixels.shape), "FP32")
    inp.set_data_from_numpy(pixels)
    result = client.infer("tiny", [inp], outputs=[
        httpclient.InferRequestedOutput("logits", binary_data=binary, class_count=4),
        httpclient.InferRequestedOutput("rollout", binary_data=binary, class_count=2)])
    out = {o["name"]: o for o in result.get_response()["outputs"]}
    assert (out["logits"]["datatype"], out["logits"]["shape"]) == ("BYTES", [3, 4])
    assert (out["rollout"]["datatype"], out["rollout"]["shape"]) == ("BYTES", [3, 2])
    logits, heat = backend.explain(pixels)
    classes = result.as_numpy("logits")
    worst = 0.0
    for row, ref in zip(classes, logits, strict=True):
        parsed = _parse_classes(row)
        order = np.argsort(-ref, kind="stable")[:4]
        assert [i for _, i, _ in parsed] == order.tolist()
        assert [label for _, _, label in parsed] == [LABELS[i] for i in order]
        worst = max(worst, float(np.abs(np.array([v for v, _, _ in parsed]) - ref[order]).max()))
    assert worst <= 5e-6 + 1e-5  # six decimals, plus the 1e-5 of the logits themselves
    for row, ref in zip(result.as_numpy("rollout"), heat.reshape(3, -1), strict=True):
        parsed = _parse_classes(row)
        assert [i for _, i, _ in parsed] == np.argsort(-ref, kind="stable")[:2].tolist()
        assert all(label is None for _, _, label in parsed)  # the rollout has no labels
    print(f"class_count=4 (binary={binary}): max |value - onnxruntime logit| = {worst:.1e}")
    # class_count larger than the classes: every class, as Triton (min(k, K)).
    many = client.infer("tiny", [inp], outputs=[httpclient.InferRequestedOutput("logits", class_count=50)])
    assert many.as_numpy("logits").shape == (3, 10)


def test_unknown_output_parameters_and_bad_class_counts_answer_400(server, pixels):
    def post(outputs):
        request = {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [1, 3, 32, 48],
                               "data": pixels[:1].ravel().tolist()}], "outputs": outputs}
        return httpx.post(f"{server}/v2/models/tiny/infer", json=request, timeout=60)

    for params, message in [({"top_k": 3}, "unknown parameter 'top_k'"),
                            ({"shared_memory_region": "r"}, "unknown parameter 'shared_memory_region'"),
                            ({"classification": -1}, "classification must be a non-negative integer"),
                            ({"classification": "3"}, "classification must be a non-negative integer"),
                            ({"classification": 2.5}, "classification must be a non-negative integer"),
                            ({"binary_data": "yes"}, "binary_data must be true or false")]:
        r = post([{"name": "logits", "parameters": params}])
        assert r.status_code == 400, (params, r.text)
        assert message in r.json()["error"] and "'logits'" in r.json()["error"]
    r = post([{"name": "probs", "parameters": {"classification": 2}}])
    assert r.status_code == 400 and "unknown output 'probs'" in r.json()["error"]
    raw = post([{"name": "logits", "parameters": {"classification": 0}}])  # 0: the raw tensor, as Triton
    assert raw.status_code == 200 and raw.json()["outputs"][0]["datatype"] == "FP32"


def test_classification_without_labels_omits_the_label(tmp_path, randomize):
    model = randomize(vit_serve.create_model("Ti/16", depth=2, num_classes=6, img_size=RES), seed=3)
    assert model.labels is None
    ckpt = tmp_path / "nolabels.safetensors"
    vit_serve.save(model, ckpt)
    x = torch.randn(2, 3, *RES, generator=torch.Generator().manual_seed(0))
    request = {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": list(x.shape),
                           "data": x.flatten().tolist()}],
               "outputs": [{"name": "logits", "parameters": {"classification": 3}}]}

    async def scenario():
        async with serving(settings_for(ckpt, model_name="nolabels")) as (client, _):
            return await client.post("/v2/models/nolabels/infer", json=request)

    r = run(scenario())
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert (out["datatype"], out["shape"]) == ("BYTES", [2, 3])
    with torch.no_grad():
        ref = model(x).numpy()
    got = np.array(out["data"]).reshape(2, 3)
    for row, z in zip(got, ref, strict=True):
        parsed = _parse_classes(row)
        assert [(i, label) for _, i, label in parsed] == [(int(i), None) for i in np.argsort(-z)[:3]]
        np.testing.assert_allclose([v for v, _, _ in parsed], np.sort(z)[::-1][:3], atol=5e-6 + 1e-5)


@pytest.fixture(scope="module")
def triton(tiny_ckpt, tmp_path_factory):
    """A real tritonserver (nvidia-pytriton's) on the same checkpoint's `tiny_py` model (the exported ONNX in
    Triton's Python backend, labels.txt on its logits)."""
    import vit_export
    from vit_export.tritonserver import TritonServer, available

    reason = available()
    if reason:
        pytest.skip(f"no tritonserver here: {reason}")
    d = tmp_path_factory.mktemp("triton_classification")
    options = vit_export.ExportOptions(formats=("onnx", "triton"), out=d / "exports", repo=d / "repo", name="tiny")
    assert vit_export.export(tiny_ckpt, options).ok
    srv = TritonServer(d / "repo", models=["tiny_py"])
    srv.start(timeout=120)
    yield srv
    srv.close()


@pytest.mark.parametrize("binary", [True, False])
def test_class_count_matches_a_real_tritonserver(client, triton, pixels, binary):
    """The same request to Triton and to the gateway: the same classification strings."""
    reference = httpclient.InferenceServerClient(triton.http_address, network_timeout=60)
    try:
        answers = []
        for c, model in ((reference, "tiny_py"), (client, "tiny")):
            inp = httpclient.InferInput("pixel_values", list(pixels.shape), "FP32")
            inp.set_data_from_numpy(pixels, binary_data=binary)
            result = c.infer(model, [inp], outputs=[
                httpclient.InferRequestedOutput("logits", binary_data=binary, class_count=5)])
            out = result.get_response()["outputs"][0]
            answers.append((out["datatype"], out["shape"], result.as_numpy("logits")))
    finally:
        reference.close()
    (t_type, t_shape, theirs), (o_type, o_shape, ours) = answers
    assert (o_type, o_shape) == (t_type, t_shape) == ("BYTES", [3, 5])
    same = int((theirs == ours).sum())
    worst = 0.0
    for t_row, o_row in zip(theirs, ours, strict=True):
        t, o = _parse_classes(t_row), _parse_classes(o_row)
        assert [(i, label) for _, i, label in o] == [(i, label) for _, i, label in t]
        worst = max(worst, max(abs(a[0] - b[0]) for a, b in zip(t, o, strict=True)))
    print(f"class_count=5 (binary={binary}): {same}/15 strings byte-identical to Triton's, "
          f"max |value Δ| = {worst:.1e}")
    assert worst <= 2e-6  # both run onnxruntime on the same graph: at most a last-decimal difference


def test_not_ready_answers_503_with_the_kserve_body(tiny_onnx):
    """Before the lifespan has loaded anything: live, not ready (Triton's 503, KServe's {"ready": false})."""
    from vit_serve.serve.app import create_app

    app = create_app(settings_for(tiny_onnx))

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as c:
            return await c.get("/v2/health/live"), await c.get("/v2/health/ready"), await c.get("/v2/models/tiny/ready")

    live, ready, model = run(scenario())
    assert (live.status_code, live.json()) == (200, {"live": True})
    assert (ready.status_code, ready.json()) == (503, {"ready": False, "error": "the models are loading"})
    assert model.status_code == 503 and model.json() == {"error": "the models are loading"}
