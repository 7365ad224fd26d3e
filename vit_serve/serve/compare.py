"""Live agreement between a model's primary version and its shadow or canaries (`traffic.Mirror` feeds it).

Per (model, other version), a window of the last `compare_window` request pairs (primary answer, other answer on
the same input) gives, over the images of the window:

* top-1 agreement: the share of images whose argmax logit is the same class;
* mean |logit delta|: the mean over images of mean_k |logits_primary - logits_other| (null when the two have
  different class counts);
* embedding cosine: the mean over images of the cosine of the two embeddings, when both answers carry one (an
  /embed request); else null;
* latency p50 / p99 of each side: its queue wait + model run (`Result.queue_ms + infer_ms`; the decode is
  shared by both), per request.

Prometheus (the gateway's registry): gauges `vit_serve_compare_top1_agreement`, `vit_serve_compare_logit_abs_delta`,
`vit_serve_compare_embedding_cosine` {model, version} (version: the other one), counter
`vit_serve_compare_pairs_total` {model, version, role}, histogram `vit_serve_compare_latency_seconds` {model,
version, role} (version: the one that ran, role: primary, shadow or canary). A window restarts when its primary
changes, and a model's windows when its policy is replaced (`ModelRepository.set_traffic`).
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass
from typing import Literal

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vit_serve.manifest import EMBEDDING, LOGITS
from vit_serve.runtime.metrics import LATENCY_BUCKETS, MODEL
from vit_serve.runtime.scheduling import Result

Role = Literal["shadow", "canary"]


@dataclass(frozen=True)
class Pair:
    """One request's comparison: sums over its images, and each side's latency (seconds)."""

    images: int
    agree: int
    abs_delta_sum: float | None  # sum over images of mean_k |delta|; None: class counts differ
    cosine_sum: float | None  # sum over images of the embeddings' cosine; None: not both have one
    primary_s: float
    other_s: float


def pair_of(primary: Result, other: Result) -> Pair:
    """The comparison of two answers to one input (logits [B, K] each, embeddings [B, D] when present)."""
    a = np.asarray(primary.outputs[LOGITS], dtype=np.float64)
    b = np.asarray(other.outputs[LOGITS], dtype=np.float64)
    agree = int((a.argmax(axis=1) == b.argmax(axis=1)).sum())
    delta = float(np.abs(a - b).mean(axis=1).sum()) if a.shape == b.shape else None
    cosine = None
    ea, eb = primary.outputs.get(EMBEDDING), other.outputs.get(EMBEDDING)
    if ea is not None and eb is not None and ea.shape == eb.shape:
        ea, eb = np.asarray(ea, dtype=np.float64), np.asarray(eb, dtype=np.float64)
        norms = np.linalg.norm(ea, axis=1) * np.linalg.norm(eb, axis=1)
        cosine = float(((ea * eb).sum(axis=1) / np.maximum(norms, 1e-12)).sum())
    return Pair(a.shape[0], agree, delta, cosine, seconds(primary), seconds(other))


def seconds(result: Result) -> float:
    return (result.queue_ms + result.infer_ms) / 1e3


@dataclass(frozen=True)
class Latency:
    p50_ms: float
    p99_ms: float


@dataclass(frozen=True)
class Agreement:
    """A window's numbers (`GET /models/NAME/compare`)."""

    version: int  # the shadow or canary
    primary: int
    role: Role
    pairs: int
    images: int
    top1_agreement: float | None
    logit_abs_delta: float | None
    embedding_cosine: float | None
    primary_latency: Latency | None
    other_latency: Latency | None


class Window:
    """The last `size` pairs of one (model, other version) against one primary."""

    def __init__(self, size: int, primary: int, role: Role) -> None:
        self.pairs: deque[Pair] = deque(maxlen=size)
        self.primary, self.role = primary, role

    def summary(self, version: int) -> Agreement:
        pairs = list(self.pairs)
        images = sum(p.images for p in pairs)
        deltas = [p for p in pairs if p.abs_delta_sum is not None]
        cosines = [p for p in pairs if p.cosine_sum is not None]

        def mean(sums: list[float], n: int) -> float | None:
            return sum(sums) / n if n else None

        def latency(values: list[float]) -> Latency | None:
            if not values:
                return None
            p50, p99 = np.percentile(np.asarray(values) * 1e3, [50, 99])
            return Latency(float(p50), float(p99))

        return Agreement(
            version, self.primary, self.role, len(pairs), images,
            mean([p.agree for p in pairs], images),
            mean([p.abs_delta_sum for p in deltas if p.abs_delta_sum is not None], sum(p.images for p in deltas)),
            mean([p.cosine_sum for p in cosines if p.cosine_sum is not None], sum(p.images for p in cosines)),
            latency([p.primary_s for p in pairs]), latency([p.other_s for p in pairs]))


class Compare:
    """The windows of every model, and their Prometheus series."""

    def __init__(self, registry: CollectorRegistry, window: int = 1000) -> None:
        self.size = window
        self.windows: dict[tuple[str, int], Window] = {}
        r = registry
        self.top1 = Gauge("vit_serve_compare_top1_agreement", "share of images whose top-1 class the primary and "
                          "this shadow / canary version agree on, over the compare window", MODEL, registry=r)
        self.delta = Gauge("vit_serve_compare_logit_abs_delta", "mean |logit delta| between the primary and this "
                           "version, over the compare window", MODEL, registry=r)
        self.cosine = Gauge("vit_serve_compare_embedding_cosine", "mean cosine of the primary's and this "
                            "version's embeddings (embed requests), over the compare window", MODEL, registry=r)
        self.pairs = Counter("vit_serve_compare_pairs", "request pairs compared (primary and this version on the "
                             "same input)", [*MODEL, "role"], registry=r)
        self.latency = Histogram("vit_serve_compare_latency_seconds", "queue wait + model run of each side of a "
                                 "compared pair, by the version that ran it and its role", [*MODEL, "role"],
                                 buckets=LATENCY_BUCKETS, registry=r)

    def add(self, model: str, primary: int, other: int, role: Role, primary_answer: Result,
            other_answer: Result) -> Pair:
        """Record one pair: `primary_answer` from version `primary`, `other_answer` from `other` (its `role`)."""
        pair = pair_of(primary_answer, other_answer)
        key = (model, other)
        window = self.windows.get(key)
        if window is None or window.primary != primary or window.role != role:
            window = self.windows[key] = Window(self.size, primary, role)
        window.pairs.append(pair)
        labels = (model, str(other))
        self.pairs.labels(*labels, role).inc()
        self.latency.labels(model, str(primary), "primary").observe(pair.primary_s)
        self.latency.labels(*labels, role).observe(pair.other_s)
        s = window.summary(other)
        for gauge, value in ((self.top1, s.top1_agreement), (self.delta, s.logit_abs_delta),
                             (self.cosine, s.embedding_cosine)):
            if value is not None:
                gauge.labels(*labels).set(value)
        return pair

    def summaries(self, model: str) -> list[Agreement]:
        """The windows of `model`, by other version."""
        return [w.summary(v) for (m, v), w in sorted(self.windows.items()) if m == model]

    def forget(self, model: str, version: int | None = None) -> None:
        """Drop the windows (and gauges) of `model` (one other `version`, or all)."""
        for key in [k for k in self.windows if k[0] == model and (version is None or k[1] == version)]:
            del self.windows[key]
            for gauge in (self.top1, self.delta, self.cosine):
                with contextlib.suppress(KeyError):
                    gauge.remove(model, str(key[1]))
