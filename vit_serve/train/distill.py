"""DeiT's distillation (Touvron et al. 2021) through the distillation token: the loss and the frozen teacher.

The loss is facebookresearch/deit `losses.py` `DistillationLoss`: (1 - alpha) x the base loss on the [class]
head + alpha x, for "hard", CE(dist head, argmax teacher), or, for "soft", KL(log_softmax(dist / tau) ||
log_softmax(teacher / tau)) summed, x tau² / (B x K) (DeiT divides by `numel`). The teacher is one of our
checkpoints (any format `vit_serve.checkpoints.load` reads) or an ONNX export (onnxruntime), fed the student's
batch, renormalised to the teacher's own mean / std when they differ.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from vit_serve.train.config import DISTILL_TYPES, OptionError


def distillation_loss(base_loss: torch.Tensor, dist_logits: torch.Tensor, teacher_logits: torch.Tensor,
                      kind: str, alpha: float = 0.5, tau: float = 1.0) -> torch.Tensor:
    """DeiT's DistillationLoss on the dist head's logits [B, K] and the teacher's [B, K]; a scalar."""
    if kind == "soft":
        kd = F.kl_div(F.log_softmax(dist_logits / tau, dim=1), F.log_softmax(teacher_logits / tau, dim=1),
                      reduction="sum", log_target=True) * (tau * tau) / dist_logits.numel()
    elif kind == "hard":
        kd = F.cross_entropy(dist_logits, teacher_logits.argmax(dim=1))
    else:
        raise ValueError(f"distillation {kind!r}; expected one of {', '.join(DISTILL_TYPES)}")
    return base_loss * (1 - alpha) + kd * alpha


class Teacher:
    """A frozen classifier: the student's normalised batch [B, 3, H, W] -> logits [B, K] (float32, no grad)."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], num_classes: int | None,
                 labels: Sequence[str] | None, norm: tuple[Sequence[float], Sequence[float]] | None,
                 source: str, static_size: tuple[int, int] | None = None) -> None:
        self.fn, self.num_classes, self.source, self.static_size = fn, num_classes, source, static_size
        self.labels = list(labels) if labels else None
        self.norm = norm  # the teacher's (mean, std), None: the student's
        self._renorm: tuple[torch.Tensor, torch.Tensor] | None = None

    def fit_student(self, num_classes: int, classes: Sequence[str], size: tuple[int, int], mean: Sequence[float],
                    std: Sequence[float]) -> None:
        """Check the teacher answers over the student's classes at its input size (H, W); set up the
        renormalisation to the teacher's mean / std."""
        if self.static_size is not None and tuple(self.static_size) != tuple(size):
            h, w = self.static_size
            raise OptionError(f"teacher {self.source} takes {h}x{w} inputs, the student trains at {size[0]}x{size[1]}"
                              "; export it with dynamic resolution or train at its size")
        if self.num_classes is not None and self.num_classes != num_classes:
            raise OptionError(f"teacher {self.source} has {self.num_classes} classes, the data set {num_classes}")
        if self.labels is not None and list(classes) != self.labels:
            raise OptionError(f"teacher {self.source} has other class names than the data set "
                              f"(first: {self.labels[:3]} vs {list(classes)[:3]})")
        if self.norm is not None and (tuple(self.norm[0]), tuple(self.norm[1])) != (tuple(mean), tuple(std)):
            s_mean, s_std = (torch.tensor(v, dtype=torch.float32).view(1, -1, 1, 1) for v in (mean, std))
            t_mean, t_std = (torch.tensor(v, dtype=torch.float32).view(1, -1, 1, 1) for v in self.norm)
            # teacher input = (x * s_std + s_mean - t_mean) / t_std = x * scale + shift
            self._renorm = (s_std / t_std, (s_mean - t_mean) / t_std)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._renorm is not None:
            scale, shift = (t.to(x.device) for t in self._renorm)
            x = x * scale + shift
        return self.fn(x).float()


def _checkpoint_teacher(path: str, device: torch.device) -> Teacher:
    from vit_serve.checkpoints import load

    model = load(path).to(device).eval()
    model.requires_grad_(False)
    pre = model.preprocess_cfg
    return Teacher(model, model.cfg.num_classes or None, model.labels,
                   (pre.mean, pre.std) if pre is not None else None, path)


def _onnx_teacher(path: str, device: torch.device) -> Teacher:
    try:
        import onnxruntime as ort
    except ImportError as e:
        raise OptionError(f"an ONNX teacher needs onnxruntime ({e})") from None
    from vit_serve.manifest import find_manifest, read_manifest

    providers = ["CUDAExecutionProvider"] if device.type == "cuda" else []
    sess = ort.InferenceSession(path, providers=[*providers, "CPUExecutionProvider"])
    inp, outs = sess.get_inputs()[0], [o.name for o in sess.get_outputs()]
    out = "logits" if "logits" in outs else outs[0]
    side = find_manifest(path)
    manifest = read_manifest(side) if side.is_file() else None
    static = [d for d in inp.shape[2:] if isinstance(d, int)]
    k = sess.get_outputs()[outs.index(out)].shape[-1]

    def run(x: torch.Tensor) -> torch.Tensor:
        y = sess.run([out], {inp.name: x.detach().float().cpu().numpy()})[0]
        return torch.from_numpy(np.asarray(y)).to(x.device)

    norm = (manifest.preprocess.mean, manifest.preprocess.std) if manifest is not None else None
    return Teacher(run, k if isinstance(k, int) else None, manifest.labels if manifest else None, norm, path,
                   static_size=(static[0], static[1]) if len(static) == 2 else None)


def load_teacher(path: str, device: torch.device) -> Teacher:
    """The teacher at `path`: an `.onnx` export (its manifest beside it, if any) or any checkpoint we read."""
    if not Path(path).exists():
        raise OptionError(f"teacher {path} does not exist")
    return _onnx_teacher(path, device) if path.endswith(".onnx") else _checkpoint_teacher(path, device)
