"""Training-time data augmentation: Inception crop, flip, RandAugment, Mixup / CutMix and the soft-target loss.

Every transform decodes with :func:`~vit_serve.preprocess.load_image` and ends in the same
:func:`~vit_serve.preprocess.to_tensor` normalisation as evaluation, which is exactly
:func:`~vit_serve.preprocess.preprocess`. All randomness comes from torch's global RNG, so a seeded run (or
``vit_serve.train.seeded.SeededTransform``) is deterministic. torchvision (``transforms.v2``) is needed only
for :func:`train_transform` and is imported when it is called.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image

from vit_serve.preprocess import ImageSource, PreprocessConfig, load_image, preprocess, resize_and_crop, to_tensor

__all__ = [
    "INCEPTION_CROP_RATIO",
    "INCEPTION_CROP_SCALE",
    "MixParams",
    "MixupCutmix",
    "TrainTransform",
    "cutmix_box",
    "eval_transform",
    "parse_randaugment",
    "soft_target_cross_entropy",
    "train_transform",
]

# big_vision's inception_crop(area_min=5): sample_distorted_bounding_box with area 5-100 %, aspect 3/4-4/3.
INCEPTION_CROP_SCALE: tuple[float, float] = (0.05, 1.0)
INCEPTION_CROP_RATIO: tuple[float, float] = (3 / 4, 4 / 3)

_RANDAUG_MAX_MAGNITUDE = 10  # timm's scale: "m9" is 9/10 of each op's largest strength
_RANDAUG_RE = re.compile(r"rand(?:-(?:m\d+|n\d+))*")


def parse_randaugment(spec: str) -> tuple[int, int]:
    """Parse a timm-style RandAugment spec ``"rand-m<magnitude>-n<ops>"`` into ``(magnitude, num_ops)``.

    The magnitude is on timm's 0..10 scale (default 9), the number of ops per image at least 1 (default 2);
    either part may be omitted ("rand-m9", "rand"). Anything else raises ``ValueError``.
    """
    if not isinstance(spec, str) or not _RANDAUG_RE.fullmatch(spec):
        raise ValueError(f"bad RandAugment spec {spec!r}; expected 'rand-m<magnitude>-n<ops>', e.g. 'rand-m9-n2'")
    magnitude, num_ops = 9, 2
    seen = set()
    for part in spec.split("-")[1:]:
        key, value = part[0], int(part[1:])
        if key in seen:
            raise ValueError(f"bad RandAugment spec {spec!r}: {key!r} given twice")
        seen.add(key)
        if key == "m":
            magnitude = value
        else:
            num_ops = value
    if not 0 <= magnitude <= _RANDAUG_MAX_MAGNITUDE:
        raise ValueError(f"bad RandAugment spec {spec!r}: magnitude must be 0..{_RANDAUG_MAX_MAGNITUDE}")
    if num_ops < 1:
        raise ValueError(f"bad RandAugment spec {spec!r}: the number of ops must be at least 1")
    return magnitude, num_ops


def _v2() -> Any:
    try:
        from torchvision.transforms import v2
    except ImportError as e:  # pragma: no cover - torchvision is a training dependency
        raise ImportError("training augmentation needs torchvision: pip install torchvision") from e
    return v2


class TrainTransform:
    """The training transform built by :func:`train_transform` (picklable, for loader workers)."""

    def __init__(
        self,
        cfg: PreprocessConfig,
        inception_crop: bool = True,
        flip: bool = True,
        randaugment: str | None = None,
        translate: float = 0.0,
    ) -> None:
        v2 = _v2()
        self.cfg, self.inception_crop, self.flip, self.randaugment = cfg, inception_crop, flip, randaugment
        interp = v2.InterpolationMode(cfg.interpolation)
        ops: list[Any] = []
        if inception_crop:
            ops.append(
                v2.RandomResizedCrop(
                    cfg.input_size,
                    scale=INCEPTION_CROP_SCALE,
                    ratio=INCEPTION_CROP_RATIO,
                    interpolation=interp,
                    antialias=True,
                )
            )
        else:
            # The evaluation's geometry (keep the aspect ratio, centre-crop; `resize_and_crop`): a plain
            # Resize(input_size) would squash every picture at a non-square size, and the model would learn
            # other shapes than those it is scored on.
            ops.append(functools.partial(resize_and_crop, cfg=cfg))
        if translate:
            # Shifts of up to `translate` x the size, padded with black: the classic augmentation of small,
            # centred scans such as the digits, where a crop would cut strokes away.
            ops.append(v2.RandomAffine(degrees=0.0, translate=(translate, translate), fill=0))
        if flip:
            ops.append(v2.RandomHorizontalFlip(0.5))
        if randaugment is not None:
            magnitude, num_ops = parse_randaugment(randaugment)
            # PIL's affine ops know only nearest / bilinear / bicubic; fill with the mean colour, as timm.
            affine = cfg.interpolation if cfg.interpolation in ("bilinear", "bicubic") else "bilinear"
            ops.append(
                v2.RandAugment(
                    num_ops=num_ops,
                    magnitude=magnitude,
                    num_magnitude_bins=_RANDAUG_MAX_MAGNITUDE + 1,
                    interpolation=v2.InterpolationMode(affine),
                    fill=[round(255 * m) for m in cfg.mean],
                )
            )
        self.ops = v2.Compose(ops)

    def __call__(self, image: ImageSource) -> torch.Tensor:
        img = self.ops(load_image(image))
        if not isinstance(img, Image.Image):  # pragma: no cover - v2 keeps PIL images PIL
            raise TypeError(f"augmentation returned {type(img).__name__}, expected a PIL image")
        return to_tensor(img, self.cfg)

    def __repr__(self) -> str:
        return (
            f"TrainTransform(input_size={self.cfg.input_size}, inception_crop={self.inception_crop}, "
            f"flip={self.flip}, randaugment={self.randaugment!r})"
        )


def train_transform(
    cfg: PreprocessConfig,
    inception_crop: bool = True,
    flip: bool = True,
    randaugment: str | None = None,
    translate: float = 0.0,
) -> Callable[[ImageSource], torch.Tensor]:
    """Image (PIL, bytes or path) -> augmented float32 tensor [3, H, W] with ``(H, W) = cfg.input_size``.

    ``load_image`` -> Inception crop (``RandomResizedCrop``: 5-100 % of the area, aspect 3/4-4/3, resized with
    ``cfg.interpolation``; with ``inception_crop=False`` the evaluation's resize and centre crop,
    :func:`~vit_serve.preprocess.resize_and_crop`) -> optional random shift by up to ``translate`` x the size ->
    random horizontal flip -> optional RandAugment (``"rand-m9-n2"``, see :func:`parse_randaugment`) ->
    ``to_tensor(img, cfg)``. A bad RandAugment spec raises ``ValueError`` here, not at the first image.
    """
    return TrainTransform(cfg, inception_crop, flip, randaugment, translate)


def eval_transform(cfg: PreprocessConfig) -> Callable[[ImageSource], torch.Tensor]:
    """``image -> preprocess(image, cfg)``: evaluation uses exactly the one preprocessing function."""
    return functools.partial(preprocess, cfg=cfg)


# --------------------------------------------------------------------------------------------------------
# Mixup / CutMix
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MixParams:
    """One batch's mixing draw.

    lam: weight of each sample's own image and label (1.0: no mixing); for CutMix it is 1 - box area / image
        area after clipping the box to the image.
    box: CutMix's pasted region ``(y0, y1, x0, x1)`` (half-open), or ``None`` for Mixup / no mixing.
    """

    lam: float = 1.0
    box: tuple[int, int, int, int] | None = None


def cutmix_box(height: int, width: int, lam: float, cy: int, cx: int) -> tuple[int, int, int, int]:
    """CutMix's box ``(y0, y1, x0, x1)`` for ``lam`` centred at ``(cy, cx)``, clipped to the image (as timm's
    ``rand_bbox``): each side is ``int(size * sqrt(1 - lam))``."""
    ratio = math.sqrt(1.0 - lam)
    cut_h, cut_w = int(height * ratio), int(width * ratio)
    y0, y1 = max(cy - cut_h // 2, 0), min(cy + (cut_h + 1) // 2, height)
    x0, x1 = max(cx - cut_w // 2, 0), min(cx + (cut_w + 1) // 2, width)
    return y0, y1, x0, x1


class MixupCutmix:
    """Batch-wise Mixup / CutMix with label smoothing, as timm's ``Mixup(mode="batch", correct_lam=True)``.

    Each batch is mixed with itself reversed (``x.flip(0)``). With probability ``prob`` a batch is mixed: when
    both alphas are positive CutMix is chosen with probability ``switch_prob``, else the enabled one. Mixup:
    ``lam ~ Beta(mixup_alpha, mixup_alpha)``, ``x = lam x + (1 - lam) x.flip(0)``. CutMix: ``lam ~
    Beta(cutmix_alpha, cutmix_alpha)``, a box of ``sqrt(1 - lam)`` of each side centred at a uniform point,
    clipped to the image, is pasted from ``x.flip(0)`` and ``lam`` is recomputed from the clipped area. The
    targets are the label-smoothed one-hots mixed with the same ``lam``. With both alphas 0 the images pass
    through and the labels only become (smoothed) one-hots. Draws use torch's global RNG.
    """

    def __init__(
        self,
        num_classes: int,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
        label_smoothing: float = 0.0,
        prob: float = 1.0,
        switch_prob: float = 0.5,
    ) -> None:
        if not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}")
        for name, v in (("mixup_alpha", mixup_alpha), ("cutmix_alpha", cutmix_alpha)):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be >= 0, got {v!r}")
        for name, v in (("label_smoothing", label_smoothing), ("prob", prob), ("switch_prob", switch_prob)):
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v!r}")
        self.num_classes = num_classes
        self.mixup_alpha, self.cutmix_alpha = float(mixup_alpha), float(cutmix_alpha)
        self.label_smoothing, self.prob, self.switch_prob = float(label_smoothing), float(prob), float(switch_prob)

    @property
    def enabled(self) -> bool:
        """Whether any mixing can happen (an alpha is positive and ``prob`` > 0)."""
        return (self.mixup_alpha > 0 or self.cutmix_alpha > 0) and self.prob > 0

    def sample(self, height: int, width: int) -> MixParams:
        """Draw one batch's :class:`MixParams` for images of ``height`` x ``width`` (no draws when disabled)."""
        if self.mixup_alpha <= 0 and self.cutmix_alpha <= 0:
            return MixParams()
        if float(torch.rand(())) >= self.prob:
            return MixParams()
        if self.mixup_alpha > 0 and self.cutmix_alpha > 0:
            use_cutmix = float(torch.rand(())) < self.switch_prob
        else:
            use_cutmix = self.cutmix_alpha > 0
        alpha = self.cutmix_alpha if use_cutmix else self.mixup_alpha
        a = torch.tensor(alpha, dtype=torch.float64)
        lam = float(torch.distributions.Beta(a, a).sample())
        if not use_cutmix:
            return MixParams(lam=lam)
        cy, cx = int(torch.randint(height, ())), int(torch.randint(width, ()))
        box = cutmix_box(height, width, lam, cy, cx)
        y0, y1, x0, x1 = box
        return MixParams(lam=1.0 - (y1 - y0) * (x1 - x0) / float(height * width), box=box)

    def targets(self, y: torch.Tensor, lam: float = 1.0) -> torch.Tensor:
        """Label-smoothed one-hot targets [B, K] (float32) mixed as ``lam * t + (1 - lam) * t.flip(0)``."""
        off = self.label_smoothing / self.num_classes
        on = 1.0 - self.label_smoothing + off
        t = torch.full((y.shape[0], self.num_classes), off, dtype=torch.float32, device=y.device)
        t.scatter_(1, y.long().view(-1, 1), on)
        return t * lam + t.flip(0) * (1.0 - lam)

    def mix(self, x: torch.Tensor, y: torch.Tensor, params: MixParams) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply ``params`` to images ``x`` [B, C, H, W] and integer labels ``y`` [B] (``x`` is not modified)."""
        if x.ndim != 4:
            raise ValueError(f"expected images [B, C, H, W], got shape {list(x.shape)}")
        if y.ndim != 1 or y.shape[0] != x.shape[0] or y.is_floating_point():
            raise ValueError(f"expected integer labels [{x.shape[0]}], got {y.dtype} of shape {list(y.shape)}")
        if y.numel() and (int(y.min()) < 0 or int(y.max()) >= self.num_classes):
            raise ValueError(f"labels must be in 0..{self.num_classes - 1}")
        lam = params.lam
        if params.box is not None:
            y0, y1, x0, x1 = params.box
            x = x.clone()
            x[:, :, y0:y1, x0:x1] = x.flip(0)[:, :, y0:y1, x0:x1]
        elif lam != 1.0:
            x = x * lam + x.flip(0) * (1.0 - lam)
        return x, self.targets(y, lam)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mix a batch: ``(x_mixed [B, C, H, W], y_soft [B, K] float32)``; each ``y_soft`` row sums to 1."""
        return self.mix(x, y, self.sample(x.shape[-2], x.shape[-1]))

    def __repr__(self) -> str:
        return (
            f"MixupCutmix(num_classes={self.num_classes}, mixup_alpha={self.mixup_alpha}, "
            f"cutmix_alpha={self.cutmix_alpha}, label_smoothing={self.label_smoothing}, prob={self.prob}, "
            f"switch_prob={self.switch_prob})"
        )


def soft_target_cross_entropy(logits: torch.Tensor, y_soft: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against soft targets: ``mean_b sum_k -y_soft[b, k] log_softmax(logits)[b, k]``.

    Equals ``F.cross_entropy(logits, y)`` for one-hot targets (and with ``label_smoothing=s`` for targets
    smoothed as ``s / K`` off, ``1 - s + s / K`` on). Computed in float32 at least.
    """
    if logits.shape != y_soft.shape:
        raise ValueError(f"logits {list(logits.shape)} and targets {list(y_soft.shape)} must have the same shape")
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logp = F.log_softmax(logits.to(dtype), dim=-1)
    return -(y_soft.to(dtype) * logp).sum(dim=-1).mean()
