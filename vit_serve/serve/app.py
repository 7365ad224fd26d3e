"""The app factory: `create_app(settings)` -> FastAPI, and `run(settings)` (uvicorn) for `vit-serve serve`.

The lifespan loads the model (the server does not start if it cannot), starts the batcher and warms the model
up in the background; /readyz answers 200 once that is done.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from starlette.middleware.cors import CORSMiddleware

from vit_serve import __version__
from vit_serve.serve.errors import install_error_handlers
from vit_serve.serve.gateway import Gateway
from vit_serve.serve.grpc import GrpcServer
from vit_serve.serve.hangup import HangUp
from vit_serve.serve.metrics_listener import MetricsListener
from vit_serve.serve.middleware import (
    BodyLimit,
    ErrorBoundary,
    QueryRedaction,
    RequestId,
    RequestIdFilter,
    RequestMetrics,
)
from vit_serve.serve.routes import classify, embed, explain, health, metrics, models, openai, page, v2, weaviate
from vit_serve.serve.routes.page import STATIC
from vit_serve.serve.schemas import StrictJSONResponse
from vit_serve.serve.security import ApiKeys, KeyRing
from vit_serve.serve.settings import ServeSettings
from vit_serve.serve.slow_clients import BodyDeadline, http_protocol
from vit_serve.serve.tracing import instrument

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger("vit_serve.serve")

DESCRIPTION = """Classify images with a Vision Transformer and see what it attended to.

`POST /classify` (multipart field `file`, or a raw `image/*` body) answers the top-k classes and an `id`;
`GET /explain?id=...` draws the attention rollout of that image; `POST /embed` answers its embedding;
`?model=&version=` pick a model of the repository (`GET /models` lists them). The Open Inference Protocol
(KServe v2, with the binary tensor and classification extensions and Triton's model repository extension) is
under `/v2`; OpenAI's embeddings API (images and texts) under `/v1` (`POST /v1/embeddings`, `GET /v1/models`);
Weaviate's multi2vec inference contract under `/weaviate/` (the default model) and `/weaviate/{model}/`.
Health: `/healthz`, `/readyz`; Prometheus metrics: `/metrics`.
"""


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    gateway: Gateway = app.state.gateway
    app.state.grpc = None  # the GrpcServer (its `port`) when grpc_port is set
    app.state.metrics_listener = None  # the MetricsListener (its `port`) when metrics_port is set
    s = gateway.settings
    ring: KeyRing = app.state.keyring  # create_app's: one set of rate buckets for HTTP and gRPC
    if s.security.allow_any_key_admin and s.repository.repository_api and not ring.admin:
        log.warning("--allow-any-key-admin: %s may load and unload models (POST /v2/repository/models/NAME/load, "
                    "unload; gRPC RepositoryModelLoad, RepositoryModelUnload)",
                    "any valid API key" if ring.on else "anyone (no API key is set)")
    if s.security.open_weaviate:
        log.warning("--open-weaviate: /weaviate/ (Weaviate's multi2vec contract: /vectorize, /meta) answers %s; "
                    "let only Weaviate reach this port (the docs' NetworkPolicy)",
                    "without an API key" if ring.on else "anyone (no API key is set)")
    try:
        await gateway.start()
        if gateway.settings.grpc_port is not None:
            app.state.grpc = GrpcServer(gateway, getattr(app.state, "tracer_provider", None), ring)
            await app.state.grpc.start()
        if s.metrics_port is not None:  # GET /metrics for anyone, on a port of its own
            app.state.metrics_listener = MetricsListener(gateway)
            await app.state.metrics_listener.start()
    except Exception as e:
        log.error("cannot serve %s: %s", gateway.settings.model, " ".join(str(e).split()))
        if app.state.grpc is not None:
            await app.state.grpc.stop()
        await gateway.stop()
        raise
    try:
        yield
    finally:
        if (stopping := getattr(app.state, "grpc_stopping", None)) is not None:
            await stopping  # the drain's stop(grace), started when the listeners closed (vit_serve.serve.shutdown)
        elif app.state.grpc is not None:
            await app.state.grpc.stop()
        if app.state.metrics_listener is not None:
            await app.state.metrics_listener.stop()
        await gateway.stop()


def create_app(settings: ServeSettings | None = None) -> FastAPI:
    """A gateway app for `settings` (default: from VIT_SERVE_* variables). Nothing is loaded until its lifespan
    starts (uvicorn, TestClient, or `app.router.lifespan_context(app)`)."""
    settings = settings or ServeSettings()
    # Every JSON body is strict RFC 8259 JSON: NaN / inf outputs become null (vit_serve.serve.schemas).
    app = FastAPI(title="vit-serve", version=__version__, description=DESCRIPTION, lifespan=lifespan,
                  default_response_class=StrictJSONResponse)
    gateway = Gateway(settings)
    app.state.gateway = gateway
    install_error_handlers(app)
    for module in (classify, embed, explain, health, metrics, models, v2, openai, weaviate, page):  # v2: all of /v2
        app.include_router(module.router)
    if STATIC.is_dir():
        app.mount("/static", StaticFiles(directory=STATIC), name="static")
    # Outermost last: BodyDeadline -> HangUp -> RequestId -> CORS -> RequestMetrics -> ApiKeys -> ErrorBoundary ->
    # BodyLimit -> routes.
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(ErrorBoundary)
    security = settings.security
    app.state.keyring = KeyRing.from_settings(security, settings.repository.repository_api)  # ValueError: a bad file
    app.add_middleware(ApiKeys, ring=app.state.keyring, metrics=gateway.metrics)
    app.add_middleware(RequestMetrics, metrics=gateway.metrics)
    if security.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=security.cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "X-API-Key", "Content-Type", "X-Request-ID"],
                           expose_headers=["X-Request-ID", "X-Image-Id", "X-Model", "X-Model-Version",
                                           "Server-Timing", "Retry-After", "RateLimit-Limit", "RateLimit-Remaining",
                                           "RateLimit-Reset", "RateLimit-Policy"], max_age=600)
    if settings.request_ids:
        app.add_middleware(RequestId)
    app.add_middleware(HangUp, metrics=gateway.metrics)  # each request's Admission; hang-ups cancel inference
    app.add_middleware(BodyDeadline, timeout_s=settings.body_timeout_s)  # its clock starts with the headers
    instrument(app, settings)  # OpenTelemetry's server span outside them all, when settings.otel
    return app


class OneLineStartupFailure:
    """ASGI wrapper for the CLI: a failed start is the lifespan's one logged line, not a traceback.

    Starlette puts the formatted traceback into `lifespan.startup.failed`, and uvicorn prints that message; the
    lifespan above has already logged the reason in one line.
    """

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)

        async def send_quietly(message: dict) -> None:
            if message["type"] == "lifespan.startup.failed":
                message = {**message, "message": ""}
            await send(message)

        await self.app(scope, receive, send_quietly)


def server_config(app: Callable, settings: ServeSettings, **options: Any) -> uvicorn.Config:
    """uvicorn's Config for a gateway app: its HTTP protocol with the header timeout, the connection cap and the
    half-close answer of `settings` (`slow_clients`), and uvicorn's `options` (host, port, TLS, ...)."""
    import uvicorn

    return uvicorn.Config(app, http=http_protocol(settings.header_timeout_s, settings.max_connections), **options)


def run(settings: ServeSettings) -> None:
    """Serve until interrupted (one process: each model version runs in its own thread). A one-model repository
    that cannot be served ends the process with exit code 3 and one logged line."""
    import uvicorn

    from vit_serve.serve.shutdown import DrainingServer, graceful_timeout

    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())
    logging.getLogger("uvicorn.access").addFilter(QueryRedaction())  # its lines would carry explain ids
    app = create_app(settings)
    # SIGTERM / SIGINT: drain, close, grace, then 503 what still waits (vit_serve.serve.shutdown); uvicorn's own
    # timeout only cancels what is left a margin after the grace, once those 503s have gone out.
    config = server_config(OneLineStartupFailure(app), settings, host=settings.host, port=settings.port,
                           log_level="info", timeout_graceful_shutdown=graceful_timeout(settings.shutdown_grace_s),
                           ssl_certfile=settings.security.ssl_certfile, ssl_keyfile=settings.security.ssl_keyfile,
                           root_path=settings.root_path)
    server = DrainingServer(config, app)
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:  # as uvicorn.run: the lifespan failed (its one line is logged)
        sys.exit(uvicorn.config.STARTUP_FAILURE)
