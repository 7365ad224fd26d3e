"""Bounded inference requests: a limit on the images one /v2 or gRPC request may carry (default: the model's
max_batch; `max_images_per_request`), checked from the tensor's header before anything is decoded, over HTTP JSON
(plain and gzip), HTTP binary tensors (tritonclient.http) and gRPC (tritonclient.grpc), against a real uvicorn;
a request allowed above max_batch runs as max_batch-sized batches; one failing image stops its siblings' decodes.
References: onnxruntime on the export (the backend run directly), the gateway's own /metrics batch histogram,
and this process's /proc/self/status for memory (the server runs in this process)."""

from __future__ import annotations

import base64
import gzip
import io
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from gateway_helpers import live_app, metric, run, serving, settings_for
from PIL import Image

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
import grpc  # noqa: E402
from tritonclient.grpc import service_pb2 as pb  # noqa: E402
from tritonclient.grpc import service_pb2_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

LIMIT_SETTING = "VIT_SERVE_MAX_IMAGES_PER_REQUEST"
TOL = 1e-5


def _pbm() -> bytes:
    """A 1x1 black-and-white PBM as Pillow writes it (a few bytes)."""
    buf = io.BytesIO()
    Image.new("1", (1, 1)).save(buf, format="PPM")
    return buf.getvalue()


def _rss_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return next(int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmRSS")) / 1024


def _bytes_input(items: list[bytes]) -> dict:
    return {"name": "image", "datatype": "BYTES", "shape": [len(items)],
            "data": [base64.b64encode(b).decode() for b in items]}


@pytest.fixture(scope="module")
def gateway(tiny_onnx):
    """The tiny export with the default settings (max_batch 16: at most 16 images a request), gRPC on."""
    with live_app(settings_for(tiny_onnx, grpc_port=0)) as (url, app):
        yield url, app.state.grpc.address


def test_3000_tiny_images_in_a_48_kb_body_are_refused_before_any_decode(gateway, backend, photos):
    """The measured attack: 3,000 copies of a 1x1 PBM in one JSON body (and its gzip form, 500x smaller)
    answer 400 naming the limit and its setting, and the process's RSS does not grow by more than 200 MB."""
    url, _ = gateway
    body = json.dumps({"inputs": [_bytes_input([_pbm()] * 3000)], "outputs": [{"name": "logits"}]}).encode()
    packed = gzip.compress(body)
    print(f"body {len(body)} bytes, gzip {len(packed)} bytes")
    before = _rss_mb()
    plain = httpx.post(f"{url}/v2/models/tiny/infer", content=body, timeout=120,
                       headers={"Content-Type": "application/json"})
    zipped = httpx.post(f"{url}/v2/models/tiny/infer", content=packed, timeout=120,
                        headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    grown = _rss_mb() - before
    print(f"plain: {plain.status_code} {plain.text[:200]}; gzip: {zipped.status_code}; RSS grew {grown:.0f} MB")
    for r in (plain, zipped):
        assert r.status_code == 400, r.text
        message = r.json()["error"]
        assert "3000" in message and "limit of 16" in message and LIMIT_SETTING in message
    assert grown < 200
    # At the limit the same request answers, equal to onnxruntime on the photos decoded one by one.
    items = list(photos.values()) * 6
    r = httpx.post(f"{url}/v2/models/tiny/infer", json={"inputs": [_bytes_input(items[:16])],
                                                        "outputs": [{"name": "logits"}]}, timeout=120)
    assert r.status_code == 200, r.text
    logits = np.asarray(r.json()["outputs"][0]["data"], np.float32).reshape(16, 10)
    want = backend.classify(np.concatenate([_pixels(backend, b) for b in items[:16]]))
    np.testing.assert_allclose(logits, want, atol=TOL, rtol=0)


def _pixels(backend, data: bytes) -> np.ndarray:
    from vit_serve.preprocess import preprocess

    return preprocess(data, backend.info.preprocess).numpy()[None]


def test_binary_tensors_over_the_limit_are_refused_from_their_header(gateway, pixels):
    """tritonclient.http with binary tensors: 17 encoded images, or pixel_values of 17 rows, are 400 naming the
    limit; so are the same over JSON with no data at all (the header alone decides)."""
    url, _ = gateway
    client = httpclient.InferenceServerClient(url.removeprefix("http://"), network_timeout=60)
    try:
        images = httpclient.InferInput("image", [17], "BYTES")
        images.set_data_from_numpy(np.array([_pbm()] * 17, dtype=np.object_), binary_data=True)
        rows = np.repeat(pixels[:1], 17, axis=0)
        values = httpclient.InferInput("pixel_values", list(rows.shape), "FP32")
        values.set_data_from_numpy(rows, binary_data=True)
        for inp in (images, values):
            with pytest.raises(InferenceServerException, match=f"17 images.*limit of 16.*{LIMIT_SETTING}"):
                client.infer("tiny", [inp])
    finally:
        client.close()
    for spec in ({"name": "image", "datatype": "BYTES", "shape": [17]},
                 {"name": "pixel_values", "datatype": "FP32", "shape": [17, 3, 32, 48]}):
        r = httpx.post(f"{url}/v2/models/tiny/infer", json={"inputs": [spec]}, timeout=60)
        assert r.status_code == 400 and "limit of 16" in r.json()["error"], r.text


def test_grpc_over_the_limit_is_invalid_argument_naming_it(gateway, pixels):
    """tritonclient.grpc: raw and typed BYTES of 17 images, and pixel_values of 17 rows: INVALID_ARGUMENT with
    the limit and its setting."""
    _, address = gateway
    client = grpcclient.InferenceServerClient(address)
    try:
        raw = grpcclient.InferInput("image", [17], "BYTES")
        raw.set_data_from_numpy(np.array([_pbm()] * 17, dtype=np.object_))
        rows = np.repeat(pixels[:1], 17, axis=0)
        values = grpcclient.InferInput("pixel_values", list(rows.shape), "FP32")
        values.set_data_from_numpy(rows)
        for inp in (raw, values):
            with pytest.raises(InferenceServerException) as e:
                client.infer("tiny", [inp])
            assert str(e.value.status()) == "StatusCode.INVALID_ARGUMENT"
            assert "17 images" in e.value.message() and "limit of 16" in e.value.message()
            assert LIMIT_SETTING in e.value.message()
    finally:
        client.close()
    typed = pb.ModelInferRequest(model_name="tiny")
    typed.inputs.add(name="image", datatype="BYTES", shape=[17]).contents.bytes_contents.extend([_pbm()] * 17)
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as e:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(typed, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit of 16" in e.value.details()


def test_a_limit_above_max_batch_runs_the_request_as_max_batch_sized_batches(tiny_onnx, backend, pixels, photos):
    """max_batch 4, max_images_per_request 10: 10 rows of pixel_values (and 10 encoded images) answer the
    backend's logits in batches of at most 4 (the /metrics histogram: 3 batches, 10 images, none over 4);
    11 are 400 naming the limit of 10."""
    settings = settings_for(tiny_onnx, max_batch=4, max_images_per_request=10)
    rows = np.concatenate([pixels] * 4)[:10]
    items = (list(photos.values()) * 4)[:10]
    with live_app(settings) as (url, _):
        for inp in ({"name": "pixel_values", "datatype": "FP32", "shape": list(rows.shape),
                     "data": rows.ravel().tolist()}, _bytes_input(items)):
            text = httpx.get(f"{url}/metrics").text
            before = [metric(text, name, model="tiny") for name in ("vit_serve_batch_size_count",
                                                                     "vit_serve_batch_size_sum")]
            before_le4 = metric(text, "vit_serve_batch_size_bucket", model="tiny", le="4.0")
            r = httpx.post(f"{url}/v2/models/tiny/infer", json={"inputs": [inp], "outputs": [{"name": "logits"}]},
                           timeout=120)
            assert r.status_code == 200, r.text
            logits = np.asarray(r.json()["outputs"][0]["data"], np.float32).reshape(10, 10)
            np.testing.assert_allclose(logits, backend.classify(rows), atol=TOL, rtol=0)
            text = httpx.get(f"{url}/metrics").text
            batches, images = (metric(text, name, model="tiny") - b for name, b in zip(
                ("vit_serve_batch_size_count", "vit_serve_batch_size_sum"), before, strict=True))
            at_most_4 = metric(text, "vit_serve_batch_size_bucket", model="tiny", le="4.0") - before_le4
            print(f"{inp['name']}: {batches:.0f} batches, {images:.0f} images, {at_most_4:.0f} of at most 4")
            assert (batches, images, at_most_4) == (3, 10, 3)
        r = httpx.post(f"{url}/v2/models/tiny/infer", json={"inputs": [_bytes_input(items + items[:1])]},
                       timeout=60)
        assert r.status_code == 400 and "limit of 10" in r.json()["error"], r.text


def test_one_bad_image_stops_its_siblings_decodes(tiny_onnx, photos, monkeypatch):
    """A request of a corrupt image followed by 7 good ones, on one decode thread: 400 for the corrupt one, and
    the good ones are never decoded (the decode function, counted where the gateway calls it, ran once; a good
    request of 8 runs it 8 times)."""
    from vit_serve.runtime import decode as model_version  # where the gateway's decode function lives

    calls: list[int] = []
    real = model_version.decode

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(model_version, "decode", counted)
    good = list(photos.values()) * 3

    async def scenario():
        async with serving(settings_for(tiny_onnx, decode_workers=1)) as (client, _):
            bad = await client.post("/v2/models/tiny/infer", json={"inputs": [_bytes_input([b"not an image",
                                                                                             *good[:7]])]})
            n_bad = len(calls)
            ok = await client.post("/v2/models/tiny/infer", json={"inputs": [_bytes_input(good[:8])]})
            return bad, n_bad, ok, len(calls) - n_bad

    bad, n_bad, ok, n_ok = run(scenario())
    print(f"bad request: {bad.status_code} after {n_bad} decode(s); good request: {n_ok} decodes")
    assert bad.status_code in (400, 415, 422) and "not an image" in bad.json()["error"]
    assert ok.status_code == 200 and n_ok == 8
    assert n_bad == 1


def test_the_setting_is_a_serve_flag_and_a_variable(monkeypatch):
    from vit_serve.cli import build_parser
    from vit_serve.serve.settings import ServeSettings

    args = build_parser().parse_args(["serve", "model.onnx", "--max-images-per-request", "64"])
    assert args.max_images_per_request == 64
    monkeypatch.setenv(LIMIT_SETTING, "32")
    assert ServeSettings().limits.max_images_per_request == 32
    monkeypatch.delenv(LIMIT_SETTING)
    assert ServeSettings().limits.max_images_per_request == 0  # the model's max_batch
