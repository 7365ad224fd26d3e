"""What the endpoints open to anyone (with API keys on) tell: the readiness probes answer a short state, never a
file path, a loader's message or the list of models; gRPC ModelReady answers ready true / false only, an unknown
model alike a not-ready one unless the caller has a key; and a request's path is logged in one line, its control
characters escaped. Against a real gateway under uvicorn on a real socket, spoken to by httpx and tritonclient's
gRPC client."""

from __future__ import annotations

import io
import logging
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from gateway_helpers import settings_for

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

KEY = "open-endpoints-key-7c2a"
AUTH = {"X-API-Key": KEY}


@contextmanager
def started(settings) -> Iterator[tuple[str, object]]:
    """A real uvicorn serving the app in a thread on a free port; yields (base URL, app) once it answers /healthz
    (its lifespan has run: the models are loaded or have failed, warm-ups go on)."""
    import uvicorn

    from vit_serve.serve.app import create_app

    app = create_app(settings)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)
        yield url, app
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


@pytest.fixture(scope="module")
def broken_default(tiny_onnx, tmp_path_factory) -> Iterator[tuple[str, object, Path]]:
    """A gateway with keys, gRPC and a repository of two models: `broken` (the default; its file is not an ONNX
    graph, so its load error holds the file's path) and `tiny` (serves). Yields (URL, app, the repository)."""
    repo = tmp_path_factory.mktemp("secret-layout")
    (repo / "broken.onnx").write_bytes(b"not an onnx graph")
    shutil.copy(tiny_onnx.with_suffix(".json"), repo / "broken.json")
    shutil.copy(tiny_onnx, repo / "tiny.onnx")
    shutil.copy(tiny_onnx.with_suffix(".json"), repo / "tiny.json")
    with started(settings_for(repo, default_model="broken", api_keys=[KEY], grpc_port=0)) as (url, app):
        yield url, app, repo


def test_v2_health_ready_answers_like_readyz(broken_default):
    """The open /v2/health/ready says why it is not ready in /readyz's words: no path, no loader message, no other
    model's name; GET /models, behind the key, has the reason."""
    url, _, repo = broken_default
    v2 = httpx.get(f"{url}/v2/health/ready", timeout=30)
    readyz = httpx.get(f"{url}/readyz", timeout=30)
    models = httpx.get(f"{url}/models", headers=AUTH, timeout=30)
    print(f"\n/v2/health/ready: {v2.text}\n/readyz: {readyz.text}")
    assert v2.status_code == 503 and v2.json()["ready"] is False
    assert v2.json()["error"] == readyz.json()["reason"]
    assert str(repo) not in v2.text and "broken.onnx" not in v2.text and "onnx" not in v2.text.lower()
    assert "tiny" not in v2.text  # the other model is not named
    reason = next(m for m in models.json()["models"] if m["name"] == "broken")["versions"][0]["reason"]
    assert "broken.onnx" in reason


def _ready(c: grpcclient.InferenceServerClient, name: str, version: str = "", **headers: str) -> str:
    """ModelReady's answer: "ready", "not ready", or the error's status code name."""
    try:
        return "ready" if c.is_model_ready(name, version, headers=headers or None) else "not ready"
    except InferenceServerException as e:
        return str(e.status()).removeprefix("StatusCode.") + ": " + (e.message() or "")


def test_grpc_model_ready_tells_an_anonymous_caller_ready_or_not_and_nothing_else(broken_default):
    _, app, repo = broken_default
    c = grpcclient.InferenceServerClient(app.state.grpc.address)
    try:
        deadline = time.monotonic() + 60
        while _ready(c, "tiny") != "ready" and time.monotonic() < deadline:  # its warm-up
            time.sleep(0.1)
        anonymous = {name: _ready(c, name) for name in ("tiny", "broken", "no-such-model")}
        anonymous["tiny v7"] = _ready(c, "tiny", "7")
        anonymous["tiny v1"] = _ready(c, "tiny", "1")
        keyed = {name: _ready(c, name, **{"x-api-key": KEY}) for name in ("tiny", "broken", "no-such-model")}
        server_ready = c.is_server_ready()
    finally:
        c.close()
    print(f"\nanonymous: {anonymous}\nkeyed: {keyed}")
    assert anonymous == {"tiny": "ready", "broken": "not ready", "no-such-model": "not ready",
                         "tiny v7": "not ready", "tiny v1": "ready"}
    assert keyed["tiny"] == "ready" and keyed["broken"] == "not ready"
    assert keyed["no-such-model"].startswith("NOT_FOUND") and "'tiny'" in keyed["no-such-model"]
    assert server_ready is False  # the default model is not loaded
    assert str(repo) not in repr(anonymous)


class _Lines(logging.Handler):
    """The formatted records of a logger, as a log file would hold them."""

    def __init__(self) -> None:
        super().__init__()
        self.stream = io.StringIO()
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.stream.write(self.format(record) + "\n")

    def lines(self) -> list[str]:
        return self.stream.getvalue().splitlines()


@pytest.mark.parametrize("path, escaped", [
    ("/classify%0Aforged", "/classify\\nforged"),
    ("/x%0D%0AINFO%20vit_serve.serve.access:%20forged", "/x\\r\\nINFO vit_serve.serve.access: forged"),
    ("/%1B%5B31mred%C2%85next%E2%80%A8line", "/\\x1b[31mred\\x85next\\u2028line"),
])
def test_a_line_break_in_a_path_cannot_forge_an_access_line(broken_default, path, escaped):
    url, _, _ = broken_default
    handler = _Lines()
    access = logging.getLogger("vit_serve.serve.access")
    access.addHandler(handler)
    old_level = access.level
    access.setLevel(logging.INFO)
    rid = uuid.uuid4().hex
    try:
        r = httpx.get(url + path, headers={"X-Request-ID": rid}, timeout=30)
        deadline = time.monotonic() + 10  # the line is written once the answer has gone out
        while rid not in handler.stream.getvalue() and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        access.removeHandler(handler)
        access.setLevel(old_level)
    ours = [line for line in handler.lines() if rid in line]
    print(f"\n{path} -> {r.status_code}: {handler.lines()}")
    assert len(ours) == 1 and escaped in ours[0], handler.lines()
    assert len(handler.lines()) == 1  # nothing else was logged: no forged line


def test_metrics_need_a_key_on_the_main_port_and_the_metrics_port_serves_only_them(tiny_onnx):
    """/metrics shows every key's name and traffic: on the main port it needs a key like any route; the metrics
    port (metrics_port) serves GET /metrics to anyone, and nothing else; it closes with the app."""
    from gateway_helpers import live_app, metric

    with live_app(settings_for(tiny_onnx, api_keys=[KEY], metrics_port=0)) as (url, app):
        port = app.state.metrics_listener.port
        scrape_url = f"http://127.0.0.1:{port}"
        assert port != int(url.rsplit(":", 1)[1])
        anonymous = httpx.get(f"{url}/metrics", timeout=30)
        keyed = httpx.get(f"{url}/metrics", headers=AUTH, timeout=30)
        scraped = httpx.get(f"{scrape_url}/metrics", timeout=30)
        head = httpx.head(f"{scrape_url}/metrics", timeout=30)
        elsewhere = {path: httpx.get(scrape_url + path, timeout=30).status_code
                     for path in ("/", "/readyz", "/classify", "/metrics/", "/docs")}
        posted = httpx.post(f"{scrape_url}/metrics", timeout=30)
        classified = httpx.post(f"{url}/classify", content=b"not an image", headers={"Content-Type": "image/png",
                                                                                      **AUTH}, timeout=30)
    print(f"\nmain port /metrics: {anonymous.status_code} anonymous, {keyed.status_code} with the key; "
          f"metrics port: {scraped.status_code}, elsewhere {elsewhere}, POST {posted.status_code}")
    assert anonymous.status_code == 401 and "vit_serve" not in anonymous.text
    assert keyed.status_code == 200 and "vit_serve_requests_total" in keyed.text
    assert scraped.status_code == 200 and scraped.headers["content-type"].startswith("text/plain")
    assert metric(scraped.text, "vit_serve_ready", model="tiny", version="1") == 1
    assert head.status_code == 200 and head.content == b""
    assert set(elsewhere.values()) == {404} and posted.status_code == 405
    assert classified.status_code == 415
    with pytest.raises(httpx.TransportError):  # closed with the app
        httpx.get(f"{scrape_url}/metrics", timeout=5)


def test_without_a_metrics_port_metrics_still_need_a_key_and_probes_do_not(tiny_onnx):
    from gateway_helpers import live_app

    with live_app(settings_for(tiny_onnx, api_keys=[KEY])) as (url, app):
        answers = {path: httpx.get(url + path, timeout=30).status_code
                   for path in ("/metrics", "/healthz", "/readyz", "/v2/health/live", "/v2/health/ready")}
        assert app.state.metrics_listener is None
    assert answers == {"/metrics": 401, "/healthz": 200, "/readyz": 200, "/v2/health/live": 200,
                       "/v2/health/ready": 200}
