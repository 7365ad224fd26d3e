"""The image embedding: the pre-logits representation a ViT's head reads, and its L2 normalisation.

The embedding of an image is `model.forward_head(model.forward_features(x), pre_logits=True)` [B, D]: the [class]
token (or the patch-token mean for GAP models) after the final LayerNorm and the optional pre-logits layer, as
timm's `forward_head(x, pre_logits=True)`. Retrieval and deduplication compare embeddings by cosine similarity,
which is the dot product of normalised ones.
"""

from __future__ import annotations

import numpy as np

EPS = 1e-12  # torch.nn.functional.normalize's default: a zero vector stays zero instead of becoming NaN


def l2_normalize(x: np.ndarray, eps: float = EPS) -> np.ndarray:
    """x [..., D] -> x / max(||x||_2, eps) along the last axis, float32 (`torch.nn.functional.normalize(x, dim=-1)`;
    the norm is computed in float64)."""
    x64 = np.asarray(x, np.float64)
    norm = np.linalg.norm(x64, axis=-1, keepdims=True)
    return (x64 / np.maximum(norm, eps)).astype(np.float32)
