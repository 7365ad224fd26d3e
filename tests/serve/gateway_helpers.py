"""Helpers of the gateway tests: settings for tests, the gateway in-process (httpx + ASGI, lifespan running) or
under a real uvicorn in a thread, and reading one Prometheus sample."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import httpx

LABELS = ["tabby", "espresso", "astronaut", "teapot", "lighthouse", "sunflower", "locomotive", "seal", "crane",
          "fox"]
RES = (32, 48)


def settings_for(model: Path | str, **kw):
    """ServeSettings for tests: one thread everywhere; uploads decoded as the model's contract says (exact for
    every test model), so that answers compare with the library's `preprocess` and the references; batches as
    configured (no batch curve: the tests that count batch sizes must not hang on a tiny model's measured curve
    on a busy machine; test_runner_curve covers the curve)."""
    from vit_serve.serve.settings import ServeSettings

    base = {"model": str(model), "device": "cpu", "threads": 1, "decode_workers": 2, "decode": "contract",
            "batch_curve": False}
    return ServeSettings(**{**base, **kw})


@asynccontextmanager
async def serving(settings) -> AsyncIterator[tuple[httpx.AsyncClient, object]]:
    """The app with its lifespan running and the model warmed up, and an httpx client speaking ASGI to it."""
    from vit_serve.serve.app import create_app

    app = create_app(settings)
    async with app.router.lifespan_context(app):
        await app.state.gateway.wait_ready(60)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=60) as client:
            yield client, app


def run(coro):
    return asyncio.run(coro)


def wait_ready(url: str, alive: Callable[[], bool], timeout: float = 60.0, poll: float = 0.05) -> bool:
    """Poll `url`/readyz until it answers 200 (True), or until the server is gone (`alive()` false) or `timeout`
    seconds have passed (False)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or not alive():
            return False
        time.sleep(poll)


@contextmanager
def live_app(settings) -> Iterator[tuple[str, object]]:
    """A real uvicorn serving the app in a thread, on a free port, configured as `vit-serve serve` configures it
    (`server_config`: header timeout, connection cap, half-close); yields (base URL, app) once /readyz is 200."""
    import uvicorn

    from vit_serve.serve.app import create_app, server_config

    app = create_app(settings)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(server_config(app, settings, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_ready(url, thread.is_alive):
            raise RuntimeError("the test server did not become ready")
        yield url, app
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


@contextmanager
def live_server(settings) -> Iterator[str]:
    """`live_app`'s base URL."""
    with live_app(settings) as (url, _):
        yield url


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples `name` whose labels include `labels`, in Prometheus text parsed by
    prometheus_client's own parser (0 when there is none)."""
    from prometheus_client.parser import text_string_to_metric_families

    return float(sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                     if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())))
