"""Prometheus metrics of one gateway, in its own CollectorRegistry (several apps in one process do not clash).

HTTP metrics are by endpoint; what happens inside a model (queue, batches, inference, refusals, readiness,
memory) is labelled by model and version, through the `ModelMetrics` view each loaded version gets.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
MODEL = ("model", "version")


class GatewayMetrics:
    """Requests by endpoint and status, latencies; per model version: queue depth, batch sizes, waits, runs."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("vit_serve_requests", "HTTP requests by endpoint (route template) and status",
                                ["endpoint", "method", "status"], registry=r)
        self.latency = Histogram("vit_serve_request_duration_seconds", "HTTP request latency by endpoint",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("vit_serve_queue_depth", "requests waiting for the model", MODEL, registry=r)
        self.in_flight = Gauge("vit_serve_inflight_requests", "requests in the batch the model is running", MODEL,
                               registry=r)
        self.batch_size = Histogram("vit_serve_batch_size", "images per model run", ["task", *MODEL],
                                    buckets=BATCH_BUCKETS, registry=r)
        self.queue_wait = Histogram("vit_serve_queue_wait_seconds", "time from enqueue to the start of its batch",
                                    MODEL, buckets=LATENCY_BUCKETS, registry=r)
        self.inference = Histogram("vit_serve_inference_seconds", "model run time per batch", ["task", *MODEL],
                                   buckets=LATENCY_BUCKETS, registry=r)
        self.rejected = Counter("vit_serve_rejected", "requests refused by the batcher", ["reason", *MODEL],
                                registry=r)
        self.gpu_decode_fallbacks = Counter("vit_serve_gpu_decode_fallbacks",
                                            "uploads decoded on the CPU although GPU decoding is on, by reason",
                                            ["reason"], registry=r)
        self.ready = Gauge("vit_serve_ready", "1 when the model version is loaded, warmed and answering", MODEL,
                           registry=r)
        self.memory = Gauge("vit_serve_model_memory_bytes", "resident memory the model version took to load and "
                            "warm up (the process's RSS before and after)", MODEL, registry=r)

    def for_model(self, name: str, version: str) -> ModelMetrics:
        return ModelMetrics(self, name, version)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)


class ModelMetrics:
    """The metrics of one model version (its label values filled in)."""

    def __init__(self, m: GatewayMetrics, name: str, version: str) -> None:
        self._m, self._labels = m, (name, version)
        self.queue_depth = m.queue_depth.labels(*self._labels)
        self.in_flight = m.in_flight.labels(*self._labels)
        self.queue_wait = m.queue_wait.labels(*self._labels)
        self.ready = m.ready.labels(*self._labels)
        self.memory = m.memory.labels(*self._labels)

    def batch_size(self, task: str) -> Histogram:
        return self._m.batch_size.labels(task, *self._labels)

    def inference(self, task: str) -> Histogram:
        return self._m.inference.labels(task, *self._labels)

    def rejected(self, reason: str) -> Counter:
        return self._m.rejected.labels(reason, *self._labels)

    def remove(self) -> None:
        """Drop this version's gauges (unloaded: it no longer has a queue or memory); counters stay."""
        for gauge in (self._m.queue_depth, self._m.in_flight, self._m.ready, self._m.memory):
            with contextlib.suppress(KeyError):
                gauge.remove(*self._labels)
