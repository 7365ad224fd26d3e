"""The PyTorch backend: a checkpoint (any format `vit_serve.load` reads) run in eager mode.

classify in inference mode; explain with `vit_serve.explain.explain_forward` (any head fusion and discard ratio;
through the model's token merges, if set); grad_rollout with `vit_serve.explain.grad_rollout` (the only backend
with it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from vit_serve.explain import explain_forward, grad_rollout
from vit_serve.manifest import RolloutSettings, TokenMergingRecord, embedding_of
from vit_serve.preprocess import PreprocessConfig
from vit_serve.runtime.backends.base import LocalBackend, ModelInfo
from vit_serve.tome import TomeR


def _device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available to PyTorch")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


class TorchBackend(LocalBackend):
    name = "torch"
    supports_grad_rollout = True

    def __init__(self, checkpoint: str | Path, model_name: str | None = None, device: str = "auto",
                 threads: int | None = None, tome: TomeR | None = None) -> None:
        from vit_serve.checkpoints import load

        if threads is not None:
            torch.set_num_threads(threads)
        self.device = _device(device)
        self.model = load(checkpoint).eval().to(self.device)
        cfg = self.model.cfg
        if tome is not None:
            try:
                self.model.set_token_merging(tome)
            except ValueError as e:  # an r list longer than the model is deep
                raise ValueError(f"--tome for {Path(checkpoint).name}: {e}") from None
        res = (int(cfg.img_size[0]), int(cfg.img_size[1]))
        pre = self.model.preprocess_cfg or PreprocessConfig(input_size=res)
        self.info = ModelInfo(
            name=model_name or Path(checkpoint).stem,
            resolution=res,
            patch_size=cfg.patch_size,
            num_classes=cfg.num_classes,
            labels=self.model.labels,
            preprocess=pre.with_size(*res),
            explain=True,
            rollout=None,
            source=str(checkpoint),
            backend=self.name,
            device=str(self.device),
            pool=cfg.pool,
            embedding_dim=self.model.num_features,
            scores=cfg.scores,
            embedding=embedding_of(cfg),
            precision={torch.float16: "fp16", torch.bfloat16: "bf16"}.get(next(self.model.parameters()).dtype, "fp32"),
            token_merging=TokenMergingRecord.of(self.model.token_merging),
        )

    def _input(self, x: np.ndarray) -> torch.Tensor:
        if not x.flags.writeable:  # e.g. a view of a request body; torch tensors must own writable memory
            x = x.copy()
        return torch.from_numpy(x).to(self.device, non_blocking=True)

    @staticmethod
    def _out(t: torch.Tensor) -> np.ndarray:
        return t.detach().float().cpu().numpy()

    def classify(self, x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return self._out(self.model(self._input(x)))

    def embed(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with torch.inference_mode():
            logits, embedding = self.model.forward_embedding(self._input(x))
            return self._out(logits), self._out(embedding)

    def explain(self, x: np.ndarray, rollout_settings: RolloutSettings | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
        """Any head fusion and discard ratio (`rollout_settings`; None: the defaults)."""
        r = rollout_settings or self.info.resolve_rollout()
        with torch.inference_mode():
            e = explain_forward(self.model, self._input(x), r.head_fusion, r.discard_ratio)
        return self._out(e.logits), self._out(e.heatmap.map)

    def grad_rollout(self, x: np.ndarray, target: int | None = None) -> np.ndarray:
        return self._out(grad_rollout(self.model, self._input(x), target).map[0])
