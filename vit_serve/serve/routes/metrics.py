"""GET /metrics: Prometheus text format (this app's own registry).

It shows every model's traffic and every API key's name and request counts, so with keys on it needs one like any
route (it is not a probe: `open_probes` leaves it closed). Scrapers without a key use the metrics port
(`metrics_port`, vit_serve.serve.metrics_listener), which serves the same text and nothing else. A scrape computes
nothing expensive: the drift gauges are the last reports, computed at most once per `drift_refresh_s`."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from vit_serve.serve.deps import GatewayDep

router = APIRouter(tags=["health"])


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}})
async def metrics(gateway: GatewayDep) -> Response:
    """Requests by endpoint and status (`vit_serve_requests_total`), request latency
    (`vit_serve_request_duration_seconds`), queue depth (`vit_serve_queue_depth`), images per model run
    (`vit_serve_batch_size`), queue wait and model time per batch, rejections (queue full, timeout), readiness."""
    return Response(gateway.metrics.render(), media_type=CONTENT_TYPE_LATEST)
