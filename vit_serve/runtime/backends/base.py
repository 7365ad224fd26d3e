"""What every serving backend provides: the model's metadata and batched logits / rollout on preprocessed tensors.

A backend never decodes images: the gateway preprocesses each upload with `vit_serve.preprocess` (the one
preprocessing function) at `info.resolution` and hands the backend float32 batches [B, 3, H, W].

A backend speaks one of two protocols. A `LocalBackend` (torch, onnxruntime, TensorRT) computes in the calling
thread, the model version's own model thread, and the gateway batches for it (`runner.BatchingRunner`). A
`RemoteBackend` (Triton) is asked over the network, concurrently, and its server batches
(`runner.DirectRunner`). Both take a `Task` whose rollout settings are resolved already.
"""

from __future__ import annotations

import abc
from collections.abc import Generator
from dataclasses import dataclass

import numpy as np

from vit_serve.fingerprint import EmbeddingSpace
from vit_serve.manifest import EMBEDDING, LOGITS, ROLLOUT, Embedding, RolloutSettings, TokenMergingRecord
from vit_serve.preprocess import PreprocessConfig
from vit_serve.reference_sketch import Reference
from vit_serve.runtime.accuracy_gate import GateResult
from vit_serve.runtime.runtime_choice import RuntimeChoice
from vit_serve.runtime.task import COSINE, GRID, PATCH_TOKENS, REST, Outputs, Task

__all__ = ["Backend", "LocalBackend", "ModelInfo", "RemoteBackend", "Staged"]


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
    Triton), explain_model (its explain model's name), max_batch_size (the config's). scores: how logits become
    scores ("softmax", or "sigmoid" for SigLIP heads); embedding: which image embedding the model gives and
    whether it is meant to be L2-normalised (None: an export from before the manifest said). token_merging: the
    token merging (ToMe) the model runs (None: none). compiled: classify / embed run a `torch.compile`d forward
    (the torch backend's --compile); torchscript: they run a TorchScript trace (--torchscript). reference: the
    in-distribution sketch OOD scores and drift compare with (`vit_serve.monitor`; None: the model carries none).
    max_patches: a NaFlex model's patch budget, the default and the most a request may ask (None: not NaFlex).
    device_name: the device as its runtime reports it (OpenVINO's FULL_DEVICE_NAME; "": not reported).
    accuracy: the accuracy gate's measurement of a reduced precision against fp32 (`runtime.accuracy_gate`;
    None: not measured, e.g. fp32).
    embedding_space: what decides its embedding vectors, as the model gives them (`vit_serve.fingerprint`; its
    `fingerprint` is what every embedding answer carries: `embedding_fingerprint`); None: an export from before
    manifests stated it.
    runtime_choice: the table of the runtimes timed at load and the one chosen (`runtime.runtime_choice`; None: no
    choice was made).
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
    embedding_dim: int = 0
    scores: str = "softmax"
    embedding: Embedding | None = None
    token_merging: TokenMergingRecord | None = None
    compiled: bool = False
    torchscript: bool = False
    reference: Reference | None = None
    max_patches: int | None = None
    device_name: str = ""
    accuracy: GateResult | None = None
    embedding_space: EmbeddingSpace | None = None
    runtime_choice: RuntimeChoice | None = None

    def embedding_fingerprint(self, normalized: bool = False, dim: int | None = None) -> str | None:
        """The fingerprint of its embedding vectors, L2-normalised or as the model gives them, cut to their first
        `dim` dimensions (Matryoshka; None: whole) (None: unknown)."""
        space = self.embedding_space
        return None if space is None else space.normalized_as(normalized).truncated(dim).fingerprint

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

    def resolve_rollout(self, head_fusion: str | None = None, discard_ratio: float | None = None
                        ) -> RolloutSettings:
        """The rollout settings a request gets (`rollout_settings`); ValueError (`rollout_mismatch`'s reason)
        when the exported graph cannot give them. The one place they are checked, for every backend."""
        why = self.rollout_mismatch(head_fusion, discard_ratio)
        if why:
            raise ValueError(why)
        return RolloutSettings(*self.rollout_settings(head_fusion, discard_ratio))


class Backend(abc.ABC):
    """A loaded model behind one runtime: its `info`, and one of the two protocols below."""

    name: str = "base"
    supports_grad_rollout: bool = False
    info: ModelInfo

    def _warmup_input(self) -> np.ndarray:
        h, w = self.info.resolution
        return np.zeros((1, 3, h, w), np.float32)


# A run in stages: each next() computes one stage (in whichever thread calls it); StopIteration's value is the outputs.
Staged = Generator[None, None, Outputs]


class LocalBackend(Backend):
    """Computes in the calling thread (the model version's model thread); the gateway batches for it."""

    # Whether batches may run in several threads at once on this one object (`RunnerLimits.instances`): a torch
    # module in inference mode and an onnxruntime session may; a TensorRT execution context may not.
    concurrent: bool = True

    def run(self, task: Task, x: np.ndarray) -> Outputs:
        """`task` on x [B, 3, H, W] float32 (NaFlex tasks: `naflex.pack`'s [B, 1 + M, K]) -> its outputs."""
        if task.max_patches is not None:
            if task.kind == "explain":
                logits, rollout = self.explain_patches(x, task.rollout)
                return {LOGITS: logits, ROLLOUT: rollout, GRID: x[:, 0, :2].round().astype(np.int64)}
            if task.kind not in ("classify", "embed"):
                raise ValueError(f"{task.kind} is not available for NaFlex inputs (max_patches); classify, embed or "
                                 f"explain with method=rollout")
            logits, embedding = self.embed_patches(x)
            return {LOGITS: logits} if task.kind == "classify" else {LOGITS: logits, EMBEDDING: embedding}
        if task.kind == "classify":
            return {LOGITS: self.classify(x)}
        if task.kind == "explain":
            logits, rollout = self.explain(x, task.rollout)
            return {LOGITS: logits, ROLLOUT: rollout}
        if task.kind == "embed":
            logits, embedding = self.embed(x)
            return {LOGITS: logits, EMBEDDING: embedding}
        if task.kind == "similarity":
            heat, cosine, rest = self.similarity(x, task.query, task.target, task.rollout)
            return {ROLLOUT: heat, COSINE: cosine, REST: rest}
        if task.kind == "patch_tokens":
            logits, embedding, tokens = self.patch_tokens(x, -1 if task.layer is None else task.layer)
            return {LOGITS: logits, EMBEDDING: embedding, PATCH_TOKENS: tokens}
        return {ROLLOUT: np.stack([self.grad_rollout(x[i:i + 1], task.target) for i in range(x.shape[0])])}

    def staged(self, task: Task, x: np.ndarray) -> Staged | None:
        """`run(task, x)` as a generator of its stages, each step one stage (the torch backend: the stem, each
        encoder block, the tail), its return value the outputs; a runner may pause between steps for more urgent
        work (`runner.BatchingRunner`). None where the task runs only whole (the default)."""
        return None

    def warmup(self) -> None:
        """Run one batch so the first request does not pay for lazy initialisation."""
        self.classify(self._warmup_input())

    @abc.abstractmethod
    def classify(self, x: np.ndarray) -> np.ndarray:
        """x [B, 3, H, W] float32 -> logits [B, K] float32."""

    def explain(self, x: np.ndarray, rollout: RolloutSettings | None = None) -> tuple[np.ndarray, np.ndarray]:
        """x [B, 3, H, W] -> (logits [B, K], rollout [B, gh, gw]) (`vit_serve.explain.rollout`) with `rollout`'s
        settings (None: the model's own, `info.resolve_rollout()`)."""
        raise NotImplementedError(f"the {self.name} backend has no explain graph")

    def embed(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """x [B, 3, H, W] -> (logits [B, K], embedding [B, D]): the pooled, pre-logits representation the head
        reads (timm's `forward_head(x, pre_logits=True)`), not normalised."""
        raise NotImplementedError(f"the model {self.info.name!r} has no embedding output (re-export it with "
                                  f"vit-export --outputs logits,embedding, or serve its checkpoint)")

    def embed_patches(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """NaFlex: `vit_serve.naflex.pack`'s [B, 1 + M, K] -> (logits [B, K'], embedding [B, D])."""
        raise NotImplementedError(f"NaFlex inputs (max_patches) need a NaFlex checkpoint on torch or its export "
                                  f"with vit-export --naflex on onnxruntime; the model {self.info.name!r} on "
                                  f"{self.name} has no NaFlex graph")

    def explain_patches(self, x: np.ndarray, rollout: RolloutSettings | None = None
                        ) -> tuple[np.ndarray, np.ndarray]:
        """NaFlex: `vit_serve.naflex.pack`'s [B, 1 + M, K] -> (logits [B, K'], rollout [B, M]: each image's map over
        its own grid, row-major, zeros past it; `vit_serve.explain.explain_patches`)."""
        raise NotImplementedError(f"NaFlex inputs (max_patches) need the torch backend (a checkpoint); the model "
                                  f"{self.info.name!r} runs on {self.name}")

    def grad_rollout(self, x: np.ndarray, target: int | None = None) -> np.ndarray:
        """x [1, 3, H, W] -> gradient rollout map [gh, gw] (torch backend only)."""
        raise NotImplementedError(f"grad_rollout needs the torch backend; this model runs on {self.name}")

    def similarity(self, x: np.ndarray, query: tuple[float, ...] | None, label: int | None,
                   rollout: RolloutSettings | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """x [B, 3, H, W] -> (map [B, gh, gw], cosine [B], rest [B]): each image's cosine with `query` (or the
        zero-shot head's row `label`) split over its patches (`vit_serve.similarity`), times the rollout with
        `rollout` settings (torch backend only)."""
        raise NotImplementedError(f"similarity maps need the torch backend (serve the checkpoint); this model runs "
                                  f"on {self.name}, whose graphs give no patch tokens")

    def patch_tokens(self, x: np.ndarray, layer: int = -1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """x [B, 3, H, W] -> (logits [B, K], embedding [B, E], block `layer`'s patch tokens [B, gh * gw, D])
        (torch backend only)."""
        raise NotImplementedError(f"patch tokens need the torch backend (serve the checkpoint); this model runs on "
                                  f"{self.name}, whose graphs give no patch tokens")

    def ready(self) -> bool:
        """Loaded and able to answer."""
        return True

    def close(self) -> None:
        """Release sessions."""


@dataclass(frozen=True)
class CallOptions:
    """What a call to a remote server carries besides its inputs: the seconds left to the request's deadline
    (None: it has none; the backend's own timeout still holds) and its priority level (Triton's: 1 first; 0:
    the server model's default level)."""

    timeout_s: float | None = None
    priority: int = 0


NO_OPTIONS = CallOptions()


class RemoteBackend(Backend):
    """A model on a server that batches concurrent requests itself; asked concurrently from the event loop."""

    @abc.abstractmethod
    async def run(self, task: Task, x: np.ndarray, options: CallOptions = NO_OPTIONS) -> Outputs:
        """`task` on x [B, 3, H, W] float32 -> its outputs (one request to the server, with `options`)."""

    async def warmup(self) -> None:
        await self.run(Task(), self._warmup_input())

    @abc.abstractmethod
    async def ready(self) -> bool:
        """The server and the model answer."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections."""
