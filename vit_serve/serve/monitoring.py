"""What the gateway watches of a served version whose model carries a reference (`vit_serve.monitor`): each
answer's OOD score, from the pass that answered, and a window of recent answers whose drift from the reference
is measured when asked (GET /models/NAME/drift; for /metrics at most once per `drift_refresh_s`), never on a
request's path.

`VersionMonitor` is one version's: `observe` takes a pass's outputs (the logits, and the embedding for a
Mahalanobis reference: such versions answer /classify with the embed task, which gives both, and batches with
/embed), scores them, adds them to the window and to the per-image histograms; its `report` is computed when
asked (cached until its window grows). /metrics is open to scrapers and may be scraped at any rate, so what a
scrape shows is `scraped()`: the last report, computed again only when `drift_refresh_s` has passed since and the
window has grown (a scrape costs a lookup, whatever the rate: the KS tests run at most once per period).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from vit_serve.manifest import EMBEDDING, LOGITS
from vit_serve.monitor import DriftReport, Reference, Window, score, softmax_confidence
from vit_serve.runtime.backends.base import ModelInfo
from vit_serve.runtime.task import CLASSIFY, EMBED, Outputs, Task
from vit_serve.serve.metrics import ModelMetrics
from vit_serve.serve.settings import MonitoringSettings

log = logging.getLogger("vit_serve.serve")

NO_REFERENCE = ("no reference: OOD scores and drift are off (export with vit-export --reference-images DIR, "
                "images like its training data, or train with vit-serve train, which keeps one)")


class VersionMonitor:
    """One served version's OOD scoring and drift window (not thread-safe: the event loop observes and reads)."""

    def __init__(self, ref: Reference, scores: str, settings: MonitoringSettings,
                 metrics: ModelMetrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.ref, self.scores = ref, scores
        self.window = Window(ref, settings.drift_window)
        self.significance, self.min_window = settings.drift_significance, settings.drift_min_window
        self.refresh_s, self._clock = settings.drift_refresh_s, clock
        self._scraped: tuple[float, int, DriftReport] | None = None  # /metrics': (when, window count, report)
        # the per-image histograms' series of this version (made only for versions with a reference)
        self._histograms = None if metrics is None else (metrics.confidence, metrics.ood_ratio)
        # score -> its ratio to the threshold (vit_serve_ood_score_ratio): 1 is the flag's threshold
        scale = ref.threshold
        self._origin = 0.0
        if ref.method != "mahalanobis" or ref.threshold <= 0:  # energies are negative: from the calibration median
            self._origin = float(np.median(ref.scores)) if len(ref.scores) else 0.0
            scale = ref.threshold - self._origin
        self._scale = scale if scale > 0 else 1.0
        self._report: tuple[int, DriftReport] | None = None

    @classmethod
    def of(cls, info: ModelInfo, settings: MonitoringSettings, metrics: ModelMetrics | None = None
           ) -> VersionMonitor | None:
        """The monitor of a version (None: monitoring off, no reference, or one this model cannot be scored
        with, logged)."""
        ref = info.reference
        if not settings.monitoring or ref is None:
            return None
        if ref.needs_embedding and ref.dim != info.embedding_dim:
            log.warning("%s: its reference scores a %d-d embedding and the model gives %s; OOD scores and drift "
                        "are off (re-export it with vit-export --outputs logits,embedding)", info.name, ref.dim,
                        f"a {info.embedding_dim}-d one" if info.embedding_dim else "none")
            return None
        if ref.num_classes and ref.num_classes != info.num_classes:
            log.warning("%s: its reference was made for %d classes, the model has %d; OOD scores and drift are off",
                        info.name, ref.num_classes, info.num_classes)
            return None
        return cls(ref, info.scores, settings, metrics)

    @property
    def task(self) -> Task:
        """The task /classify runs: the embed task when the score needs the embedding (one pass gives both)."""
        return EMBED if self.ref.needs_embedding else CLASSIFY

    def ratio(self, scores: np.ndarray) -> np.ndarray:
        """Scores relative to the threshold (1: the threshold): score / threshold for Mahalanobis; for energy
        (negative) (score - the calibration median) / (threshold - that median)."""
        return (np.asarray(scores, np.float64) - self._origin) / self._scale

    def observe(self, outputs: Outputs) -> np.ndarray | None:
        """A pass's OOD scores [B], added to the window and the histograms; None when the pass lacks what the
        score needs (an explain pass of a Mahalanobis reference: no embedding)."""
        logits, embedding = outputs.get(LOGITS), outputs.get(EMBEDDING)
        if logits is None or (self.ref.needs_embedding and embedding is None):
            return None
        scores, projections = score(self.ref, logits, embedding)
        confidences = softmax_confidence(logits, self.scores)
        self.window.add(confidences, scores, projections, np.asarray(logits).argmax(-1))
        if self._histograms is not None:
            confidence, ratio = self._histograms
            for c, r in zip(confidences.tolist(), self.ratio(scores).tolist(), strict=True):
                confidence.observe(c)
                ratio.observe(r)
        return scores

    def answer(self, score: float) -> dict[str, Any]:
        """One image's `ood` in a /classify answer."""
        return {"score": float(score), "flag": bool(score > self.ref.threshold), "method": self.ref.method,
                "threshold": self.ref.threshold}

    def report(self) -> DriftReport:
        """The window's drift report, computed again only when the window has grown since."""
        count = self.window.count
        if self._report is None or self._report[0] != count:
            self._report = (count, self.window.report(self.significance, self.min_window))
        return self._report[1]

    def scraped(self) -> DriftReport:
        """The report /metrics shows: the last one computed, computed again only once `refresh_s` has passed
        since and the window has grown (a scrape, at whatever rate, is otherwise a lookup)."""
        now, count = self._clock(), self.window.count
        shown = self._scraped
        if shown is None or (shown[1] != count and now - shown[0] >= self.refresh_s):
            self._scraped = shown = (now, count, self.report())
        return shown[2]

    def describe(self) -> dict[str, Any]:
        """What GET /models shows of it (`schemas.MonitoringInfo`)."""
        ref = self.ref
        return {"method": ref.method, "threshold": ref.threshold, "quantile": ref.quantile,
                "calibration_images": len(ref.scores), "description": ref.describe()}
