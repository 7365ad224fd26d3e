"""The trace context a backend passes on to its server (W3C `traceparent` / `tracestate`), so that the server's
own spans join the request's trace (Triton's OpenTelemetry tracing continues it). Tracing itself, the spans of
the gateway's requests, is `vit_serve.serve.tracing`'s.
"""

from __future__ import annotations


def context_headers() -> dict[str, str]:
    """The current trace context as headers for a downstream call (W3C `traceparent`, `tracestate`, as
    OTEL_PROPAGATORS says): {} outside a sampled or remote span. Call it only with tracing on (it imports
    OpenTelemetry's API)."""
    from opentelemetry.propagate import inject

    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier
