"""NaFlex (SigLIP 2's variable resolution at native aspect ratio): pure functions.

An image is resized, keeping its aspect ratio, to the largest size whose patch grid holds at most `max_patches`
patches, cut into P x P patches flattened to rows, and padded to `max_patches` rows with a key-padding mask; the
model's stored position-embedding grid is resampled per image to that image's own grid.

Reference reproduced: transformers 5.25 `models/siglip2`:
- `image_processing_siglip2.get_image_size_for_max_num_patches` (the binary search on the scale),
  `convert_image_to_patches` (the row order), `pad_along_first_dim` (the mask), and the torchvision backend's
  resize (`F.interpolate` bilinear, antialias, align_corners=False, on the uint8 image; rescale and normalise
  fused as (x - 255 mean) / (255 std));
- `modeling_siglip2.Siglip2VisionEmbeddings.resize_positional_embeddings`: per image, a triangle filter of
  support max(scale, 1) (= `F.interpolate(bilinear, antialias=True, align_corners=False)`) written as one
  [max_patches, gh * gw] weight matrix, so it is plain arithmetic in an exported graph; padded rows repeat the
  resampled grid's first entry, as the reference's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

__all__ = ["DEFAULT_MAX_PATCHES", "NaFlexBatch", "batch_images", "check_budget", "conv_to_linear",
           "image_to_patches", "linear_to_conv", "pack", "pad_patches", "position_weights", "resize_image",
           "target_size", "unpack"]

DEFAULT_MAX_PATCHES = 256  # Siglip2ImageProcessor.max_num_patches


@dataclass(frozen=True)
class NaFlexBatch:
    """A batch of NaFlex inputs.

    patches [B, M, P * P * C] float32 (rows (p, q, c) per patch, patches row-major over the image's grid, then
    zeros); spatial_shapes [B, 2] int64 (grid rows, grid columns); mask [B, M] bool (True: a real patch).
    """

    patches: torch.Tensor
    spatial_shapes: torch.Tensor
    mask: torch.Tensor

    def __iter__(self) -> Iterator[torch.Tensor]:
        """(patches, spatial_shapes, mask): `model.forward_patches(*batch)`."""
        return iter((self.patches, self.spatial_shapes, self.mask))


def target_size(height: int, width: int, patch_size: int, max_patches: int, eps: float = 1e-5) -> tuple[int, int]:
    """(H, W) of an image -> the (H', W') it is resized to: both multiples of `patch_size`, at least one patch,
    (H'/P) * (W'/P) <= max_patches, the aspect ratio kept up to rounding each side up to whole patches.

    The reference's rule exactly: a bisection on the scale s in [eps / 10, 100] until the interval is shorter
    than eps, each side ceil(s * side / P) * P."""
    if max_patches < 1:
        raise ValueError(f"max_patches must be >= 1, got {max_patches}")

    def side(scale: float, size: int) -> int:
        return int(max(patch_size, math.ceil(size * scale / patch_size) * patch_size))

    lo, hi = eps / 10, 100.0
    while hi - lo >= eps:
        mid = (lo + hi) / 2
        if (side(mid, height) / patch_size) * (side(mid, width) / patch_size) <= max_patches:
            lo = mid
        else:
            hi = mid
    return side(lo, height), side(lo, width)


def resize_image(image: np.ndarray | torch.Tensor | Image.Image, size: tuple[int, int]) -> torch.Tensor:
    """uint8 RGB [H, W, C] (or a PIL image, converted to RGB) -> uint8 [C, H', W']: bilinear with antialias
    (align_corners=False) on the uint8 image, as torchvision's `resize` on a CPU uint8 tensor (the reference's
    processor); unchanged at its size."""
    if isinstance(image, Image.Image):
        image = np.asarray(image.convert("RGB"))
    if not isinstance(image, torch.Tensor):
        image = np.asarray(image)
        image = torch.from_numpy(image if image.flags.writeable else image.copy())  # e.g. a view of a PIL image
    x = image
    if x.dtype != torch.uint8 or x.ndim != 3:
        raise ValueError(f"expected a uint8 [H, W, C] image, got {x.dtype} {tuple(x.shape)}")
    x = x.permute(2, 0, 1)
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    # [1, C, H, W] viewed from HWC memory (channels-last), as the reference's tensor is.
    return F.interpolate(x[None], size=list(size), mode="bilinear", align_corners=False, antialias=True)[0]


def image_to_patches(image: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[C, H, W] (H, W multiples of P) -> [(H/P) * (W/P), P * P * C]: patches row-major over the grid, each
    flattened in (p, q, c) order (the reference's `convert_image_to_patches`)."""
    c, h, w = image.shape
    gh, gw = h // patch_size, w // patch_size
    x = image.reshape(c, gh, patch_size, gw, patch_size).permute(1, 3, 2, 4, 0)
    return x.reshape(gh * gw, -1)


def pad_patches(patches: torch.Tensor, max_patches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> ([max_patches, K] zero-padded, mask [max_patches] bool, True on the N real rows)."""
    n = patches.shape[0]
    if n > max_patches:
        raise ValueError(f"{n} patches do not fit max_patches={max_patches}")
    mask = torch.arange(max_patches) < n
    return F.pad(patches, (0, 0, 0, max_patches - n)), mask


def batch_images(images: Sequence[np.ndarray | torch.Tensor | Image.Image], patch_size: int, max_patches: int,
                 mean: tuple[float, float, float] = (0.5, 0.5, 0.5),
                 std: tuple[float, float, float] = (0.5, 0.5, 0.5)) -> NaFlexBatch:
    """uint8 RGB images [H, W, 3] (or PIL images) of any sizes -> a NaFlexBatch of `max_patches` rows each: resized by
    `target_size`, normalised as (x - 255 mean) / (255 std) in float32 (the reference's fused rescale and
    normalise), patchified and padded."""
    m = torch.tensor([255.0 * v for v in mean])[:, None, None]
    s = torch.tensor([255.0 * v for v in std])[:, None, None]
    rows, shapes, masks = [], [], []
    for img in images:
        h, w = (img.height, img.width) if isinstance(img, Image.Image) else (img.shape[0], img.shape[1])
        size = target_size(h, w, patch_size, max_patches)
        x = (resize_image(img, size).to(torch.float32) - m) / s
        p, mask = pad_patches(image_to_patches(x, patch_size), max_patches)
        rows.append(p)
        masks.append(mask)
        shapes.append((size[0] // patch_size, size[1] // patch_size))
    return NaFlexBatch(torch.stack(rows), torch.tensor(shapes, dtype=torch.int64), torch.stack(masks))


def position_weights(grid: tuple[int, int], spatial_shapes: torch.Tensor, max_patches: int | torch.Tensor
                     ) -> torch.Tensor:
    """The per-image resampling of a stored [gh, gw] position-embedding grid, as one matrix per image.

    grid: the stored grid (gh, gw), Python ints. spatial_shapes [B, 2]: each image's grid (h, w).
    max_patches: the padded length M (an int, or a traced size). Returns [B, M, gh * gw] float32, so that
    `weights @ pos.reshape(gh * gw, D)` is each image's embeddings [B, M, D] row-major over its grid; rows past
    h * w repeat its entry (0, 0). Reference: `Siglip2VisionEmbeddings.resize_positional_embeddings` (same op
    order): a triangle filter of support max(g / s, 1) centred at (i + 0.5) g / s - 0.5, normalised, which is
    `F.interpolate(bilinear, antialias=True, align_corners=False)`; the reference's grid is square, here
    each axis has its own size.
    """
    sizes = spatial_shapes.to(torch.float32)[:, None]  # [B, 1, 2]
    positions = torch.arange(max_patches, device=spatial_shapes.device, dtype=torch.float32)[None, :, None]
    # floor(k / w) as floor((k + 0.5) / w): the same integer, and still right where a runtime divides by
    # multiplying with 1 / w (OpenVINO: 246 * (1 / 82) rounds below 3).
    rows = torch.floor((positions + 0.5) / sizes[..., 1:])
    index = torch.cat([rows, positions - rows * sizes[..., 1:]], dim=-1)  # [B, M, 2]
    index = index * (positions < sizes.prod(-1, keepdim=True))
    stored = torch.tensor(grid, dtype=torch.float32, device=spatial_shapes.device)
    scale = stored / sizes  # [B, 1, 2]
    support = scale.clamp(min=1)
    center = (index + 0.5) * scale - 0.5  # [B, M, 2]
    axis_h = _axis_weights(center[..., 0], support[..., 0], grid[0])  # [B, M, gh]
    axis_w = _axis_weights(center[..., 1], support[..., 1], grid[1])  # [B, M, gw]
    return (axis_h[..., :, None] * axis_w[..., None, :]).flatten(-2)


def _axis_weights(center: torch.Tensor, support: torch.Tensor, n: int) -> torch.Tensor:
    """center [B, M], support [B, 1] -> normalised triangle weights [B, M, n] over the n stored positions."""
    source = torch.arange(n, device=center.device, dtype=torch.float32)
    w = (1 - (source - center[..., None]).abs() / support[..., None]).clamp(min=0)
    return w / w.sum(-1, keepdim=True)


def conv_to_linear(weight: torch.Tensor) -> torch.Tensor:
    """Patch-embedding conv kernel [D, C, P, P] -> the linear weight [D, P * P * C] on flattened patches
    ((p, q, c) order, `image_to_patches`)."""
    return weight.permute(0, 2, 3, 1).reshape(weight.shape[0], -1)


def linear_to_conv(weight: torch.Tensor, in_chans: int, patch_size: int) -> torch.Tensor:
    """The reference's `patch_embedding` Linear weight [D, P * P * C] -> the conv kernel [D, C, P, P]."""
    return weight.reshape(weight.shape[0], patch_size, patch_size, in_chans).permute(0, 3, 1, 2).contiguous()


def check_budget(max_patches: int, limit: int | None) -> int:
    """A requested patch budget, checked against a model's (`cfg.extra["max_patches"]`; None: the model is not a
    NaFlex model): ValueError in one line naming the allowed range (callers prefix the option's name)."""
    if limit is None:
        raise ValueError("this model takes fixed-size images, not NaFlex patches (a SigLIP 2 NaFlex "
                         "checkpoint, e.g. a transformers siglip2 folder, does)")
    if isinstance(max_patches, bool) or not isinstance(max_patches, int) or not 1 <= max_patches <= limit:
        raise ValueError(f"must be an integer from 1 to {limit} (the model's patch budget), got {max_patches!r}")
    return max_patches


def pack(batch: NaFlexBatch) -> torch.Tensor:
    """A NaFlexBatch as one float32 array [B, 1 + M, K]: row 0 of each image holds its grid (h, w) in its first
    two columns (zeros after), rows 1.. its patches. The mask is implied (the first h * w patches are real), so
    images of one budget concatenate along B as fixed-size images do (a batcher needs nothing else)."""
    b, _, k = batch.patches.shape
    if k < 2:
        raise ValueError("pack: patches narrower than 2 values cannot carry the grid")
    head = torch.zeros(b, 1, k, dtype=torch.float32)
    head[:, 0, :2] = batch.spatial_shapes.to(torch.float32)
    return torch.cat([head, batch.patches.to(torch.float32)], dim=1)


def unpack(x: torch.Tensor) -> NaFlexBatch:
    """`pack`'s array [B, 1 + M, K] -> the NaFlexBatch (patches [B, M, K], spatial_shapes [B, 2], mask [B, M])."""
    shapes = x[:, 0, :2].round().to(torch.int64)
    patches = x[:, 1:]
    mask = torch.arange(patches.shape[1], device=x.device)[None] < shapes.prod(-1, keepdim=True)
    return NaFlexBatch(patches, shapes, mask)
