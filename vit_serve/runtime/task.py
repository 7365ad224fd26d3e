"""What the model computes for a request: a `Task`. Requests whose tasks are equal share a batch.

Outputs are named as in the exported graphs and the Open Inference Protocol: "logits" [B, K], "rollout"
[B, gh, gw] and "embedding" [B, D] (the pre-logits representation, `forward_head(pre_logits=True)`), float32.
An explain task carries its rollout settings resolved once, by the model version that takes the request
(`ModelInfo.resolve_rollout`): backends run them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from vit_serve.manifest import RolloutSettings

Outputs = dict[str, np.ndarray]
TaskKind = Literal["classify", "explain", "embed", "grad_rollout", "similarity", "patch_tokens"]


@dataclass(frozen=True)
class Task:
    """classify: logits; explain: logits + attention rollout with `rollout`; embed: logits + embedding (not
    normalised); grad_rollout: gradient-weighted rollout of class `target` (None: each image's top-1; the torch
    backend only); similarity: the map of each image's cosine with `query` (or with the zero-shot head's row
    `target`) over its patches, times the rollout with `rollout` set ("rollout" [B, gh, gw], "cosine" [B], "rest"
    [B]; `vit_serve.similarity`, the torch backend only); patch_tokens: block `layer`'s patch tokens [B, gh * gw,
    D] ("patch_tokens", beside logits and embedding; the torch backend only)."""

    kind: TaskKind = "classify"
    rollout: RolloutSettings | None = None
    target: int | None = None
    # NaFlex (SigLIP 2): x is `vit_serve.naflex.pack`'s [B, 1 + max_patches, P*P*C], not [B, 3, H, W]; only
    # requests of one budget share a batch (classify, embed and explain: its "rollout" is then [B, max_patches],
    # each image's map row-major over its own grid, which "grid" [B, 2] gives).
    max_patches: int | None = None
    query: tuple[float, ...] | None = None
    layer: int | None = None


GRID = "grid"  # NaFlex explain: each image's patch grid (h, w), beside its flat "rollout"
COSINE, REST = "cosine", "rest"  # similarity: the image's cosine with the query, and the part no patch holds
PATCH_TOKENS = "patch_tokens"


CLASSIFY = Task()
EMBED = Task("embed")
