"""Prometheus metrics of one gateway, in its own CollectorRegistry (several apps in one process do not clash)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)


class GatewayMetrics:
    """Requests by endpoint and status, latencies, queue depth, batch sizes."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("vit_serve_requests", "HTTP requests by endpoint (route template) and status",
                                ["endpoint", "method", "status"], registry=r)
        self.latency = Histogram("vit_serve_request_duration_seconds", "HTTP request latency by endpoint",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("vit_serve_queue_depth", "requests waiting for the model", registry=r)
        self.in_flight = Gauge("vit_serve_inflight_requests", "requests in the batch the model is running",
                               registry=r)
        self.batch_size = Histogram("vit_serve_batch_size", "images per model run", ["task"],
                                    buckets=BATCH_BUCKETS, registry=r)
        self.queue_wait = Histogram("vit_serve_queue_wait_seconds", "time from enqueue to the start of its batch",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.inference = Histogram("vit_serve_inference_seconds", "model run time per batch", ["task"],
                                   buckets=LATENCY_BUCKETS, registry=r)
        self.rejected = Counter("vit_serve_rejected", "requests refused by the batcher", ["reason"], registry=r)
        self.gpu_decode_fallbacks = Counter("vit_serve_gpu_decode_fallbacks",
                                            "uploads decoded on the CPU although GPU decoding is on, by reason",
                                            ["reason"], registry=r)
        self.ready = Gauge("vit_serve_ready", "1 when the model is loaded and warmed", registry=r)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
