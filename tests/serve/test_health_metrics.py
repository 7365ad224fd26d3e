"""Health, readiness, Prometheus metrics (one registry per app), the OpenAPI schema and the page route."""

from __future__ import annotations

import logging
import shutil

import httpx
from gateway_helpers import metric, run, serving, settings_for

from vit_serve.serve.app import create_app
from vit_serve.serve.routes.page import INDEX

JPEG = {"Content-Type": "image/jpeg"}


def test_not_ready_before_startup(tiny_ckpt, photos):
    app = create_app(settings_for(tiny_ckpt))  # lifespan not started: nothing loaded

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
            return (await client.get("/healthz"), await client.get("/readyz"), await client.get("/v2/health/ready"),
                    await client.post("/classify", content=photos["coffee.jpg"], headers=JPEG))

    live, ready, v2_ready, classify = run(scenario())
    assert live.status_code == 200 and live.json() == {"status": "ok"}
    assert ready.status_code == 503 and ready.json() == {"ready": False, "reason": "the models are loading"}
    assert v2_ready.status_code == 503
    assert classify.status_code == 503 and classify.headers["retry-after"] == "1"


def test_ready_after_warm_up(tiny_ckpt):
    async def scenario():
        async with serving(settings_for(tiny_ckpt)) as (client, app):
            gateway = app.state.gateway
            return (await client.get("/readyz"), await client.get("/v2/health/live"),
                    gateway.model("tiny").warm)

    ready, live, warm = run(scenario())
    assert ready.status_code == 200
    assert ready.json() == {"ready": True, "model": "tiny", "backend": "torch"}
    assert live.status_code == 200 and warm


def test_metrics_count_requests_and_apps_do_not_share_them(tiny_ckpt, photos):
    async def scenario():
        async with serving(settings_for(tiny_ckpt)) as (a, _), serving(settings_for(tiny_ckpt)) as (b, _):
            for _ in range(3):
                await a.post("/classify", content=photos["coffee.jpg"], headers=JPEG)
            await a.post("/classify", content=b"text", headers={"Content-Type": "text/plain"})
            await a.get("/v2/models/tiny")
            await a.get("/no/such/path")
            return (await a.get("/metrics")), (await b.get("/metrics")).text

    r, other = run(scenario())
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert metric(text, "vit_serve_requests_total", endpoint="/classify", method="POST", status="200") == 3
    assert metric(text, "vit_serve_requests_total", endpoint="/classify", method="POST", status="415") == 1
    assert metric(text, "vit_serve_requests_total", endpoint="/v2/models/{name}", method="GET", status="200") == 1
    assert metric(text, "vit_serve_requests_total", endpoint="unmatched", method="GET", status="404") == 1
    assert metric(text, "vit_serve_request_duration_seconds_count", endpoint="/classify") == 4
    assert metric(text, "vit_serve_batch_size_sum", task="classify") == 3
    assert metric(text, "vit_serve_inference_seconds_count", task="classify") >= 1
    assert 'vit_serve_queue_depth{model="tiny",version="1"} 0.0' in text
    assert metric(text, "vit_serve_ready", model="tiny", version="1") == 1
    assert metric(text, "vit_serve_batch_size_sum", task="classify", model="tiny", version="1") == 3
    assert metric(other, "vit_serve_requests_total", endpoint="/classify", method="POST", status="200") == 0


def test_openapi_documents_bodies_and_answers(tiny_ckpt):
    async def scenario():
        async with serving(settings_for(tiny_ckpt)) as (client, _):
            return (await client.get("/openapi.json")).json(), await client.get("/docs")

    schema, docs = run(scenario())
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    classify = schema["paths"]["/classify"]["post"]
    assert set(classify["requestBody"]["content"]) == {"multipart/form-data", "image/*"}
    assert {p["name"] for p in classify["parameters"]} == {"top_k", "model", "version", "explain", "labels",
                                                           "max_patches", "abstain", "threshold", "timeout_ms",
                                                           "x-request-timeout-ms", "x-session-id"}
    ok = classify["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    assert ok.endswith("/ClassifyResponse")
    props = schema["components"]["schemas"]["ClassifyResponse"]["properties"]
    assert set(props) == {"id", "model", "version", "resolution", "predictions", "timing_ms", "explanation",
                          "ood", "abstention"}
    assert {"415", "413", "422", "503", "504"} <= set(classify["responses"])
    explain = schema["paths"]["/explain"]
    assert {"get", "post"} <= set(explain)
    assert "image/png" in explain["get"]["responses"]["200"]["content"]
    assert {p["name"] for p in explain["get"]["parameters"]} >= {"id", "method", "head_fusion", "discard_ratio",
                                                                 "format"}
    assert "/v2/models/{name}/infer" in schema["paths"]
    assert "/readyz" in schema["paths"] and "/metrics" in schema["paths"]


def test_page_route(tiny_ckpt):
    async def scenario():
        async with serving(settings_for(tiny_ckpt)) as (client, _):
            return await client.get("/")

    r = run(scenario())
    if INDEX.is_file():
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert r.content == INDEX.read_bytes()
    else:
        assert r.status_code == 404 and "/docs" in r.json()["detail"] and str(INDEX) not in r.text


def test_a_missing_page_is_a_404_that_names_no_file(tiny_ckpt, tmp_path, monkeypatch, caplog):
    """The web page's file missing (as in an install without it): 404 saying where the API is, and the path only
    in the log (the answer is open to anyone)."""
    from vit_serve.serve.routes import page

    missing = tmp_path / "static" / "index.html"
    monkeypatch.setattr(page, "INDEX", missing)
    caplog.set_level(logging.WARNING, logger="vit_serve.serve")

    async def scenario():
        async with serving(settings_for(tiny_ckpt, api_keys=["k"])) as (client, _):
            return await client.get("/")

    r = run(scenario())
    assert r.status_code == 404 and "/classify" in r.json()["detail"], r.text
    assert str(tmp_path) not in r.text and "index.html" not in r.text
    assert str(missing) in caplog.text


def test_readyz_names_no_file_path_and_models_says_why(tmp_path, tiny_onnx, caplog):
    """The default model fails to load (a broken ONNX file): the open /readyz says so by name, without the
    loader's message (it holds the file's path); GET /models, behind the key, and the log have the reason."""
    (tmp_path / "broken.onnx").write_bytes(b"not an onnx graph")
    shutil.copy(tiny_onnx.with_suffix(".json"), tmp_path / "broken.json")
    caplog.set_level(logging.INFO, logger="vit_serve.serve")
    app = create_app(settings_for(tmp_path, default_model="broken", api_keys=["k"]))

    async def scenario():
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://gateway") as c:
            return await c.get("/readyz"), await c.get("/models", headers={"X-API-Key": "k"})

    ready, models = run(scenario())
    print(f"\n/readyz: {ready.text}")
    assert ready.status_code == 503 and ready.json()["ready"] is False
    assert "'broken' is not loaded" in ready.json()["reason"]
    assert str(tmp_path) not in ready.text and "broken.onnx" not in ready.text
    reason = next(m for m in models.json()["models"] if m["name"] == "broken")["versions"][0]["reason"]
    assert "broken.onnx" in reason and "broken.onnx" in caplog.text
