"""The metrics port (`metrics_port`): GET /metrics for anyone, on a listener of its own, and nothing else there.

/metrics shows every model's traffic and every API key's name and request counts, so on the main port it needs a
key like any route (when keys are on). Prometheus scrapes a port, usually with no credentials (the
`prometheus.io/port` annotations of deploy/ and a ServiceMonitor's `port` name it), and Kubernetes can limit who
reaches a port (a NetworkPolicy) but not a path: so the open scrape gets its own port, as Triton's 8002, which the
main port's clients need not reach. Served by a second uvicorn server in the app's event loop (started and
stopped by its lifespan, beside gRPC), with the main port's TLS certificate when it has one; no access log (a
scrape every few seconds would drown the requests), at most `CONNECTIONS` connections at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Receive, Scope, Send

from vit_serve.serve.gateway import Gateway

log = logging.getLogger("vit_serve.serve")

PATH = "/metrics"
CONNECTIONS = 16  # scrapers are few; uvicorn answers 503 beyond it


class _Quiet(uvicorn.Server):
    """A uvicorn server that leaves the process's signals to the main server (it stops with the lifespan)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class MetricsListener:
    """`await start()` binds settings.host:metrics_port (0: a free port; `port` says which) and serves GET / HEAD
    /metrics there to anyone (404 for any other path, 405 for another method); `await stop()` closes it."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.port: int | None = None
        self._server: _Quiet | None = None
        self._task: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        headers: list[tuple[bytes, bytes]] = [(b"content-type", b"text/plain; charset=utf-8")]
        if scope["path"] != PATH:
            status, body = 404, b"this port serves GET /metrics only\n"
        elif scope["method"] not in ("GET", "HEAD"):
            status, body = 405, b"GET /metrics\n"
            headers.append((b"allow", b"GET, HEAD"))
        else:
            status, body = 200, self.gateway.metrics.render()
            headers = [(b"content-type", CONTENT_TYPE_LATEST.encode())]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})

    async def start(self) -> None:
        s = self.gateway.settings
        if s.metrics_port is None:
            raise ValueError("metrics_port is not set")
        host = s.host
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host.strip("[]"), s.metrics_port))
        except OSError as e:
            sock.close()
            raise OSError(f"cannot serve /metrics on {host}:{s.metrics_port} (metrics_port): {e.strerror}") from None
        tls = s.security
        config = uvicorn.Config(self, log_config=None, access_log=False, lifespan="off", server_header=False,
                                limit_concurrency=CONNECTIONS, ssl_certfile=tls.ssl_certfile,
                                ssl_keyfile=tls.ssl_keyfile)
        self._server = server = _Quiet(config)
        self.port = sock.getsockname()[1]
        self._task = asyncio.create_task(server.serve(sockets=[sock]), name="vit-serve-metrics-port")
        while not server.started:  # bound already: this is the few loop turns uvicorn takes to start serving
            if self._task.done():
                await self._task  # raises what stopped it
                raise OSError(f"the metrics port {self.port} stopped as it started")
            await asyncio.sleep(0.01)
        log.info("/metrics for anyone on %s:%d (metrics_port); on the main port it needs a key", host, self.port)

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._server = self._task = None
