"""A backend that stops answering: the gateway's 503 (HTTP) and UNAVAILABLE (gRPC) answers, and its open /readyz,
name no internal host (the Triton server's address is logged, not answered). Against a real tritonserver (the
one bundled in nvidia-pytriton) serving a tiny exported ViT, stopped while the gateway runs under a real
uvicorn with its gRPC port on; the clients are httpx and tritonclient's gRPC client."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
from gateway_helpers import live_app

from vit_serve.serve.settings import ServeSettings

grpcclient = pytest.importorskip("tritonclient.grpc")
pytest.importorskip("onnxruntime")
from tritonclient.utils import InferenceServerException  # noqa: E402

LABELS = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


@pytest.fixture(scope="module")
def triton(tmp_path_factory, export_tiny) -> Iterator[object]:
    from vit_export.tritonserver import TritonServer, available

    reason = available()
    if reason:
        pytest.skip(f"no tritonserver here: {reason}")
    d = tmp_path_factory.mktemp("unavailable")
    result, _ = export_tiny(d, 32, 7, LABELS, formats=("onnx", "triton"), out=d / "exports", repo=d / "repo",
                            name="tiny")
    assert result.ok
    server = TritonServer(d / "repo", models=["tiny_py", "tiny_explain_py"])
    server.start(timeout=90)
    yield server
    server.close()


def test_a_backend_that_went_away_is_a_503_naming_no_host(triton, photos, caplog):
    host = urlsplit(triton.http_url).hostname or "127.0.0.1"
    port = str(urlsplit(triton.http_url).port)
    settings = ServeSettings(model="tiny_py", backend="triton", triton_url=triton.http_url, grpc_port=0, threads=1,
                             decode_workers=1, request_timeout_s=10, decode="contract")
    caplog.set_level(logging.WARNING, logger="vit_serve.serve")
    with live_app(settings) as (url, app):
        assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200
        triton.stop()
        classify = httpx.post(f"{url}/classify", content=photos["coffee.jpg"],
                              headers={"Content-Type": "image/jpeg"}, timeout=30)
        ready = httpx.get(f"{url}/readyz", timeout=30)
        c = grpcclient.InferenceServerClient(app.state.grpc.address)
        x = np.zeros((1, 3, 32, 32), np.float32)
        inp = grpcclient.InferInput("pixel_values", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        try:
            with pytest.raises(InferenceServerException) as grpc_error:
                c.infer("tiny_py", [inp])
        finally:
            c.close()
    print(f"\n503: {classify.text}\n/readyz: {ready.text}\ngRPC: {grpc_error.value.status()} "
          f"{grpc_error.value.message()}")
    assert classify.status_code == 503 and "unavailable" in classify.json()["detail"], classify.text
    assert ready.status_code == 503
    assert str(grpc_error.value.status()) == "StatusCode.UNAVAILABLE"
    for text in (classify.text, ready.text, grpc_error.value.message() or ""):
        assert host not in text and port not in text, text
    assert triton.http_url.removeprefix("http://") in caplog.text  # the operator's log has the address
