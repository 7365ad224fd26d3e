"""Watching what a model serves: the reference of its training data, per-image OOD scores and drift over windows.

Pure numpy. The pieces:
- `Reference` (its type is `vit_serve.reference_sketch`'s, which the manifest and checkpoints read without this
  math): a compact sketch of a model's in-distribution embeddings: the embeddings' mean and principal directions
  (a low-rank Gaussian, at most `MAX_RANK` directions, `fit_gaussian`), and a calibration sample (scores,
  confidences, projections, predicted classes) that sets the OOD threshold and is what drift is measured against
  (`build_reference`).
- `ood_scores`: higher for images unlike the reference, from the pass that answered (embedding and logits).
  "mahalanobis" (Lee et al., NeurIPS 2018, with one Gaussian for all classes, on the pre-logits embedding) for
  models that give an embedding, "energy" (Liu et al., NeurIPS 2020: -logsumexp of the logits) otherwise. Chosen
  by measurement (benchmarks/monitoring.py): on the quickstart's digits model, AUROC held-out digits vs photo
  crops 0.99 for Mahalanobis against 0.96 for kNN (Sun et al. 2022), 0.91 for energy, 0.90 for max-softmax.
- `abstain_threshold`: the zero-shot abstention's threshold on the best label's score, from the calibration
  confidences.
- `drift`: the window against the reference's calibration sample, one two-sample Kolmogorov-Smirnov test per
  feature (the first `PROJECTIONS` principal projections of the embedding, the confidence, the OOD score),
  Bonferroni-corrected: the "univariate KS on a low-dimensional representation" that Rabanser et al. (NeurIPS
  2019, "Failing loudly") found the most reliable shift detector. The statistic is the largest KS distance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from vit_serve.reference_sketch import DEFAULT_QUANTILE, Gaussian, OodMethod, Reference

MAX_RANK = 256  # principal directions kept: 768 x 256 float32 = 0.8 MB for a ViT-B
PROJECTIONS = 8  # the embedding's principal projections the drift test compares
MAX_SAMPLE = 2000  # calibration points kept
DEFAULT_SIGNIFICANCE = 0.01
DEFAULT_MIN_WINDOW = 100
TOP_CLASSES = 5


def softmax_confidence(logits: np.ndarray, scores: str = "softmax") -> np.ndarray:
    """logits [B, K] -> the top-1 score [B]: the largest softmax probability (or sigmoid, for SigLIP-style heads)."""
    z = np.asarray(logits, np.float64)
    if scores == "sigmoid":
        return (1.0 / (1.0 + np.exp(-z.max(-1)))).astype(np.float32)
    z = z - z.max(-1, keepdims=True)
    return (1.0 / np.exp(z).sum(-1)).astype(np.float32)


def abstain_threshold(ref: Reference) -> float:
    """The top-1 score below which zero-shot abstention answers "none of these": the (1 - `ref.quantile`)
    quantile of the reference's calibration confidences (the top-1 score of each held-out in-distribution image),
    so that the share of in-distribution images that abstain is the share the OOD flag flags (5% at 0.95)."""
    if len(ref.confidences) == 0:
        raise ValueError("the reference holds no calibration confidences")
    return float(np.quantile(np.asarray(ref.confidences, np.float64), 1.0 - ref.quantile))


def energy(logits: np.ndarray) -> np.ndarray:
    """logits [B, K] -> the negative free energy's opposite, -logsumexp(logits) [B] (Liu et al. 2020, T=1):
    higher is less like the training data."""
    z = np.asarray(logits, np.float64)
    m = z.max(-1)
    return (-(m + np.log(np.exp(z - m[:, None]).sum(-1)))).astype(np.float32)


def fit_gaussian(embeddings: np.ndarray, rank: int = MAX_RANK) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """embeddings [N, D] -> (mean [D], basis [D, k], eigvals [k], residual_var): the sample covariance's k = min(D,
    rank, N - 1) largest eigenpairs and the mean of the others (float64 inside, float32 out)."""
    e = np.asarray(embeddings, np.float64)
    if e.ndim != 2 or len(e) < 2:
        raise ValueError(f"a reference needs at least 2 embeddings [N, D], got shape {list(e.shape)}")
    mean = e.mean(0)
    cov = np.cov(e - mean, rowvar=False).reshape(e.shape[1], e.shape[1])
    w, v = np.linalg.eigh(cov)
    w, v = np.clip(w[::-1], 0.0, None), v[:, ::-1]
    k = max(1, min(e.shape[1], rank, len(e) - 1))
    rest = w[k:]
    return (mean.astype(np.float32), v[:, :k].astype(np.float32), w[:k].astype(np.float32),
            float(rest.mean()) if len(rest) else 0.0)


def mahalanobis(embeddings: np.ndarray, mean: np.ndarray, basis: np.ndarray, eigvals: np.ndarray,
                residual_var: float) -> np.ndarray:
    """embeddings [B, D] -> squared Mahalanobis distances [B] to the low-rank Gaussian: sum_j (v_j . (e - mu))^2 /
    (lambda_j + s) over the basis, plus ||the residual||^2 / (residual_var + s), s = SHRINKAGE x mean(lambda)
    (at full rank, exactly (e - mu)^T (Sigma + s I)^-1 (e - mu))."""
    return _mahalanobis(Gaussian.of(mean, basis, eigvals, residual_var), embeddings)[0]


def _mahalanobis(g: Gaussian, embeddings: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(squared distances [B] float32, the centred embeddings on the basis [B, k] float64).

    By np.einsum rather than a BLAS product: a gateway scores one request's few rows on its event loop, where a
    threaded BLAS call contends with the model's threads for the cores (under load it took a third of the event
    loop's time)."""
    d = np.asarray(embeddings, np.float64) - g.mean
    p = np.einsum("bd,dk->bk", d, g.basis)
    score = np.einsum("bk,k->b", p * p, g.inv_var)
    if g.inv_residual:
        resid = np.einsum("bd,bd->b", d, d) - np.einsum("bk,bk->b", p, p)
        score += np.maximum(resid, 0.0) * g.inv_residual
    return score.astype(np.float32), p


def score(ref: Reference, logits: np.ndarray, embeddings: np.ndarray | None = None
          ) -> tuple[np.ndarray, np.ndarray]:
    """One pass's (OOD scores [B], drift projections [B, p]) by `ref.method`, from logits [B, K] and embeddings
    [B, D] (needed for "mahalanobis"): `ood_scores` and `project` from one product."""
    if ref.method == "energy":
        return energy(logits), project(ref, None, logits)
    if embeddings is None:
        raise ValueError("the reference scores the embedding, and this pass gave none")
    scores, p = _mahalanobis(ref.gaussian, embeddings)
    return scores, p[:, :PROJECTIONS].astype(np.float32)


def ood_scores(ref: Reference, logits: np.ndarray, embeddings: np.ndarray | None = None) -> np.ndarray:
    """[B] scores by `ref.method` from the pass that answered: logits [B, K], embeddings [B, D] (needed for
    "mahalanobis")."""
    return score(ref, logits, embeddings)[0]


def project(ref: Reference, embeddings: np.ndarray | None, logits: np.ndarray) -> np.ndarray:
    """[B, p] the centred embeddings on the reference's first p = PROJECTIONS directions (an "energy" reference:
    the first PROJECTIONS logits)."""
    if ref.needs_embedding and embeddings is not None:
        g = ref.gaussian
        d = np.asarray(embeddings, np.float64) - g.mean
        return np.einsum("bd,dk->bk", d, g.basis[:, :PROJECTIONS]).astype(np.float32)  # einsum: see _mahalanobis
    z = np.asarray(logits, np.float32)
    return z[:, :min(PROJECTIONS, z.shape[1])]


def build_reference(fit_embeddings: np.ndarray | None, fit_logits: np.ndarray, calib_embeddings: np.ndarray | None,
                    calib_logits: np.ndarray, *, quantile: float = DEFAULT_QUANTILE, rank: int = MAX_RANK,
                    scores: str = "softmax", source: str = "", max_sample: int = MAX_SAMPLE,
                    seed: int = 0) -> Reference:
    """The reference of a model from two disjoint sets of its outputs: the fit set's embeddings [N, D] (None:
    an "energy" reference) and logits [N, K]; the calibration set's [M, D] / [M, K], which set the threshold and
    the drift sample (at most `max_sample` of them, drawn with `seed`)."""
    if not 0.5 <= quantile < 1:
        raise ValueError(f"reference quantile must be in [0.5, 1), got {quantile}")
    calib_logits = np.asarray(calib_logits, np.float32)
    if len(calib_logits) < 2:
        raise ValueError("a reference needs at least 2 calibration images")
    if len(calib_logits) > max_sample:
        keep = np.sort(np.random.default_rng(seed).choice(len(calib_logits), max_sample, replace=False))
        calib_logits = calib_logits[keep]
        calib_embeddings = None if calib_embeddings is None else np.asarray(calib_embeddings)[keep]
    if fit_embeddings is not None:
        mean, basis, eigvals, resid = fit_gaussian(fit_embeddings, rank)
        method: OodMethod = "mahalanobis"
    else:
        mean, basis, eigvals, resid = (np.zeros(0, np.float32), np.zeros((0, 0), np.float32),
                                       np.zeros(0, np.float32), 0.0)
        method = "energy"
    ref = Reference(method=method, mean=mean, basis=basis, eigvals=eigvals, residual_var=resid,
                    scores=np.zeros(0, np.float32), confidences=np.zeros(0, np.float32),
                    projections=np.zeros((0, PROJECTIONS), np.float32), classes=np.zeros(0, np.float32),
                    threshold=0.0, quantile=quantile, n_fit=len(fit_logits), num_classes=calib_logits.shape[1],
                    source=source)
    s = ood_scores(ref, calib_logits, calib_embeddings)
    return Reference(method=method, mean=mean, basis=basis, eigvals=eigvals, residual_var=resid, scores=s,
                     confidences=softmax_confidence(calib_logits, scores),
                     projections=project(ref, calib_embeddings, calib_logits),
                     classes=calib_logits.argmax(-1).astype(np.float32),
                     threshold=float(np.quantile(s.astype(np.float64), quantile)), quantile=quantile,
                     n_fit=len(fit_logits), num_classes=calib_logits.shape[1], source=source)


# ---- drift ----------------------------------------------------------------------------------------------------


def ks_2samp(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Two-sample Kolmogorov-Smirnov: (D = sup |F_a - F_b|, its asymptotic p-value Q_KS(sqrt(n m / (n + m)) D)),
    as `scipy.stats.ks_2samp`'s statistic and `scipy.special.kolmogorov` of the scaled statistic."""
    a = np.sort(np.asarray(a, np.float64))
    b = np.sort(np.asarray(b, np.float64))
    n, m = len(a), len(b)
    if n == 0 or m == 0:
        return 0.0, 1.0
    grid = np.concatenate([a, b])
    d = float(np.abs(np.searchsorted(a, grid, "right") / n - np.searchsorted(b, grid, "right") / m).max())
    return d, kolmogorov_sf(math.sqrt(n * m / (n + m)) * d)


def kolmogorov_sf(z: float) -> float:
    """The Kolmogorov distribution's survival function Q(z) = 2 sum_{k>=1} (-1)^(k-1) exp(-2 k^2 z^2)
    (`scipy.special.kolmogorov`); for small z, 1 - sqrt(2 pi)/z sum_k exp(-(2k-1)^2 pi^2 / (8 z^2))."""
    if z <= 0:
        return 1.0
    if z < 1.0:
        s = sum(math.exp(-((2 * k - 1) ** 2) * math.pi ** 2 / (8 * z * z)) for k in range(1, 8))
        return min(1.0, max(0.0, 1.0 - math.sqrt(2 * math.pi) / z * s))
    s = sum((-1) ** (k - 1) * math.exp(-2 * k * k * z * z) for k in range(1, 101))
    return min(1.0, max(0.0, 2 * s))


FEATURES = ("confidence", "ood_score", *(f"projection_{i}" for i in range(PROJECTIONS)))


@dataclass(frozen=True)
class DriftReport:
    """A window against the reference. statistic: the largest KS distance over the features; p_value: the
    smallest p-value times the number of tests (Bonferroni, at most 1); alarm: p_value < significance with at
    least min_window images. features: each feature's (distance, p-value). classes: the classes whose share of
    top-1 answers moved most, (index, reference share, window share), largest |change| first."""

    window: int
    statistic: float
    p_value: float
    alarm: bool
    significance: float
    min_window: int
    features: dict[str, tuple[float, float]]
    classes: list[tuple[int, float, float]]
    ood_rate: float


def drift(ref: Reference, confidences: np.ndarray, scores: np.ndarray, projections: np.ndarray,
          classes: np.ndarray, significance: float = DEFAULT_SIGNIFICANCE,
          min_window: int = DEFAULT_MIN_WINDOW) -> DriftReport:
    """The window (confidences [W], OOD scores [W], projections [W, p], top-1 classes [W]) against `ref`."""
    w = len(scores)
    feats: dict[str, tuple[float, float]] = {
        "confidence": ks_2samp(confidences, ref.confidences), "ood_score": ks_2samp(scores, ref.scores)}
    p = min(projections.shape[1] if projections.ndim == 2 else 0, ref.projections.shape[1])
    for i in range(p):
        feats[f"projection_{i}"] = ks_2samp(projections[:, i], ref.projections[:, i])
    stat = max(d for d, _ in feats.values()) if w else 0.0
    pv = min(1.0, min(p for _, p in feats.values()) * len(feats)) if w else 1.0
    k = max(ref.num_classes, int(classes.max()) + 1 if w else 0)
    before = np.bincount(ref.classes.astype(np.int64), minlength=k) / max(len(ref.classes), 1)
    after = np.bincount(np.asarray(classes, np.int64), minlength=k) / max(w, 1)
    order = np.argsort(-np.abs(after - before), kind="stable")[:TOP_CLASSES]
    moved = [(int(i), float(before[i]), float(after[i])) for i in order if w and after[i] != before[i]]
    return DriftReport(window=w, statistic=float(stat), p_value=float(pv),
                       alarm=bool(w >= min_window and pv < significance), significance=significance,
                       min_window=min_window, features=feats, classes=moved,
                       ood_rate=float((np.asarray(scores) > ref.threshold).mean()) if w else 0.0)


class Window:
    """The last `size` answers of one model version (not thread-safe: one event loop appends and reads)."""

    def __init__(self, ref: Reference, size: int = 500) -> None:
        self.ref, self.size = ref, size
        p = ref.projections.shape[1] if ref.projections.ndim == 2 else 0
        self._conf = np.zeros(size, np.float32)
        self._score = np.zeros(size, np.float32)
        self._proj = np.zeros((size, p), np.float32)
        self._cls = np.zeros(size, np.int64)
        self.count = 0  # answers ever added

    def add(self, confidences: np.ndarray, scores: np.ndarray, projections: np.ndarray, classes: np.ndarray
            ) -> None:
        for i in range(len(scores)):
            j = self.count % self.size
            self._conf[j], self._score[j], self._cls[j] = confidences[i], scores[i], classes[i]
            self._proj[j] = projections[i, :self._proj.shape[1]]
            self.count += 1

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        n = min(self.count, self.size)
        return self._conf[:n], self._score[:n], self._proj[:n], self._cls[:n]

    def report(self, significance: float = DEFAULT_SIGNIFICANCE, min_window: int = DEFAULT_MIN_WINDOW
               ) -> DriftReport:
        return drift(self.ref, *self.arrays(), significance=significance, min_window=min_window)


@dataclass(frozen=True)
class Histogram:
    """Counts of the window's and the reference's OOD scores on shared bin edges [bins + 1]."""

    edges: list[float]
    window: list[int]
    reference: list[int]


def score_histogram(ref: Reference, scores: np.ndarray, bins: int = 30) -> Histogram:
    """The window's scores and the reference's calibration scores binned alike: `bins` equal bins from the smallest
    to the largest score of either (the top bin closed)."""
    both = np.concatenate([np.asarray(ref.scores, np.float64), np.asarray(scores, np.float64)])
    lo, hi = (float(both.min()), float(both.max())) if len(both) else (0.0, 1.0)
    edges = np.linspace(lo, hi if hi > lo else lo + 1.0, bins + 1)
    return Histogram([float(e) for e in edges], np.histogram(scores, edges)[0].tolist(),
                     np.histogram(ref.scores, edges)[0].tolist())
