"""What every serving backend provides: the model's metadata and batched logits / rollout on preprocessed tensors.

A backend never decodes images: the gateway preprocesses each upload with `vit_serve.preprocess` (the one
preprocessing function) at `info.resolution` and hands the backend float32 batches [B, 3, H, W].
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np

from vit_serve.manifest import RolloutSettings
from vit_serve.preprocess import PreprocessConfig


class BackendUnavailableError(RuntimeError):
    """The backend cannot answer now (e.g. the Triton server is down); the gateway answers 503."""


@dataclass(frozen=True)
class ModelInfo:
    """Metadata the gateway needs, whatever the backend.

    name: model name shown to clients; resolution: (H, W) the backend expects; patch_size: P (rollout grid is
    H/P x W/P); labels: K class names (None -> "class_<i>"); preprocess: the contract (its input_size equals
    resolution); explain: whether `explain` is available; rollout: the explain graph's fixed settings when it
    cannot take others (exported graphs), None when any are allowed.

    backend: the backend's name; device: where the model runs, "cpu", "cuda", "cuda:N", or "remote" (a Triton
    server); pool: "token" or "gap" (what a rollout map is queried from); precision: the weights' ("fp32",
    "fp16", "bf16", "int8"); dynamic_resolution: an export that takes any multiple of the patch size (served at
    `resolution`). providers: onnxruntime's execution providers. Triton only: runtime (what runs the model in
    Triton), explain_model (its explain model's name), max_batch_size (the config's).
    """

    name: str
    resolution: tuple[int, int]
    patch_size: int
    num_classes: int
    labels: list[str] | None
    preprocess: PreprocessConfig
    explain: bool = True
    rollout: RolloutSettings | None = None
    source: str = ""
    backend: str = ""
    device: str = "cpu"
    pool: str = "token"
    precision: str = "fp32"
    dynamic_resolution: bool = False
    providers: tuple[str, ...] = ()
    runtime: str = ""
    explain_model: str | None = None
    max_batch_size: int = 0

    @property
    def grid(self) -> tuple[int, int]:
        return self.resolution[0] // self.patch_size, self.resolution[1] // self.patch_size

    def label(self, i: int) -> str:
        return self.labels[i] if self.labels and i < len(self.labels) else f"class_{i}"

    def rollout_settings(self, head_fusion: str | None = None, discard_ratio: float | None = None
                         ) -> tuple[str, float]:
        """The settings a rollout runs with: those asked for, else the explain graph's fixed ones, else the
        defaults (`vit_serve.explain.DEFAULT_HEAD_FUSION` / `DEFAULT_DISCARD_RATIO`)."""
        fixed = self.rollout or RolloutSettings()
        return (head_fusion or fixed.head_fusion,
                float(fixed.discard_ratio if discard_ratio is None else discard_ratio))

    def rollout_mismatch(self, head_fusion: str | None = None, discard_ratio: float | None = None) -> str | None:
        """Why the explain graph cannot give these settings (its own are baked in), or None if it can."""
        if self.rollout is None:
            return None
        hf, dr = self.rollout_settings(head_fusion, discard_ratio)
        if self.rollout.matches(hf, dr):
            return None
        fixed_hf, fixed_dr = self.rollout.head_fusion, self.rollout.discard_ratio
        return (f"the exported explain graph computes rollout with head_fusion={fixed_hf} and "
                f"discard_ratio={fixed_dr:g} only (asked: head_fusion={hf}, discard_ratio={dr:g}); omit both, "
                f"re-export with vit-export --head-fusion/--discard-ratio, or serve the checkpoint with the "
                f"torch backend")


class Backend(abc.ABC):
    """A loaded model behind one runtime. Sync methods run off the event loop (the batcher calls them in a
    worker thread); the Triton backend overrides the async ones instead."""

    name: str = "base"
    supports_grad_rollout: bool = False
    # True for Triton: requests go straight to `aclassify` / `aexplain` one by one and the server batches them.
    batches_itself: bool = False
    info: ModelInfo

    def warmup(self) -> None:
        """Run one batch so the first request does not pay for lazy initialisation."""
        h, w = self.info.resolution
        self.classify(np.zeros((1, 3, h, w), np.float32))

    @abc.abstractmethod
    def classify(self, x: np.ndarray) -> np.ndarray:
        """x [B, 3, H, W] float32 -> logits [B, K] float32."""

    def explain(self, x: np.ndarray, head_fusion: str = "mean", discard_ratio: float = 0.9
                ) -> tuple[np.ndarray, np.ndarray]:
        """x [B, 3, H, W] -> (logits [B, K], rollout [B, gh, gw]) (`vit_serve.explain.rollout`)."""
        raise NotImplementedError(f"the {self.name} backend has no explain graph")

    def grad_rollout(self, x: np.ndarray, target: int | None = None) -> np.ndarray:
        """x [1, 3, H, W] -> gradient rollout map [gh, gw] (torch backend only)."""
        raise NotImplementedError(f"grad_rollout needs the torch backend; this server runs {self.name}")

    async def aclassify(self, x: np.ndarray) -> np.ndarray:
        """Async form, used instead of the gateway's batcher when `batches_itself`."""
        raise NotImplementedError

    async def aexplain(self, x: np.ndarray, head_fusion: str = "mean", discard_ratio: float = 0.9
                       ) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def ready(self) -> bool:
        """Loaded, warmed and reachable."""
        return True

    def close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing to release
        """Release sessions / connections."""
