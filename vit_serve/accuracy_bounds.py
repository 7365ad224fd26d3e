"""How close a reduced precision must stay to fp32 (issue 43): top-1 agreement and the outputs' cosine, measured.

    check = judge(fp32_logits, bf16_logits, "bf16")   # AccuracyCheck(agreement, cosine, ...), check.ok
    check.describe()                                  # "top-1 agreement 100.0% (>= 99.5%), cosine 0.99998 (>= 0.999)"

The bounds: bf16 and fp16 >= 99.5% top-1 agreement with fp32 and cosine >= 0.999; int8 >= 98% and >= 0.99. The
cosine judged is the mean over the inputs of each input's cosine (of the logits, and of the embedding when given:
the smaller mean); the smallest single one is reported beside it (`worst_cosine`), not judged: on a small model
with a fitted head an ambiguous input's logits are near zero and their direction is noise (int8 on the digits
model: mean 0.99+, smallest 0.90, with 99.2% top-1 agreement).
Plain numpy: the exporter (OpenVINO int8), the torch backend (bf16 autocast) and the benchmarks judge with it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

# precision -> (least top-1 agreement with fp32, least cosine to fp32)
BOUNDS: dict[str, tuple[float, float]] = {"bf16": (0.995, 0.999), "fp16": (0.995, 0.999), "int8": (0.98, 0.99)}


@dataclass(frozen=True)
class AccuracyCheck:
    """One precision against fp32 on `n` inputs: top-1 agreement, the mean cosine (judged) and the smallest, and
    the bounds."""

    precision: str
    n: int
    agreement: float
    cosine: float
    min_agreement: float
    min_cosine: float
    worst_cosine: float

    @property
    def ok(self) -> bool:
        return self.agreement >= self.min_agreement and self.cosine >= self.min_cosine

    def describe(self) -> str:
        return (f"{self.precision}: top-1 agreement {self.agreement:.1%} (>= {self.min_agreement:.1%}), cosine "
                f"{self.cosine:.5f} (>= {self.min_cosine:g}; smallest {self.worst_cosine:.4f}) on {self.n} inputs: "
                f"{'ok' if self.ok else 'below'}")

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def cosines(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    """The row-wise cosines of two [N, D] arrays (1.0 for two zero rows)."""
    a, b = np.asarray(ref, np.float64).reshape(len(ref), -1), np.asarray(got, np.float64).reshape(len(got), -1)
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    both_zero = (na == 0) & (nb == 0)
    cos = (a * b).sum(1) / np.maximum(na * nb, 1e-300)
    return np.where(both_zero, 1.0, cos)


def judge(ref: np.ndarray, got: np.ndarray, precision: str, embedding: tuple[np.ndarray, np.ndarray] | None = None
          ) -> AccuracyCheck:
    """`got` ([N, K] logits at `precision`) against `ref` (the fp32 logits of the same inputs); with `embedding`
    (fp32, reduced) the cosine is the smaller of the logits' and the embeddings'. KeyError for a precision without
    bounds."""
    lo_agree, lo_cos = BOUNDS[precision]
    ref, got = np.asarray(ref), np.asarray(got)
    if ref.shape != got.shape or not len(ref):
        raise ValueError(f"judge needs two non-empty arrays of one shape, got {ref.shape} and {got.shape}")
    agreement = float((ref.argmax(-1) == got.argmax(-1)).mean())
    rows = [cosines(ref, got)] + ([cosines(*embedding)] if embedding is not None else [])
    return AccuracyCheck(precision, len(ref), agreement, min(float(c.mean()) for c in rows), lo_agree, lo_cos,
                         min(float(c.min()) for c in rows))
