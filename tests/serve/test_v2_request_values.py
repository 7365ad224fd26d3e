"""Values of a /v2 inference request the schema allows but the gateway must bound, against the gateway under a real
uvicorn: `parameters.priority` beyond `VIT_SERVE_PRIORITY_LEVELS` is 422 (on the torch backend and with
`--backend triton` in front of a real tritonserver, where it once went through to Triton: a 500), within them it
is answered; FP64 (and FP16) `pixel_values` beyond float32's range, and NaN / inf in them, are 400 naming the
input."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from gateway_helpers import live_app, live_server, settings_for

from vit_serve.serve.settings import ServeSettings

LEVELS = 4


def _pixels(res: tuple[int, int], datatype: str = "FP32", value: float = 0.25) -> dict:
    h, w = res
    return {"name": "pixel_values", "datatype": datatype, "shape": [1, 3, h, w], "data": [value] * (3 * h * w)}


def _post(url: str, model: str, body: dict) -> httpx.Response:
    # json.dumps writes NaN / Infinity, which strict JSON encoders refuse to
    return httpx.post(f"{url}/v2/models/{model}/infer", content=json.dumps(body), timeout=60,
                      headers={"Content-Type": "application/json"})


@pytest.fixture(scope="module")
def live(tiny_ckpt) -> Iterator[tuple[str, str]]:
    """The gateway on the torch backend: (base URL, gRPC address)."""
    with live_app(settings_for(tiny_ckpt, priority_levels=LEVELS, grpc_port=0)) as (url, app):
        yield url, app.state.grpc.address


@pytest.fixture(scope="module")
def torch_gateway(live) -> str:
    return live[0]


@pytest.fixture(scope="module")
def triton_gateway(tmp_path_factory, export_tiny) -> Iterator[str]:
    """The gateway with `--backend triton` in front of a real tritonserver serving the tiny export."""
    from vit_export.tritonserver import TritonServer, available

    reason = available()
    if reason:
        pytest.skip(f"no tritonserver here: {reason}")
    d = tmp_path_factory.mktemp("triton_priority")
    result, _ = export_tiny(d, 32, 3, [f"c{i}" for i in range(10)], formats=("onnx", "triton"), out=d / "exports",
                            repo=d / "repo", name="tiny")
    assert result.ok
    server = TritonServer(d / "repo", models=["tiny_py", "tiny_explain_py"])
    server.start(timeout=90)
    try:
        settings = ServeSettings(model="tiny_py", backend="triton", triton_url=server.http_url, threads=1,
                                 decode_workers=1, request_timeout_s=30, priority_levels=LEVELS)
        with live_server(settings) as url:
            yield url
    finally:
        server.close()


@pytest.mark.parametrize("level", [LEVELS + 1, 2**31, 2**63, 2**64, 10**30])
def test_a_priority_beyond_the_levels_is_422(torch_gateway, level):
    r = _post(torch_gateway, "tiny", {"inputs": [_pixels((32, 48))], "parameters": {"priority": level}})
    assert r.status_code == 422, r.text
    assert "priority" in r.json()["error"] and "VIT_SERVE_PRIORITY_LEVELS" in r.json()["error"]


@pytest.mark.parametrize("level", [0, 1, LEVELS])
def test_a_priority_within_the_levels_is_answered(torch_gateway, level):
    r = _post(torch_gateway, "tiny", {"inputs": [_pixels((32, 48))], "parameters": {"priority": level}})
    assert r.status_code == 200, r.text
    assert np.isfinite(r.json()["outputs"][0]["data"]).all()


@pytest.mark.parametrize(("datatype", "value"), [("FP64", 1e300), ("FP64", -3.5e38), ("FP64", float("nan")),
                                                 ("FP64", float("inf")), ("FP32", float("nan")),
                                                 ("FP32", float("-inf")), ("FP16", float("inf"))])
def test_pixels_beyond_float32_or_not_finite_are_400(torch_gateway, datatype, value):
    r = _post(torch_gateway, "tiny", {"inputs": [_pixels((32, 48), datatype, value)]})
    assert r.status_code == 400, r.text
    assert "pixel_values" in r.json()["error"]


def test_fp64_pixels_within_float32_are_answered(torch_gateway):
    r = _post(torch_gateway, "tiny", {"inputs": [_pixels((32, 48), "FP64", 3.0e38)]})
    assert r.status_code == 200, r.text


def test_grpc_priority_beyond_the_levels_is_invalid_argument(live):
    """tritonclient.grpc `infer(priority=...)`: beyond the levels INVALID_ARGUMENT naming the setting; within, the
    logits."""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(live[1])
    try:
        inp = grpcclient.InferInput("pixel_values", [1, 3, 32, 48], "FP32")
        inp.set_data_from_numpy(np.full((1, 3, 32, 48), 0.25, np.float32))
        out = [grpcclient.InferRequestedOutput("logits")]
        with pytest.raises(InferenceServerException) as e:
            client.infer("tiny", [inp], outputs=out, priority=LEVELS + 1)
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and "VIT_SERVE_PRIORITY_LEVELS" in str(e.value)
        assert client.infer("tiny", [inp], outputs=out, priority=LEVELS).as_numpy("logits").shape == (1, 10)
    finally:
        client.close()


@pytest.mark.parametrize("level", [LEVELS + 1, 2**63, 2**64])
def test_triton_backend_priority_beyond_the_levels_is_422(triton_gateway, level):
    r = _post(triton_gateway, "tiny_py", {"inputs": [_pixels((32, 32))], "parameters": {"priority": level}})
    assert r.status_code == 422, r.text
    assert "VIT_SERVE_PRIORITY_LEVELS" in r.json()["error"]


@pytest.mark.parametrize("level", [0, 1, 2, LEVELS])
def test_triton_backend_priority_within_the_levels_is_answered(triton_gateway, level):
    """Each level the gateway allows goes through to Triton as its `priority` (its model has no priority_levels:
    Triton takes any) and is answered."""
    r = _post(triton_gateway, "tiny_py", {"inputs": [_pixels((32, 32))], "parameters": {"priority": level}})
    assert r.status_code == 200, r.text
    assert len(r.json()["outputs"][0]["data"]) == 10


@pytest.mark.parametrize("datatype", ["FP64", "FP32"])
def test_triton_backend_pixels_beyond_float32_are_400(triton_gateway, datatype):
    value = 1e300 if datatype == "FP64" else float("nan")
    r = _post(triton_gateway, "tiny_py", {"inputs": [_pixels((32, 32), datatype, value)]})
    assert r.status_code == 400, r.text
