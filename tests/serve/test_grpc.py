"""The Open Inference Protocol over gRPC (`vit_serve.serve.grpc`), spoken by Triton's own clients
(`tritonclient.grpc`, sync and aio, and the raw stubs it ships) and KServe's `InferenceGRPCClient` to a gateway
under a real uvicorn with its gRPC port on: health, metadata, inference with raw and typed tensors and with
encoded images as BYTES, the rollout, the classification extension, errors as status codes with the HTTP
routes' messages, the message-size limit with a 12 MP JPEG, the repository RPCs, and gRPC sharing the batcher
with HTTP. References: the same requests over HTTP (/v2 and /classify), and onnxruntime on the exported file
(the gateway's backend, run here directly)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import numpy as np
import pytest
from gateway_helpers import LABELS, RES, live_app, metric, settings_for
from PIL import Image

from vit_serve.preprocess import preprocess

grpcclient = pytest.importorskip("tritonclient.grpc")
import grpc  # noqa: E402
import tritonclient.grpc.aio as grpcaio  # noqa: E402
from tritonclient.grpc import service_pb2 as pb  # noqa: E402
from tritonclient.grpc import service_pb2_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

KSERVE_SCRIPT = Path(__file__).with_name("kserve_grpc_script.py")
TOL = 1e-5


class Live(NamedTuple):
    url: str  # HTTP base URL
    grpc: str  # gRPC host:port
    app: Any


@contextmanager
def live_gateway(settings) -> Iterator[Live]:
    """`live_app` (its lifespan starts the gRPC server on grpc_port=0, a free port): the HTTP and gRPC addresses
    and the app."""
    with live_app(settings) as (url, app):
        yield Live(url, app.state.grpc.address, app)


@pytest.fixture(scope="module")
def server(tiny_onnx) -> Iterator[Live]:
    """The tiny ONNX model (with its explain graph), gRPC on with the default message limit; no keys, and any
    caller may try the repository API (its own rules answer)."""
    with live_gateway(settings_for(tiny_onnx, grpc_port=0, allow_any_key_admin=True)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    c = grpcclient.InferenceServerClient(server.grpc)
    yield c
    c.close()


@pytest.fixture(scope="module")
def restricted(tiny_onnx) -> Iterator[Live]:
    """A second gateway: 1 MiB gRPC messages, no repository API, and batches of 2 that wait up to 5 s to fill."""
    settings = settings_for(tiny_onnx, grpc_port=0, grpc_max_message_bytes=2**20, repository_api=False,
                            max_batch=2, max_delay_ms=5000)
    with live_gateway(settings) as live:
        yield live


def _input(name: str, datatype: str, array: np.ndarray):
    inp = grpcclient.InferInput(name, list(array.shape), datatype)
    inp.set_data_from_numpy(array)
    return inp


def _images(items: list[bytes]) -> np.ndarray:
    return np.array(items, dtype=np.object_)


def _http_infer(url: str, body: dict) -> dict:
    r = httpx.post(f"{url}/v2/models/tiny/infer", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return {o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"]) for o in r.json()["outputs"]}


def _http_pixels(pixels: np.ndarray) -> dict:
    return {"name": "pixel_values", "datatype": "FP32", "shape": list(pixels.shape), "data": pixels.ravel().tolist()}


def _code(e: InferenceServerException) -> str:
    return str(e.status()).removeprefix("StatusCode.")


# ---- health and metadata -------------------------------------------------------------------------------------


def test_health_and_metadata_equal_http(server, client):
    url = server.url
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("tiny") and client.is_model_ready("tiny", "1")
    meta = client.get_model_metadata("tiny", as_json=True)
    http = httpx.get(f"{url}/v2/models/tiny").json()
    for key in ("name", "versions", "platform"):
        assert meta[key] == http[key]
    shapes = {t["name"]: (t["datatype"], [int(d) for d in t["shape"]]) for t in meta["inputs"] + meta["outputs"]}
    assert shapes == {t["name"]: (t["datatype"], t["shape"]) for t in http["inputs"] + http["outputs"]}
    assert shapes == {"pixel_values": ("FP32", [-1, 3, *RES]), "image": ("BYTES", [-1]), "logits": ("FP32", [-1, 10]),
                      "rollout": ("FP32", [-1, 2, 3])}
    server_meta = client.get_server_metadata(as_json=True)
    assert server_meta["name"] == "vit-serve" and server_meta["extensions"] == httpx.get(f"{url}/v2").json()[
        "extensions"]
    with pytest.raises(InferenceServerException) as e:
        client.is_model_ready("other")
    assert _code(e.value) == "NOT_FOUND" and "unknown model 'other'" in e.value.message()


def test_aio_client_health_metadata_and_infer(server, backend, pixels):
    async def scenario():
        async with grpcaio.InferenceServerClient(server.grpc) as c:
            live, ready, model_ready = await c.is_server_live(), await c.is_server_ready(), await c.is_model_ready(
                "tiny")
            meta = await c.get_model_metadata("tiny", as_json=True)
            inp = grpcaio.InferInput("pixel_values", list(pixels.shape), "FP32")
            inp.set_data_from_numpy(pixels)
            result = await c.infer("tiny", [inp], outputs=[grpcaio.InferRequestedOutput("logits")])
            try:
                await c.get_model_metadata("other")
                error = None
            except InferenceServerException as e:
                error = e
            return live, ready, model_ready, meta, result, error

    live, ready, model_ready, meta, result, error = asyncio.run(scenario())
    assert live and ready and model_ready and meta["name"] == "tiny"
    err = float(np.abs(result.as_numpy("logits") - backend.classify(pixels)).max())
    print(f"tritonclient.grpc.aio: max |Δ logit| vs onnxruntime = {err:.2e}")
    assert err <= TOL
    assert error is not None and _code(error) == "NOT_FOUND" and "unknown model 'other'" in error.message()


# ---- inference -------------------------------------------------------------------------------------------------


def test_infer_pixel_values_equals_http_and_onnxruntime(server, client, backend, pixels):
    url, address = server.url, server.grpc
    result = client.infer("tiny", [_input("pixel_values", "FP32", pixels)],
                          outputs=[grpcclient.InferRequestedOutput("logits")], request_id="r1")
    response = result.get_response()
    assert (response.model_name, response.model_version, response.id) == ("tiny", "1", "r1")
    logits = result.as_numpy("logits")
    http = _http_infer(url, {"inputs": [_http_pixels(pixels)], "outputs": [{"name": "logits"}]})["logits"]
    ref = backend.classify(pixels)
    # Typed contents (fp32_contents) instead of raw_input_contents, through the stubs tritonclient ships.
    with grpc.insecure_channel(address) as channel:
        request = pb.ModelInferRequest(model_name="tiny", model_version="1")
        tensor = request.inputs.add(name="pixel_values", datatype="FP32", shape=list(pixels.shape))
        tensor.contents.fp32_contents.extend(pixels.ravel().tolist())
        request.outputs.add(name="logits")
        typed = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
    typed_logits = np.frombuffer(typed.raw_output_contents[0], "<f4").reshape(list(typed.outputs[0].shape))
    print(f"gRPC raw vs HTTP /v2: max |Δ logit| = {float(np.abs(logits - http).max()):.2e}; vs onnxruntime "
          f"{float(np.abs(logits - ref).max()):.2e}; typed vs raw {float(np.abs(typed_logits - logits).max()):.2e}")
    assert logits.shape == (3, 10)
    np.testing.assert_array_equal(logits, http)  # the same backend, batch and bytes: bit for bit
    np.testing.assert_allclose(logits, ref, atol=TOL, rtol=0)
    np.testing.assert_array_equal(typed_logits, logits)


def test_infer_images_as_bytes_equals_classify_scores(server, client, photos):
    url = server.url
    result = client.infer("tiny", [_input("image", "BYTES", _images(list(photos.values())))],
                          outputs=[grpcclient.InferRequestedOutput("logits"),
                                   grpcclient.InferRequestedOutput("logits", class_count=3)])
    logits = result.as_numpy("logits")
    assert logits.shape == (3, 10)
    for row, (name, data) in zip(logits, photos.items(), strict=True):
        got = httpx.post(f"{url}/classify?top_k=10", files={"file": (name, data)}, timeout=60).json()
        scores = np.zeros(10)
        for p in got["predictions"]:
            scores[p["index"]] = p["score"]
        z = row.astype(np.float64)
        softmax = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        print(f"{name}: max |Δ score| gRPC image vs POST /classify = {np.abs(softmax - scores).max():.2e}")
        np.testing.assert_allclose(softmax, scores, atol=1e-6, rtol=0)


def test_classification_extension(client, pixels, backend):
    result = client.infer("tiny", [_input("pixel_values", "FP32", pixels)],
                          outputs=[grpcclient.InferRequestedOutput("logits", class_count=3)])
    classes = result.as_numpy("logits")
    assert classes.shape == (3, 3)
    for row, ref in zip(classes, backend.classify(pixels), strict=True):
        order = np.argsort(-ref, kind="stable")[:3]
        parsed = [entry.decode().split(":") for entry in row]  # Triton's "value:index:label"
        assert [(int(i), label) for _, i, label in parsed] == [(int(i), LABELS[i]) for i in order]
        np.testing.assert_allclose([float(v) for v, _, _ in parsed], ref[order], atol=5e-6 + TOL)


def test_rollout_equals_onnxruntime_and_its_parameters_are_read(server, client, backend, pixels):
    """The ONNX explain graph has its rollout settings built in: the same ones are accepted, others refused with
    the HTTP route's message (tuned settings on the torch backend: the repository test)."""
    url = server.url
    every = client.infer("tiny", [_input("pixel_values", "FP32", pixels)])  # no outputs named: all of them
    logits, heat = backend.explain(pixels)
    assert {o.name for o in every.get_response().outputs} == {"logits", "rollout"}
    print(f"rollout: max |Δ| gRPC vs onnxruntime = {float(np.abs(every.as_numpy('rollout') - heat).max()):.2e}")
    np.testing.assert_allclose(every.as_numpy("rollout"), heat, atol=1e-6, rtol=0)
    np.testing.assert_allclose(every.as_numpy("logits"), logits, atol=TOL, rtol=0)
    same = client.infer("tiny", [_input("pixel_values", "FP32", pixels)], outputs=[
        grpcclient.InferRequestedOutput("rollout")], parameters={"head_fusion": "mean", "discard_ratio": 0.9})
    np.testing.assert_array_equal(same.as_numpy("rollout"), every.as_numpy("rollout"))
    other = {"head_fusion": "max", "discard_ratio": 0.5}
    error = _grpc_error(client, "tiny", [_input("pixel_values", "FP32", pixels)], parameters=other,
                        outputs=[grpcclient.InferRequestedOutput("rollout")])
    http = httpx.post(f"{url}/v2/models/tiny/infer", json={"inputs": [_http_pixels(pixels)], "parameters": other,
                                                          "outputs": [{"name": "rollout"}]}, timeout=60)
    assert _code(error) == "INVALID_ARGUMENT" and error.message() == http.json()["error"]
    assert "head_fusion=max, discard_ratio=0.5" in error.message()


# ---- errors ----------------------------------------------------------------------------------------------------


def _grpc_error(client, *args, **kw) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as e:
        client.infer(*args, **kw)
    return e.value


def test_errors_are_status_codes_with_the_http_messages(server, client, pixels):
    url, address = server.url, server.grpc
    bad = pixels[:, :, :16]
    cases = {
        "unknown model": ("NOT_FOUND", ("other", [_input("pixel_values", "FP32", pixels)]), {}, "other", None),
        "unknown version": ("NOT_FOUND", ("tiny", [_input("pixel_values", "FP32", pixels)]), {"model_version": "7"},
                            "tiny", "7"),
        "bad shape": ("INVALID_ARGUMENT", ("tiny", [_input("pixel_values", "FP32", bad)]), {}, "tiny", None),
        "not an image": ("INVALID_ARGUMENT", ("tiny", [_input("image", "BYTES", _images([b"not an image"]))]), {},
                         "tiny", None),
        "unknown output": ("INVALID_ARGUMENT", ("tiny", [_input("pixel_values", "FP32", pixels)]),
                           {"outputs": [grpcclient.InferRequestedOutput("probs")]}, "tiny", None),
        "bad discard_ratio": ("INVALID_ARGUMENT", ("tiny", [_input("pixel_values", "FP32", pixels)]),
                              {"parameters": {"discard_ratio": 2.0}}, "tiny", None),
    }
    http_bodies = {
        "unknown model": {"inputs": [_http_pixels(pixels)]},
        "unknown version": {"inputs": [_http_pixels(pixels)]},
        "bad shape": {"inputs": [_http_pixels(bad)]},
        "not an image": {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                                     "data": [_b64(b"not an image")]}]},
        "unknown output": {"inputs": [_http_pixels(pixels)], "outputs": [{"name": "probs"}]},
        "bad discard_ratio": {"inputs": [_http_pixels(pixels)], "parameters": {"discard_ratio": 2.0}},
    }
    for case, (code, args, kw, model, version) in cases.items():
        error = _grpc_error(client, *args, **kw)
        path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
        http = httpx.post(url + path, json=http_bodies[case], timeout=60)
        print(f"{case}: {_code(error)} {error.message()!r} (HTTP {http.status_code})")
        assert _code(error) == code, case
        assert error.message() == http.json()["error"], case
    # Two inputs at once, and an RPC this gateway does not serve: clear codes, no traceback.
    both = _grpc_error(client, "tiny", [_input("pixel_values", "FP32", pixels), _input("image", "BYTES",
                                                                                       _images([b"x"]))])
    assert _code(both) == "INVALID_ARGUMENT" and "send exactly one input" in both.message()
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as e:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(pb.ModelStatisticsRequest(name="tiny"),
                                                                           timeout=30)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "Traceback" not in (e.value.details() or "")


# ---- message size ----------------------------------------------------------------------------------------------


def test_a_12_megapixel_jpeg_fits_the_default_limit(client, backend, phone_jpeg):
    width, height = Image.open(io.BytesIO(phone_jpeg)).size
    print(f"12 MP JPEG: {width}x{height}, {len(phone_jpeg) / 2**20:.1f} MiB (gRPC's own default limit: 4 MiB)")
    assert width * height >= 12_000_000 and len(phone_jpeg) > 4 * 2**20  # over gRPC's default
    logits = client.infer("tiny", [_input("image", "BYTES", _images([phone_jpeg]))],
                          outputs=[grpcclient.InferRequestedOutput("logits")]).as_numpy("logits")
    ref = backend.classify(preprocess(phone_jpeg, backend.info.preprocess)[None].numpy())
    np.testing.assert_allclose(logits, ref, atol=TOL, rtol=0)


def test_a_message_over_the_configured_limit_is_resource_exhausted(restricted, phone_jpeg, pixels):
    c = grpcclient.InferenceServerClient(restricted.grpc)
    try:
        error = _grpc_error(c, "tiny", [_input("image", "BYTES", _images([phone_jpeg]))])
        print(f"{len(phone_jpeg)} bytes against a 1 MiB limit: {_code(error)} {error.message()!r}")
        assert _code(error) == "RESOURCE_EXHAUSTED"
        assert c.is_server_live()  # still serving
    finally:
        c.close()


# ---- the batcher -----------------------------------------------------------------------------------------------


def test_grpc_and_http_requests_share_batches(restricted, pixels, backend):
    """max_batch 2 with a 5 s window. An HTTP request whose body is still arriving (announced to the batcher, as
    every request is while it is read) keeps the batch open; a gRPC request queued meanwhile joins it: one batch
    of 2 images, each answer equal to onnxruntime's."""
    url, address = restricted.url, restricted.grpc
    runner = restricted.app.state.gateway.model("tiny").runner
    text = httpx.get(f"{url}/metrics").text
    before = (metric(text, "vit_serve_batch_size_count", model="tiny"),
              metric(text, "vit_serve_batch_size_sum", model="tiny"))
    body = json.dumps({"inputs": [_http_pixels(pixels[1:2])], "outputs": [{"name": "logits"}]}).encode()
    release = threading.Event()

    def slow_body() -> Iterator[bytes]:
        yield body[:100]
        release.wait(30)
        yield body[100:]

    c = grpcclient.InferenceServerClient(address)
    try:
        with ThreadPoolExecutor(2) as pool:
            over_http = pool.submit(httpx.post, f"{url}/v2/models/tiny/infer", content=slow_body(), timeout=60,
                                    headers={"Content-Type": "application/json"})
            deadline = time.monotonic() + 30
            while runner.incoming < 1 and time.monotonic() < deadline:  # the HTTP request is being read
                time.sleep(0.01)
            over_grpc = pool.submit(c.infer, "tiny", [_input("pixel_values", "FP32", pixels[:1])],
                                    outputs=[grpcclient.InferRequestedOutput("logits")])
            while runner.depth < 1 and time.monotonic() < deadline:  # the gRPC request is queued
                time.sleep(0.01)
            release.set()
            grpc_logits = over_grpc.result(60).as_numpy("logits")
            response = over_http.result(60)
    finally:
        release.set()
        c.close()
    assert response.status_code == 200, response.text
    http_logits = np.asarray(response.json()["outputs"][0]["data"], np.float32).reshape(1, 10)
    text = httpx.get(f"{url}/metrics").text
    batches = metric(text, "vit_serve_batch_size_count", model="tiny") - before[0]
    images = metric(text, "vit_serve_batch_size_sum", model="tiny") - before[1]
    print(f"one gRPC + one HTTP request: {batches:.0f} batch(es) of {images:.0f} image(s)")
    assert (batches, images) == (1, 2)
    np.testing.assert_allclose(np.concatenate([grpc_logits, http_logits]), backend.classify(pixels[:2]), atol=TOL,
                               rtol=0)


# ---- the repository RPCs ---------------------------------------------------------------------------------------


def test_repository_rpcs_with_explicit_model_control(tmp_path, tiny_onnx, tiny_ckpt, pixels, backend):
    for f in tiny_onnx.parent.glob(f"{tiny_onnx.stem}*"):
        shutil.copy(f, tmp_path / f.name)
    shutil.copy(tiny_ckpt, tmp_path / "other.safetensors")
    settings = settings_for(tmp_path, grpc_port=0, model_control="explicit", load_models=["tiny"],
                            default_model="tiny", allow_any_key_admin=True)
    with live_gateway(settings) as live:
        url, address = live.url, live.grpc
        c = grpcclient.InferenceServerClient(address)
        try:
            index = c.get_model_repository_index(as_json=True)["models"]
            http = httpx.post(f"{url}/v2/repository/index", timeout=30).json()
            assert [(m["name"], m.get("version"), m.get("state")) for m in index] == [
                (m["name"], m.get("version"), m.get("state")) for m in http]
            assert {m["name"]: m.get("state") for m in index} == {"tiny": "READY", "other": None}
            c.load_model("other")
            assert c.is_model_ready("other")
            logits = c.infer("other", [_input("pixel_values", "FP32", pixels)]).as_numpy("logits")
            np.testing.assert_allclose(logits, backend.classify(pixels), atol=1e-4, rtol=0)  # torch vs onnxruntime
            # The torch backend computes any rollout setting: the request parameters reach it as over HTTP.
            params = {"head_fusion": "max", "discard_ratio": 0.5}
            tuned = c.infer("other", [_input("pixel_values", "FP32", pixels)], parameters=params,
                            outputs=[grpcclient.InferRequestedOutput("rollout")]).as_numpy("rollout")
            r = httpx.post(f"{url}/v2/models/other/infer", json={"inputs": [_http_pixels(pixels)], "parameters": params,
                                                                 "outputs": [{"name": "rollout"}]}, timeout=60)
            http = next(o for o in r.json()["outputs"] if o["name"] == "rollout")
            default = c.infer("other", [_input("pixel_values", "FP32", pixels)],
                              outputs=[grpcclient.InferRequestedOutput("rollout")]).as_numpy("rollout")
            print(f"torch rollout (max, 0.5): max |Δ| gRPC vs HTTP = "
                  f"{float(np.abs(tuned - np.reshape(http['data'], http['shape'])).max()):.2e}")
            np.testing.assert_allclose(tuned, np.reshape(http["data"], http["shape"]), atol=1e-6, rtol=0)
            assert tuned.shape == (3, 2, 3) and not np.allclose(tuned, default)
            c.unload_model("other")
            assert not c.is_model_ready("other")
            with pytest.raises(InferenceServerException) as e:
                c.load_model("nope")
            assert _code(e.value) == "INVALID_ARGUMENT" and "failed to load 'nope'" in e.value.message()
        finally:
            c.close()


def test_repository_rules_load_needs_explicit_and_the_api_can_be_off(client, restricted):
    with pytest.raises(InferenceServerException) as e:
        client.load_model("tiny")
    assert _code(e.value) == "INVALID_ARGUMENT" and "--model-control explicit" in e.value.message()
    c = grpcclient.InferenceServerClient(restricted.grpc)
    try:
        for call in (c.get_model_repository_index, lambda: c.load_model("tiny"), lambda: c.unload_model("tiny")):
            with pytest.raises(InferenceServerException) as e:
                call()
            assert _code(e.value) == "PERMISSION_DENIED" and "repository API is turned off" in e.value.message()
    finally:
        c.close()


# ---- KServe's SDK ----------------------------------------------------------------------------------------------


def test_kserve_grpc_client_gets_the_http_logits(kserve_python, server, backend, pixels, photos, tmp_path):
    python = kserve_python
    url, address = server.url, server.grpc
    np.save(tmp_path / "pixels.npy", pixels)
    for i, data in enumerate(photos.values()):
        (tmp_path / f"image_{i}.bin").write_bytes(data)
    done = subprocess.run([python, str(KSERVE_SCRIPT), address, "tiny", str(tmp_path)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    for key in ("server_live", "server_ready", "model_ready"):
        assert got[key] is True, (key, got[key])
    references = {
        "raw": _http_infer(url, {"inputs": [_http_pixels(pixels)], "outputs": [{"name": "logits"}]})["logits"],
        "images": _http_infer(url, {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [len(photos)],
                                                "data": [_b64(d) for d in photos.values()]}],
                                    "outputs": [{"name": "logits"}]})["logits"],
    }
    references["typed"] = references["raw"]
    for case, ref in references.items():
        out = got[case]
        assert "exception" not in out, (case, out)
        logits = np.asarray(out["logits"]["data"], np.float32).reshape(out["logits"]["shape"])
        err = float(np.abs(logits - ref).max())
        print(f"KServe InferenceGRPCClient, {case}: max |Δ logit| vs HTTP /v2 = {err:.2e}")
        assert logits.shape == (3, 10)
        np.testing.assert_allclose(logits, ref, atol=TOL, rtol=0)
    assert got["unknown_model"]["code"] == "NOT_FOUND" and "unknown model 'other'" in got["unknown_model"]["details"]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# ---- lifecycle -------------------------------------------------------------------------------------------------


def test_every_gateway_error_has_a_grpc_code():
    from vit_serve.serve import errors
    from vit_serve.serve.errors import grpc_status_code as status_code

    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.GatewayError)]
    codes = {c.__name__: status_code(c.status) for c in classes}
    print(codes)
    assert len(codes) >= 10
    assert all(code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.OK)
               for code in codes.values())
    assert codes["TooLargeError"] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert codes["GatewayTimeoutError"] == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_grpc_port_in_use_stops_the_start_with_one_line(tiny_onnx, caplog):
    from vit_serve.serve.app import create_app

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    app = create_app(settings_for(tiny_onnx, grpc_port=port))

    async def start() -> None:
        async with app.router.lifespan_context(app):
            pass

    try:
        with pytest.raises(OSError, match=f"cannot serve gRPC on 127.0.0.1:{port}"):
            asyncio.run(start())
    finally:
        taken.close()
    lines = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any(f"cannot serve gRPC on 127.0.0.1:{port}" in line and "\n" not in line for line in lines), lines


def test_api_keys_as_metadata_over_tls(tiny_onnx, tmp_path, pixels, backend):
    """API keys (probes open) and TLS with a self-signed certificate made here by openssl; tritonclient sends the
    key as metadata and checks the certificate."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed (needed to make the test certificate)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    settings = settings_for(tiny_onnx, grpc_port=0, api_keys=["user-key"], admin_api_keys=["admin-key"],
                            ssl_certfile=str(cert), ssl_keyfile=str(key))
    with live_gateway(settings) as live:
        c = grpcclient.InferenceServerClient(live.grpc, ssl=True, root_certificates=str(cert))
        try:
            assert c.is_server_live() and c.is_model_ready("tiny")  # probes need no key
            no_key = _grpc_error(c, "tiny", [_input("pixel_values", "FP32", pixels)])
            wrong = _grpc_error(c, "tiny", [_input("pixel_values", "FP32", pixels)], headers={"x-api-key": "nope"})
            logits = c.infer("tiny", [_input("pixel_values", "FP32", pixels)], headers={
                "authorization": "Bearer user-key"}, outputs=[grpcclient.InferRequestedOutput("logits")])
            with pytest.raises(InferenceServerException) as user_load:
                c.load_model("tiny", headers={"x-api-key": "user-key"})
            with pytest.raises(InferenceServerException) as admin_load:
                c.load_model("tiny", headers={"x-api-key": "admin-key"})
        finally:
            c.close()
        plain = grpcclient.InferenceServerClient(live.grpc)
        try:
            with pytest.raises(InferenceServerException) as e:
                plain.is_server_live()
            assert _code(e.value) == "UNAVAILABLE"  # no TLS handshake, no answer
        finally:
            plain.close()
    print(f"no key: {_code(no_key)} {no_key.message()!r}; wrong key: {_code(wrong)}; user key load: "
          f"{_code(user_load.value)}; admin key load: {_code(admin_load.value)} {admin_load.value.message()!r}")
    assert _code(no_key) == "UNAUTHENTICATED" and "an API key is needed" in no_key.message()
    assert _code(wrong) == "UNAUTHENTICATED" and "not valid" in wrong.message()
    np.testing.assert_allclose(logits.as_numpy("logits"), backend.classify(pixels), atol=TOL, rtol=0)
    assert _code(user_load.value) == "PERMISSION_DENIED" and "admin key" in user_load.value.message()
    # The admin key gets past the key check: the repository's own rule answers (model control is not explicit).
    assert _code(admin_load.value) == "INVALID_ARGUMENT" and "--model-control explicit" in admin_load.value.message()


def test_overflowing_shapes_and_lying_counts_are_invalid_argument(server):
    """Shapes whose element count overflows int64 ([2**32, 2**32] wraps to 0 in numpy), more dimensions than
    numpy allows, and typed contents whose count disagrees with the shape: INVALID_ARGUMENT with a message, the
    same as the HTTP route's, never INTERNAL."""
    cases = []
    for datatype, name in (("FP32", "pixel_values"), ("BYTES", "image")):
        request = pb.ModelInferRequest(model_name="tiny")
        request.inputs.add(name=name, datatype=datatype, shape=[2**32, 2**32])
        request.raw_input_contents.append(b"")
        cases.append((f"{datatype} [2**32, 2**32] raw", request))
        typed = pb.ModelInferRequest(model_name="tiny")
        typed.inputs.add(name=name, datatype=datatype, shape=[2**32, 2**32])
        cases.append((f"{datatype} [2**32, 2**32] typed", typed))
    deep = pb.ModelInferRequest(model_name="tiny")
    deep.inputs.add(name="pixel_values", datatype="FP32", shape=[1] * 100).contents.fp32_contents.append(1.0)
    cases.append(("100 dimensions", deep))
    lying = pb.ModelInferRequest(model_name="tiny")
    lying.inputs.add(name="image", datatype="BYTES", shape=[1]).contents.bytes_contents.extend([b"x"] * 3000)
    cases.append(("3000 contents for shape [1]", lying))
    with grpc.insecure_channel(server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for case, request in cases:
            with pytest.raises(grpc.RpcError) as e:
                stub.ModelInfer(request, timeout=30)
            print(f"{case}: {e.value.code()} {e.value.details()!r}")
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, e.value.details())
            assert "Traceback" not in e.value.details() and "internal error" not in e.value.details()
