"""Prometheus metrics of one gateway, in its own CollectorRegistry (several apps in one process do not clash).

HTTP metrics are by endpoint; what happens inside a model (queue, batches, inference, refusals, readiness,
memory) is labelled by model and version, through the `ModelMetrics` view each loaded version gets.

A version reloaded in place (same name and version, new files) has two `ModelMetrics` for one label set for a
while: the gauges of that label set belong to one of them at a time (`publish`, when the new one is switched in),
so that the old one's last writes and its unload (`remove`) never touch the series the new one sets.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from vit_serve.monitor import DriftReport
from vit_serve.runtime.metrics import BATCH_BUCKETS, LATENCY_BUCKETS, MODEL
from vit_serve.runtime.scheduling.ticket import Ticket

CONFIDENCE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
OOD_RATIO_BUCKETS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0, 8.0)


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
        self.rejected = Counter("vit_serve_rejected", "requests refused by the batcher: queue_full, shed (for a "
                                "more urgent one), deadline (passed, or not to be met), timeout", ["reason", *MODEL],
                                registry=r)
        self.cancelled = Counter("vit_serve_cancelled", "requests whose client went away (HTTP hang-up, gRPC cancel) "
                                 "by the stage they had reached: read, decode, queue (dropped, not run), infer (its "
                                 "batch had started)", ["stage", *MODEL], registry=r)
        self.preempted = Counter("vit_serve_preempted", "times a less urgent batch run in stages gave its model "
                                 "instance to a more urgent request, between two encoder blocks", MODEL, registry=r)
        self.gpu_decode_fallbacks = Counter("vit_serve_gpu_decode_fallbacks",
                                            "uploads decoded on the CPU although GPU decoding is on, by reason",
                                            ["reason"], registry=r)
        self.store_rejected = Counter("vit_serve_store_rejected", "explain-store entries ignored because their "
                                      "seal (an HMAC with the store secret) failed: written without the secret, or "
                                      "moved from another key", registry=r)
        self.samples_dropped = Counter("vit_serve_samples_dropped", "requests the payload sampler drew but did not "
                                       "keep, by reason: queue_full, write_failed, disk_full (sampling has stopped)",
                                       ["reason"], registry=r)
        self.label_cache = Counter("vit_serve_label_cache", "labels of POST /classify?labels= (and the v2 labels "
                                   "parameter) found in the text tower's LRU cache (hit) or encoded (miss)",
                                   ["result", *MODEL], registry=r)
        self.ready = Gauge("vit_serve_ready", "1 when the model version is loaded, warmed and answering", MODEL,
                           registry=r)
        self.memory = Gauge("vit_serve_model_memory_bytes", "resident memory the model version took to load and "
                            "warm up (the process's RSS before and after)", MODEL, registry=r)
        # Versions whose model carries a reference (vit_serve.serve.monitoring): per answered image.
        self.confidence = Histogram("vit_serve_confidence", "top-1 score (softmax, or sigmoid) of each image "
                                    "answered by a version with a reference", MODEL, buckets=CONFIDENCE_BUCKETS,
                                    registry=r)
        self.ood_ratio = Histogram("vit_serve_ood_score_ratio", "each image's OOD score relative to its version's "
                                   "threshold, so that models compare (1: the threshold; above: flagged): score / "
                                   "threshold for Mahalanobis, (score - calibration median) / (threshold - "
                                   "calibration median) for energy", MODEL, buckets=OOD_RATIO_BUCKETS, registry=r)
        # The drift gauges (vit_serve_drift, _alarm, _p_value, _window_images), read at scrape time from
        # `drift_reports()` (the gateway sets it: (model, version, report) of each monitored version; a report is
        # computed at most once per drift_refresh_s, never by the scrape's own count).
        self.drift_reports: Callable[[], Iterable[tuple[str, str, DriftReport]]] = tuple
        r.register(DriftCollector(lambda: self.drift_reports()))
        self._owners: dict[tuple[str, str], ModelMetrics] = {}  # whose values the gauges of a label set show

    def for_model(self, name: str, version: str) -> ModelMetrics:
        """A loaded version's view. Its gauges are exposed at once when no other version has these labels, else
        once it is `publish`ed (switched in)."""
        view = ModelMetrics(self, name, version)
        if view.labels not in self._owners:
            view.publish()
        return view

    def caller_left(self, ticket: Ticket) -> None:
        """`ticket`'s caller went away (HTTP hang-up, gRPC cancel): counted in vit_serve_cancelled_total at the
        stage it had reached, unless it was counted before or a runner holds it (`Ticket.caller_left`)."""
        if ticket.caller_left():
            self.cancelled.labels(ticket.stage, ticket.model, ticket.version).inc()

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)


class VersionGauge:
    """One gauge of one version: its value kept here, and written to the exposed series while the version owns
    its label set."""

    def __init__(self, family: Gauge, view: ModelMetrics) -> None:
        self._family, self._view = family, view
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = float(value)
        if self._view.published:
            self._family.labels(*self._view.labels).set(self.value)

    def expose(self) -> None:
        self._family.labels(*self._view.labels).set(self.value)

    def remove(self) -> None:
        with contextlib.suppress(KeyError):
            self._family.remove(*self._view.labels)


class ModelMetrics:
    """The metrics of one model version (its label values filled in). Counters and histograms are shared by every
    version with the same labels; the gauges are this version's own (`VersionGauge`)."""

    def __init__(self, m: GatewayMetrics, name: str, version: str) -> None:
        self._m, self.labels = m, (name, version)
        self.queue_depth = VersionGauge(m.queue_depth, self)
        self.in_flight = VersionGauge(m.in_flight, self)
        self.ready = VersionGauge(m.ready, self)
        self.memory = VersionGauge(m.memory, self)
        self.queue_wait = m.queue_wait.labels(*self.labels)
        self.preempted = m.preempted.labels(*self.labels)

    @property
    def _gauges(self) -> tuple[VersionGauge, ...]:
        return self.queue_depth, self.in_flight, self.ready, self.memory

    @property
    def published(self) -> bool:
        """Whether the exposed gauges of (model, version) are this version's."""
        return self._m._owners.get(self.labels) is self

    def publish(self) -> None:
        """This version is switched in: the gauges of its labels show its values from now on (a version it
        replaces in place keeps writing to its own copies only)."""
        self._m._owners[self.labels] = self
        for gauge in self._gauges:
            gauge.expose()

    @property
    def confidence(self) -> Histogram:
        """Top-1 scores of the images it answered (versions with a reference: series only for those)."""
        return self._m.confidence.labels(*self.labels)

    @property
    def ood_ratio(self) -> Histogram:
        return self._m.ood_ratio.labels(*self.labels)

    def batch_size(self, task: str) -> Histogram:
        return self._m.batch_size.labels(task, *self.labels)

    def inference(self, task: str) -> Histogram:
        return self._m.inference.labels(task, *self.labels)

    def rejected(self, reason: str) -> Counter:
        return self._m.rejected.labels(reason, *self.labels)

    def cancelled(self, stage: str) -> Counter:
        return self._m.cancelled.labels(stage, *self.labels)

    def label_cache(self, result: str) -> Counter:
        """Labels of requests with labels found in the text tower's cache ("hit") or encoded ("miss")."""
        return self._m.label_cache.labels(result, *self.labels)

    def remove(self) -> None:
        """Drop this version's gauges (unloaded: it no longer has a queue or memory) unless another version of the
        same labels owns them now; counters stay."""
        if not self.published:
            return
        del self._m._owners[self.labels]
        for gauge in self._gauges:
            gauge.remove()


class RunnerEvents:
    """A runner's events (`vit_serve.runtime.scheduling.events.SchedulerEvents`) counted in a version's metrics."""

    def __init__(self, metrics: ModelMetrics) -> None:
        self.metrics = metrics

    def queued(self, depth: int) -> None:
        self.metrics.queue_depth.set(depth)

    def running(self, rows: int) -> None:
        self.metrics.in_flight.set(rows)

    def rejected(self, reason: str) -> None:
        self.metrics.rejected(reason).inc()

    def shed(self) -> None:
        self.metrics.rejected("shed").inc()

    def batch(self, kind: str, rows: int, waits_s: list[float]) -> None:
        for wait in waits_s:
            self.metrics.queue_wait.observe(wait)
        self.metrics.batch_size(kind).observe(rows)

    def ran(self, kind: str, seconds: float) -> None:
        self.metrics.inference(kind).observe(seconds)

    def preempted(self) -> None:
        self.metrics.preempted.inc()

    def cancelled(self, stage: str) -> None:
        self.metrics.cancelled(stage).inc()


class DriftCollector(Collector):
    """The drift gauges of every monitored version, from `reports()`: (model, version, its drift report), asked
    when /metrics is scraped (`vit_serve.serve.monitoring.VersionMonitor.scraped`: the last report, computed again
    at most once per drift_refresh_s)."""

    def __init__(self, reports: Callable[[], Iterable[tuple[str, str, DriftReport]]]) -> None:
        self.reports = reports

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, ...]:
        labels = list(MODEL)
        return (GaugeMetricFamily("vit_serve_drift", "the largest two-sample KS distance between the version's "
                                  "window of recent answers and its reference (confidence, OOD score, embedding "
                                  "projections)", labels=labels),
                GaugeMetricFamily("vit_serve_drift_alarm", "1 when the window drifted: its Bonferroni-corrected KS "
                                  "p-value is below drift_significance, with at least drift_min_window images",
                                  labels=labels),
                GaugeMetricFamily("vit_serve_drift_p_value", "the window's smallest KS p-value times the number of "
                                  "features compared (Bonferroni, at most 1)", labels=labels),
                GaugeMetricFamily("vit_serve_drift_window_images", "images of the window the drift gauges were "
                                  "computed on (they are computed again at most once per drift_refresh_s)",
                                  labels=labels))

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        drift, alarm, p_value, images = families = self._families()
        for name, version, r in self.reports():
            drift.add_metric([name, version], r.statistic)
            alarm.add_metric([name, version], float(r.alarm))
            p_value.add_metric([name, version], r.p_value)
            images.add_metric([name, version], r.window)
        yield from families
