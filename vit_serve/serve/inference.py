"""What the model computes for a request (a `Task`), on a batch, on any backend.

Requests whose tasks are equal share a batch. Outputs are named as in the exported graphs and the Open
Inference Protocol: "logits" [B, K] and "rollout" [B, gh, gw], float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from vit_serve.serve.backends.base import Backend

Outputs = dict[str, np.ndarray]
TaskKind = Literal["classify", "explain", "grad_rollout"]


@dataclass(frozen=True)
class Task:
    """classify: logits; explain: logits + attention rollout; grad_rollout: gradient-weighted rollout (torch)."""

    kind: TaskKind = "classify"
    head_fusion: str = "mean"
    discard_ratio: float = 0.9
    target: int | None = None  # grad_rollout: class to explain (None: each image's top-1)


CLASSIFY = Task()


def run(backend: Backend, task: Task, x: np.ndarray) -> Outputs:
    """Run `task` on x [B, 3, H, W] float32 in the calling thread (the gateway's model thread)."""
    if task.kind == "classify":
        return {"logits": backend.classify(x)}
    if task.kind == "explain":
        logits, rollout = backend.explain(x, task.head_fusion, task.discard_ratio)
        return {"logits": logits, "rollout": rollout}
    maps = [backend.grad_rollout(x[i:i + 1], task.target) for i in range(x.shape[0])]
    return {"rollout": np.stack(maps)}


async def arun(backend: Backend, task: Task, x: np.ndarray) -> Outputs:
    """Same, for backends that batch on their own (`batches_itself`, e.g. Triton)."""
    if task.kind == "classify":
        return {"logits": await backend.aclassify(x)}
    if task.kind == "explain":
        logits, rollout = await backend.aexplain(x, task.head_fusion, task.discard_ratio)
        return {"logits": logits, "rollout": rollout}
    raise NotImplementedError(f"grad_rollout needs the torch backend; this server runs {backend.name}")
