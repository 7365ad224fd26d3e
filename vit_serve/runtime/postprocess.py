"""What a model's outputs become in an answer, whoever answers (HTTP, gRPC, offline prediction): the top-k classes of
a row of logits, the rollout payload of a map, and the L2-normalised embedding. Pure numpy, no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from vit_serve.embedding import l2_normalize

if TYPE_CHECKING:
    from vit_serve.manifest import RolloutSettings
    from vit_serve.runtime.backends.base import ModelInfo

__all__ = ["l2_normalize", "normalize_embedding", "rollout_payload", "rollout_query", "scores", "top_k"]


def scores(logits: np.ndarray, kind: str = "softmax") -> np.ndarray:
    """logits [K] -> float64 scores [K]: softmax (one label per image), or the element-wise sigmoid
    1 / (1 + exp(-z)) of SigLIP's heads (each label on its own; big_vision / open_clip's SigLIP zero-shot)."""
    z = logits.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        if kind == "sigmoid":
            return 0.5 * (1.0 + np.tanh(0.5 * z))  # = sigmoid(z), without exp overflow
        p = np.exp(z - z.max())
        return p / p.sum()


def top_k(logits: np.ndarray, k: int, info: ModelInfo) -> list[dict[str, Any]]:
    """logits [K] -> the k best classes as {"label", "index", "score" (softmax, or sigmoid when `info.scores`
    says so)}, best first (by logit: ties by index, NaN last). Non-finite logits give NaN scores, which the JSON
    encoder writes as null."""
    z = logits.astype(np.float64)
    p = scores(z, info.scores)
    best = np.argsort(-z, kind="stable")[:min(k, z.shape[0])]
    return [{"label": info.label(int(i)), "index": int(i), "score": float(p[i])} for i in best]


def rollout_query(pool: str) -> str:
    """Which rows of the rollout a map is read from: "cls" for token-pooled models, "patch-mean" for GAP ones,
    "map-probe" for attention-pooled ones (SigLIP), as `vit_serve.explain.QUERIES`."""
    from vit_serve.explain import QUERIES

    return QUERIES.get(pool, "patch-mean")


def rollout_payload(method: str, rollout: RolloutSettings | None, heat: np.ndarray, info: ModelInfo
                    ) -> dict[str, Any]:
    """A map heat [gh, gw] -> {"method", "head_fusion", "discard_ratio", "query", "grid": [gh, gw], "map": gh x gw
    floats}, as GET /explain?format=json and POST /classify?explain=true answer it (head_fusion and discard_ratio
    None when the method runs without rollout settings)."""
    return {"method": method,
            "head_fusion": rollout.head_fusion if rollout is not None else None,
            "discard_ratio": rollout.discard_ratio if rollout is not None else None,
            "query": rollout_query(info.pool), "grid": info.grid, "map": heat.tolist()}


def normalize_embedding(emb: np.ndarray, normalize: bool) -> np.ndarray:
    """emb [..., D] -> itself, or L2-normalised along D (float32) with `normalize`, as POST /embed?normalize=true."""
    return l2_normalize(emb) if normalize else emb
