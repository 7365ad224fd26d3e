"""The reference: a model's in-distribution sketch, the typed and versioned record that the checkpoint and the
export manifest carry (`Reference.to_dict` / `from_dict`) and that OOD scores and drift compare with.

Pure numpy and data: the scoring, the fit and the drift statistics are `vit_serve.monitor`'s. The manifest and the
checkpoint readers stand on this module alone.
"""

from __future__ import annotations

import base64
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

REFERENCE_VERSION = 1
OodMethod = Literal["mahalanobis", "energy"]
OOD_METHODS: tuple[str, ...] = ("mahalanobis", "energy")
DEFAULT_QUANTILE = 0.95  # the OOD flag's threshold: this quantile of the calibration scores
SHRINKAGE = 1e-3  # added to every eigenvalue, times their mean: a direction with no variance is not infinitely sure
ARRAYS = ("mean", "basis", "eigvals", "scores", "confidences", "projections", "classes")


def _encode(a: np.ndarray) -> dict[str, Any]:
    a = np.ascontiguousarray(a, np.float32)
    return {"shape": list(a.shape), "float32": base64.b64encode(a.tobytes()).decode("ascii")}


def _decode(d: Any, what: str) -> np.ndarray:
    if not isinstance(d, dict) or set(d) != {"shape", "float32"} or not isinstance(d["float32"], str) \
            or not isinstance(d["shape"], list) or not all(isinstance(s, int) and s >= 0 for s in d["shape"]):
        raise ValueError(f"reference: {what} must be {{'shape': [...], 'float32': base64}}")
    try:
        raw = base64.b64decode(d["float32"], validate=True)
    except ValueError as e:
        raise ValueError(f"reference: {what} is not valid base64") from e
    if len(raw) != 4 * math.prod(d["shape"]):
        raise ValueError(f"reference: {what} holds {len(raw)} bytes, its shape {d['shape']} needs "
                         f"{4 * math.prod(d['shape'])}")
    return np.frombuffer(raw, np.float32).reshape(d["shape"]).copy()


@dataclass(frozen=True, eq=False)
class Reference:
    """A model's in-distribution sketch (see the module docstring).

    method: how `ood_scores` scores. mean [D], basis [D, k] (orthonormal principal directions, largest first),
    eigvals [k] (their variances), residual_var (the mean variance left outside the basis; 0 at full rank): the
    Gaussian of the fit sample's embeddings (empty arrays for "energy"). Calibration (images not fitted: a
    validation split, or half of a reference folder): scores [n], confidences [n], projections [n, p] (onto the
    first p = `vit_serve.monitor.PROJECTIONS` directions, centred), classes [n] (the top-1 index), as float32.
    threshold: the `quantile` of the calibration scores. n_fit: images in the fit. source: where the images came
    from, for people.
    """

    method: OodMethod
    mean: np.ndarray
    basis: np.ndarray
    eigvals: np.ndarray
    residual_var: float
    scores: np.ndarray
    confidences: np.ndarray
    projections: np.ndarray
    classes: np.ndarray
    threshold: float
    quantile: float = DEFAULT_QUANTILE
    n_fit: int = 0
    num_classes: int = 0
    source: str = ""
    version: int = field(default=REFERENCE_VERSION)

    @functools.cached_property
    def gaussian(self) -> Gaussian:
        """The Gaussian in float64 with its inverse variances, made on first use (scoring reads it per request)."""
        return Gaussian.of(self.mean, self.basis, self.eigvals, self.residual_var)

    @property
    def needs_embedding(self) -> bool:
        return self.method == "mahalanobis"

    @property
    def dim(self) -> int:
        return int(self.mean.shape[0])

    def class_shares(self) -> np.ndarray:
        """Each class's share of the calibration sample's top-1 answers [K]."""
        return np.bincount(self.classes.astype(np.int64), minlength=self.num_classes)[:self.num_classes] / max(
            len(self.classes), 1)

    def to_dict(self) -> dict[str, Any]:
        arrays = {k: _encode(getattr(self, k)) for k in ARRAYS}
        return {"version": self.version, "method": self.method, "residual_var": self.residual_var,
                "threshold": self.threshold, "quantile": self.quantile, "n_fit": self.n_fit,
                "num_classes": self.num_classes, "source": self.source, **arrays}

    @classmethod
    def from_dict(cls, d: Any) -> Reference:
        """The reference `to_dict` wrote; ValueError naming what is wrong (a newer version, a missing field)."""
        if not isinstance(d, dict):
            raise ValueError("reference: must be a JSON object")
        if d.get("version") != REFERENCE_VERSION:
            raise ValueError(f"reference: version {d.get('version')!r} is not readable (this release reads "
                             f"{REFERENCE_VERSION}; written by a newer vit-serve?)")
        missing = {"method", "threshold", "quantile", "residual_var", *ARRAYS} - set(d)
        if missing:
            raise ValueError(f"reference: missing {', '.join(sorted(missing))}")
        if d["method"] not in OOD_METHODS:
            raise ValueError(f"reference: method must be one of {', '.join(OOD_METHODS)}, got {d['method']!r}")
        for k in ("threshold", "quantile", "residual_var"):
            if not isinstance(d[k], (int, float)) or isinstance(d[k], bool):
                raise ValueError(f"reference: {k} must be a number")
        arrays = {k: _decode(d[k], k) for k in ARRAYS}
        ref = cls(method=d["method"], residual_var=float(d["residual_var"]), threshold=float(d["threshold"]),
                  quantile=float(d["quantile"]), n_fit=int(d.get("n_fit", 0)), num_classes=int(d.get("num_classes", 0)),
                  source=str(d.get("source", "")), **arrays)
        n = len(ref.scores)
        if not (len(ref.confidences) == len(ref.classes) == len(ref.projections) == n) or \
                ref.basis.shape[:1] != ref.mean.shape or ref.basis.shape[1:] != ref.eigvals.shape:
            raise ValueError("reference: its arrays' shapes do not agree")
        return ref

    def describe(self) -> str:
        what = f"Mahalanobis on the {self.dim}-d embedding" if self.needs_embedding else "energy of the logits"
        return (f"{what}; flag above the {self.quantile:g} quantile ({self.threshold:.4g}) of {len(self.scores)} "
                f"calibration images; fitted on {self.n_fit} ({self.source or 'images'})")


@dataclass(frozen=True)
class Gaussian:
    """A reference's Gaussian in float64, with the shrunk inverse variances: what scoring needs, made once."""

    mean: np.ndarray
    basis: np.ndarray
    inv_var: np.ndarray
    inv_residual: float  # 0 at full rank

    @classmethod
    def of(cls, mean: np.ndarray, basis: np.ndarray, eigvals: np.ndarray, residual_var: float) -> Gaussian:
        lam = eigvals.astype(np.float64)
        s = SHRINKAGE * max(float(lam.mean()), 1e-12) if len(lam) else 1.0
        full = basis.shape[1] >= basis.shape[0]
        return cls(mean.astype(np.float64), basis.astype(np.float64), 1.0 / (lam + s),
                   0.0 if full else 1.0 / (residual_var + s))
