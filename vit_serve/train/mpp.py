"""Masked patch prediction: the ViT paper's self-supervised pre-training (§4.6, App. B.1.2).

"We corrupt 50% of patch embeddings by either replacing their embeddings with a learnable [mask] embedding
(80%), a random other patch embedding (10%) or just keeping them as is (10%)." The objective predicts "the
3-bit, mean color (i.e., 512 colors in total) of every corrupted patch" from its output token, with a
softmax cross-entropy.

:class:`MPPModel` wraps an ordinary :class:`~vit_serve.model.VisionTransformer` without renaming anything: after
pre-training, `mpp_model.vit` is a plain ViT whose state dict fine-tunes like any other (the [mask] token and
the MPP head stay behind). Its classification head and pre-logits layer get no gradient during MPP (pass
`find_unused_parameters=True` to DistributedDataParallel, or wrap only what trains).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from vit_serve.model import VisionTransformer

__all__ = ["MPPHead", "MPPModel", "corrupt_patches", "denormalize", "mpp_targets"]


def denormalize(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """Undo per-channel normalisation: x [B, C, H, W] * std + mean (back to pixel values in [0, 1])."""
    m = torch.as_tensor(mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    s = torch.as_tensor(std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    return x * s + m


@torch.no_grad()
def mpp_targets(x_pixels: torch.Tensor, patch_size: int, bits: int = 3) -> torch.Tensor:
    """Class ids [B, N] of each patch's mean colour, `bits` bits per channel (paper: 3 bits, 512 classes).

    x_pixels [B, 3, H, W] holds un-normalised values in [0, 1] (see :func:`denormalize`). Each channel's patch
    mean is quantised to floor(mean * 2^bits) clamped to [0, 2^bits - 1]; the id is r * 4^bits + g * 2^bits + b
    (3 bits: r * 64 + g * 8 + b). Patches are ordered row-major over the grid, like `PatchEmbed`.
    """
    if x_pixels.ndim != 4 or x_pixels.shape[1] != 3:
        raise ValueError(f"expected RGB pixels [B, 3, H, W], got {tuple(x_pixels.shape)}")
    h, w = x_pixels.shape[-2:]
    if h % patch_size or w % patch_size:
        raise ValueError(f"image size {h}x{w} is not a multiple of the patch size {patch_size}")
    levels = 2**bits
    means = F.avg_pool2d(x_pixels.float(), patch_size)  # [B, 3, H/P, W/P]
    q = (means * levels).floor().clamp(0, levels - 1).long()
    ids = (q[:, 0] * levels + q[:, 1]) * levels + q[:, 2]
    return ids.flatten(1)


def _rand(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    if generator is None:
        return torch.rand(shape, device=device)
    return torch.rand(shape, generator=generator, device=generator.device).to(device)


def _randint(high: int, shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device):
    if generator is None:
        return torch.randint(high, shape, device=device)
    return torch.randint(high, shape, generator=generator, device=generator.device).to(device)


def corrupt_patches(
    emb: torch.Tensor,
    mask_token: torch.Tensor,
    ratio: float = 0.5,
    p_mask: float = 0.8,
    p_random: float = 0.1,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Corrupt round(ratio * N) patch embeddings per image, BERT-style (paper §4.6).

    emb [B, N, D], mask_token [D]. Each chosen patch independently becomes the [mask] token (p_mask), another
    patch's embedding drawn uniformly from the whole batch, never itself (p_random), or stays as is (the rest;
    still predicted). Returns (corrupted embeddings [B, N, D], corrupted_mask [B, N] bool = chosen patches).
    Gradients reach `emb` (kept and copied patches) and `mask_token`. `generator` makes it deterministic.
    """
    if emb.ndim != 3:
        raise ValueError(f"expected patch embeddings [B, N, D], got {tuple(emb.shape)}")
    if not (0.0 <= ratio <= 1.0 and p_mask >= 0 and p_random >= 0 and p_mask + p_random <= 1.0):
        raise ValueError(
            f"need 0 <= ratio <= 1 and p_mask, p_random >= 0 with p_mask + p_random <= 1; "
            f"got ratio={ratio}, p_mask={p_mask}, p_random={p_random}"
        )
    B, N, D = emb.shape
    dev = emb.device
    k = min(N, math.floor(ratio * N + 0.5))  # round half up, unlike Python's banker's round()
    order = _rand((B, N), generator, dev).argsort(dim=1)
    chosen = torch.zeros(B, N, dtype=torch.bool, device=dev)
    chosen.scatter_(1, order[:, :k], True)

    u = _rand((B, N), generator, dev)
    to_mask = chosen & (u < p_mask)
    to_random = chosen & (u >= p_mask) & (u < p_mask + p_random)

    flat = emb.reshape(B * N, D)
    if B * N > 1:
        src = _randint(B * N - 1, (B * N,), generator, dev)
        src = src + (src >= torch.arange(B * N, device=dev)).long()  # skip the patch itself
    else:  # a single patch (or none) has no other patch to copy
        src = torch.zeros(B * N, dtype=torch.long, device=dev)
        to_random = torch.zeros_like(to_random)
    random_emb = flat[src].reshape(B, N, D)

    out = torch.where(to_random[..., None], random_emb, emb)
    out = torch.where(to_mask[..., None], mask_token.to(emb.dtype).expand(B, N, D), out)
    return out, chosen


class MPPHead(nn.Module):
    """Linear(D, 2^(3·bits)) on output patch tokens: logits over the quantised mean colours (512 for 3 bits)."""

    def __init__(self, dim: int, bits: int = 3) -> None:
        super().__init__()
        self.bits = bits
        self.num_classes = 2 ** (3 * bits)
        self.proj = nn.Linear(dim, self.num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, N, D] -> [B, N, 512]."""
        return self.proj(tokens)


class MPPModel(nn.Module):
    """A ViT trained by masked patch prediction (paper §4.6); `self.vit` keeps its ordinary parameter names.

    forward(x, targets): patch_embed -> corrupt_patches -> [class] + position embeddings -> blocks -> norm ->
    MPP head on the patch tokens -> cross-entropy over the corrupted patches only. `x` is the normalised model
    input [B, 3, H, W]; `targets` [B, N] come from :func:`mpp_targets` on the un-normalised pixels (computed
    here from x with `mean`/`std`, default the ViT's preprocessing contract or (0.5, 0.5, 0.5), when None).
    """

    def __init__(
        self,
        vit: VisionTransformer,
        ratio: float = 0.5,
        p_mask: float = 0.8,
        p_random: float = 0.1,
        bits: int = 3,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
    ) -> None:
        super().__init__()
        self.vit = vit
        d = vit.cfg.embed_dim
        ref = vit.pos_embed
        self.mask_token = nn.Parameter(torch.randn(d, device=ref.device, dtype=ref.dtype) * 0.02)
        self.mpp_head = MPPHead(d, bits).to(device=ref.device, dtype=ref.dtype)
        self.ratio, self.p_mask, self.p_random, self.bits = ratio, p_mask, p_random, bits
        pcfg = getattr(vit, "preprocess_cfg", None)
        self.mean = tuple(mean if mean is not None else (pcfg.mean if pcfg is not None else (0.5, 0.5, 0.5)))
        self.std = tuple(std if std is not None else (pcfg.std if pcfg is not None else (0.5, 0.5, 0.5)))

    def targets(self, x: torch.Tensor) -> torch.Tensor:
        """MPP targets [B, N] for normalised inputs x [B, 3, H, W]."""
        return mpp_targets(denormalize(x, self.mean, self.std), self.vit.cfg.patch_size, self.bits)

    def logits(self, x: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Colour logits [B, N, 2^(3·bits)] for every patch token, and the corrupted mask [B, N]."""
        vit = self.vit
        grid = vit.check_size(x.shape[-2], x.shape[-1])
        emb = vit.patch_embed(x)
        emb, corrupted = corrupt_patches(emb, self.mask_token, self.ratio, self.p_mask, self.p_random, generator)
        tokens = vit._pos_embed(emb, grid)
        for blk in vit.blocks:
            tokens, _ = blk(tokens)
        tokens = vit.norm(tokens)
        return self.mpp_head(tokens[:, vit.num_prefix_tokens :]), corrupted

    def forward(
        self,
        x: torch.Tensor,
        targets: torch.Tensor | None = None,
        return_accuracy: bool = False,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Mean cross-entropy over the corrupted patches (and their top-1 colour accuracy if asked)."""
        if targets is None:
            targets = self.targets(x)
        logits, corrupted = self.logits(x, generator)
        if targets.shape != corrupted.shape:
            raise ValueError(f"targets {tuple(targets.shape)} do not match the patch grid {tuple(corrupted.shape)}")
        sel_logits = logits[corrupted].float()
        sel_targets = targets.to(logits.device)[corrupted]
        loss = F.cross_entropy(sel_logits, sel_targets)
        if not return_accuracy:
            return loss
        acc = (sel_logits.detach().argmax(-1) == sel_targets).float().mean()
        return loss, acc
