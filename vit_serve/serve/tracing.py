"""OpenTelemetry tracing, the `otel` extra: on with `otel` (VIT_SERVE_OTEL=1 or `vit-serve serve --otel`).

On, the app gets a TracerProvider of its own (a BatchSpanProcessor in front of the OTLP/HTTP protobuf exporter)
and FastAPIInstrumentor: one server span per request, named after its route ("POST /classify"), which continues
the caller's trace when the request carries a W3C `traceparent`. The probes (/healthz, /readyz, /metrics) are not
traced unless OTEL_PYTHON_FASTAPI_EXCLUDED_URLS (or OTEL_PYTHON_EXCLUDED_URLS) says otherwise. The Triton
backend passes the context on (`vit_serve.runtime.trace_context`), so Triton's own spans join the same trace. The
gRPC server makes a span per call the same way (`grpc_server_span`; the health RPCs are not traced).

The rest is OpenTelemetry's own variables, read by its SDK: OTEL_EXPORTER_OTLP_ENDPOINT (default
http://localhost:4318) or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_HEADERS, _TIMEOUT,
OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES (service name "vit-serve" when neither names one),
OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG (default parentbased_always_on), OTEL_BSP_*, OTEL_PROPAGATORS,
OTEL_SDK_DISABLED. OTEL_TRACES_EXPORTER may be otlp (the default), console or none.

Off (the default), this module imports nothing of OpenTelemetry (only its functions do) and no span is made: no
SDK, instrumentation or exporter is loaded. (Recent FastAPI releases, 0.165 among them, import the
OpenTelemetry API themselves; their own telemetry stays off without a provider, and defers to the instrumentor's
middleware when tracing is on.)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

EXTRA = "pip install 'vit-serve[otel]'"
SERVICE_NAME = "vit-serve"
# Probes and scrapes every few seconds would drown the traces that matter.
UNTRACED = "/healthz,/readyz,/metrics"
EXPORTERS = ("otlp", "console", "none")
PROTOCOL = "http/protobuf"  # the exporter of the extra; OTLP/gRPC would need opentelemetry-exporter-otlp-proto-grpc


class TracingError(ValueError):
    """Tracing was asked for and cannot start (the extra is missing, or an OTEL_* variable it cannot honour):
    a message written for the user, so the CLI prints it in one line and exits non-zero."""


def instrument(app: Any, settings: Any) -> Any | None:
    """With `settings.otel`, trace `app` (a FastAPI app) and return its TracerProvider (also
    `app.state.tracer_provider`; shut down, flushing its spans, when the app's lifespan ends); else None.

    Raises TracingError when the extra is not installed or an OTEL_* variable asks for what it lacks.
    """
    app.state.tracer_provider = None
    if not getattr(settings, "otel", False):
        return None
    try:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
        from opentelemetry.sdk.resources import SERVICE_NAME as SERVICE_NAME_KEY
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError as e:
        raise TracingError(f"tracing is on (VIT_SERVE_OTEL / --otel) but OpenTelemetry is missing ({e}): "
                           f"{EXTRA}") from None
    # The variables are checked before anything starts: a bad one fails the start, not the first export.
    exporters = [_otlp_exporter() if n == "otlp" else ConsoleSpanExporter()
                 for n in _exporter_names() if n != "none"]
    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES are read here; the SDK's fallback is "unknown_service".
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME_KEY, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME_KEY: SERVICE_NAME}))
    # No sampler argument: the provider reads OTEL_TRACES_SAMPLER(_ARG) itself. Not set as the global provider,
    # so that each app (tests make many in one process) has its own and shuts it down with its lifespan.
    provider = TracerProvider(resource=resource)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    untraced = None if _env("OTEL_PYTHON_FASTAPI_EXCLUDED_URLS", "OTEL_PYTHON_EXCLUDED_URLS") else UNTRACED
    # receive / send: one span per ASGI message, noise beside the request's own span.
    FastAPIInstrumentor.instrument_app(app, tracer_provider=provider, excluded_urls=untraced,
                                       exclude_spans=["receive", "send"])
    app.state.tracer_provider = provider
    _shutdown_with_lifespan(app, provider)
    return provider


GRPC_SERVICE = "inference.GRPCInferenceService"


@contextlib.contextmanager
def grpc_server_span(tracer: Any | None, method: str, metadata: Any) -> Iterator[Any | None]:
    """A SERVER span around one gRPC call (`GRPC_SERVICE/method`, OpenTelemetry's rpc.* attributes), continuing
    the caller's trace from the call's metadata (`traceparent`); yields the span, or None when `tracer` is None
    (tracing off: nothing is imported)."""
    if tracer is None:
        yield None
        return
    from opentelemetry.propagate import extract
    from opentelemetry.trace import SpanKind

    carrier = {k.lower(): v for k, v in (metadata or ()) if isinstance(v, str)}
    attributes = {"rpc.system": "grpc", "rpc.service": GRPC_SERVICE, "rpc.method": method}
    with tracer.start_as_current_span(f"{GRPC_SERVICE}/{method}", context=extract(carrier), kind=SpanKind.SERVER,
                                      attributes=attributes) as span:
        yield span


def _env(*names: str) -> str:
    """The first of the variables that is set and not blank, else ""."""
    return next((v.strip() for n in names if (v := os.environ.get(n, "")).strip()), "")


def _exporter_names() -> list[str]:
    names = [n.strip().lower() for n in (_env("OTEL_TRACES_EXPORTER") or "otlp").split(",") if n.strip()]
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise TracingError(f"OTEL_TRACES_EXPORTER={','.join(unknown)} is not one vit-serve sets up; use one of "
                           f"{', '.join(EXPORTERS)}")
    return names


def _otlp_exporter() -> Any:
    protocol = _env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL") or PROTOCOL
    if protocol != PROTOCOL:
        raise TracingError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol}: vit-serve exports traces over OTLP/HTTP "
                           f"only; use {PROTOCOL} (an OpenTelemetry Collector translates to the others)")
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as e:
        raise TracingError(f"tracing is on (VIT_SERVE_OTEL / --otel) but the OTLP exporter is missing ({e}): "
                           f"{EXTRA}") from None
    return OTLPSpanExporter()  # endpoint, headers, timeout, compression: OTEL_EXPORTER_OTLP_(TRACES_)*


def _shutdown_with_lifespan(app: Any, provider: Any) -> None:
    """Wrap the app's lifespan so that the provider exports what it holds when the server stops."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        try:
            async with inner(a) as state:
                yield state
        finally:
            # In a thread: the last export may wait for the collector (OTEL_EXPORTER_OTLP_TIMEOUT at most).
            await asyncio.to_thread(provider.shutdown)

    app.router.lifespan_context = lifespan
