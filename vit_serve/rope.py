"""2-D rotary position embeddings (RoPE) for ViTs: the tables and their application to queries and keys.

Each variant reproduces one of timm 1.0.31's (timm/layers/pos_embed_sincos.py, used by timm.models.eva.Eva):

- "axial": `RotaryEmbeddingCat(in_pixels=False)`: integer patch coordinates (plus `grid_offset`), optionally
  rescaled to a reference grid (EVA-02, PE: `ref_feat_shape`), frequencies 1 / temperature ** (i / (hd / 4)),
  interleaved pairs. EVA-02 (temperature 1e4, 'ij', ref 16 x 16), PE-Core (offset 1, 'xy', ref = its
  pretraining grid), RoPE-ViT axial (temperature 100, 'xy') and timm's SBB `*_rope_reg*` models.
- "dinov3": `RotaryEmbeddingDinoV3`: 0.5-centred coordinates normalised by the grid size to [-1, 1], periods
  temperature ** (2 i / (hd / 2)) (temperature 100), the angles 2 pi c / period in the "half" layout.
- "mixed": `RotaryEmbeddingMixed` (RoPE-ViT mixed, Heo et al. 2024): learned frequencies per block and head
  (a parameter [2, depth, heads, hd / 2]), angles t_x f_x + t_y f_y, interleaved pairs.

A table is [N, 2 hd] (sin then cos; mixed: [depth, heads, N, 2 hd]) over the N = H * W patches in row-major
order. It is computed from the grid with plain tensor arithmetic (Range, Mul, Div, Sin, Cos, Concat): H and W
may be Python ints or traced sizes, nothing branches on them, so an exported graph computes the tables from
its input's shape.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _axis(n: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(coordinates 0..n-1 as float32 [n], n as a float32 [1] tensor): the size stays graph arithmetic."""
    t = torch.arange(n, dtype=torch.int64).to(torch.float32)
    return t, t[-1:] + 1


def _pair_channels(ty: torch.Tensor, tx: torch.Tensor, indexing: str) -> torch.Tensor:
    """Row-major [H * W, 2] coordinates from per-axis ones: channels (y, x) for 'ij', (x, y) for 'xy'."""
    gy = ty[:, None].expand(-1, tx.shape[0])
    gx = tx[None, :].expand(ty.shape[0], -1)
    first, second = (gy, gx) if indexing == "ij" else (gx, gy)
    return torch.stack([first, second], dim=-1).reshape(-1, 2)


def axial_coords(h: Any, w: Any, grid_offset: float = 0.0, grid_indexing: str = "ij",
                 ref_grid: tuple[int, int] | None = None) -> torch.Tensor:
    """Patch coordinates [H * W, 2] for "axial" and "mixed" RoPE (timm `_build_grid(grid_type='index')`):
    index + offset, rescaled as index / size * ref when `ref_grid` (H, W) is given."""
    ty, nh = _axis(h)
    tx, nw = _axis(w)
    ty, tx = ty + grid_offset, tx + grid_offset
    if ref_grid is not None:
        ty = ty / nh * ref_grid[0]
        tx = tx / nw * ref_grid[1]
    return _pair_channels(ty, tx, grid_indexing)


def dinov3_coords(h: Any, w: Any, grid_offset: float = 0.0, grid_indexing: str = "ij") -> torch.Tensor:
    """DINOv3's coordinates [H * W, 2] (timm `_build_grid(grid_type='centered')`, normalize 'separate'):
    ((i + 0.5 + offset) / size) * 2 - 1, in [-1, 1]."""
    ty, nh = _axis(h)
    tx, nw = _axis(w)
    ty = (ty + 0.5 + grid_offset) / nh
    tx = (tx + 0.5 + grid_offset) / nw
    return 2.0 * _pair_channels(ty, tx, grid_indexing) - 1.0


def _layout(x: torch.Tensor, rotate_half: bool) -> torch.Tensor:
    """[..., F] -> [..., 2F]: [f0, f1, .., f0, f1, ..] (half) or [f0, f0, f1, f1, ..] (interleaved)."""
    if rotate_half:
        return torch.cat([x, x], dim=-1)
    return torch.stack([x, x], dim=-1).flatten(-2)


def _table(angles: torch.Tensor, rotate_half: bool) -> torch.Tensor:
    return torch.cat([_layout(angles.sin(), rotate_half), _layout(angles.cos(), rotate_half)], dim=-1)


def axial_table(h: Any, w: Any, head_dim: int, temperature: float = 10000.0, grid_offset: float = 0.0,
                grid_indexing: str = "ij", ref_grid: tuple[int, int] | None = None,
                rotate_half: bool = False) -> torch.Tensor:
    """[H * W, 2 hd] (sin, cos) of timm's `RotaryEmbeddingCat(in_pixels=False)`: hd / 4 bands
    1 / temperature ** (i / (hd / 4)) per axis."""
    nb = head_dim // 4
    bands = 1.0 / (temperature ** (torch.arange(0, nb, 1, dtype=torch.int64).to(torch.float32) / nb))
    coords = axial_coords(h, w, grid_offset, grid_indexing, ref_grid)
    return _table((coords[:, :, None] * bands).flatten(1), rotate_half)


def dinov3_table(h: Any, w: Any, head_dim: int, temperature: float = 100.0, grid_offset: float = 0.0,
                 grid_indexing: str = "ij", rotate_half: bool = True) -> torch.Tensor:
    """[H * W, 2 hd] (sin, cos) of timm's `RotaryEmbeddingDinoV3`: angles 2 pi c / period, periods
    temperature ** (2 i / (hd / 2)) for i < hd / 4."""
    nb = head_dim // 4
    periods = temperature ** (2.0 * torch.arange(nb, dtype=torch.float32) / (head_dim // 2))
    coords = dinov3_coords(h, w, grid_offset, grid_indexing)
    return _table((2 * math.pi * coords[:, :, None] / periods).flatten(1), rotate_half)


def mixed_table(h: Any, w: Any, freqs: torch.Tensor, grid_indexing: str = "xy") -> torch.Tensor:
    """[depth, heads, H * W, 2 hd] (sin, cos) of timm's `RotaryEmbeddingMixed` from its learned `freqs`
    [2, depth, heads, hd / 2]: angles t_x f_x + t_y f_y (t: the coordinate channels in `grid_indexing` order)."""
    coords = axial_coords(h, w, 0.0, grid_indexing)
    f = freqs.float()
    angles = coords[:, 0, None] * f[0].unsqueeze(-2) + coords[:, 1, None] * f[1].unsqueeze(-2)
    return _table(angles, False).to(freqs.dtype)


def init_mixed_freqs(head_dim: int, depth: int, num_heads: int, temperature: float = 10.0,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """RoPE-ViT mixed's initial frequencies [2, depth, heads, hd / 2] (timm `init_random_2d_freqs`): magnitudes
    1 / temperature ** (4 i / hd), each head and block rotated by a random angle."""
    mag = 1.0 / (temperature ** (torch.arange(0, head_dim, 4, dtype=torch.float32) / head_dim))
    angles = torch.rand(depth, num_heads, 1, generator=generator) * 2 * torch.pi
    fx = torch.cat([mag * torch.cos(angles), mag * torch.cos(angles + torch.pi / 2)], dim=-1)
    fy = torch.cat([mag * torch.sin(angles), mag * torch.sin(angles + torch.pi / 2)], dim=-1)
    return torch.stack([fx, fy], dim=0)


def rope_table(kind: str, h: Any, w: Any, head_dim: int, temperature: float, grid_offset: float = 0.0,
               grid_indexing: str = "ij", ref_grid: tuple[int, int] | None = None, rotate_half: bool = False,
               freqs: torch.Tensor | None = None) -> torch.Tensor:
    """The table of one variant (`kind`: "axial", "dinov3", "mixed") for an H x W patch grid; the kind is a
    configuration choice, never a size."""
    if kind == "mixed":
        if freqs is None:
            raise ValueError("mixed RoPE needs its learned frequencies (rope.freqs)")
        return mixed_table(h, w, freqs, grid_indexing)
    if kind == "dinov3":
        return dinov3_table(h, w, head_dim, temperature, grid_offset, grid_indexing, rotate_half)
    return axial_table(h, w, head_dim, temperature, grid_offset, grid_indexing, ref_grid, rotate_half)


def rotate(x: torch.Tensor, table: torch.Tensor, rotate_half: bool = False) -> torch.Tensor:
    """x [..., N, hd] rotated by `table` [..., N, 2 hd]: x cos + r(x) sin, r(x) = [-x1, x0, -x3, x2, ..]
    (interleaved) or [-x_hi, x_lo] (half), as timm's `apply_rot_embed_cat`; the result in x's dtype."""
    sin, cos = table.chunk(2, dim=-1)
    if rotate_half:
        lo, hi = x.chunk(2, dim=-1)
        r = torch.cat([-hi, lo], dim=-1)
    else:
        pairs = x.unflatten(-1, (-1, 2))
        r = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
    return (x * cos + r * sin).to(x.dtype)


def rotate_patches(x: torch.Tensor, table: torch.Tensor, num_prefix: int, rotate_half: bool = False) -> torch.Tensor:
    """q or k [B, heads, prefix + N, hd] with the N patch tokens rotated; class / register tokens untouched."""
    if num_prefix == 0:
        return rotate(x, table, rotate_half)
    return torch.cat([x[:, :, :num_prefix], rotate(x[:, :, num_prefix:], table, rotate_half)], dim=2)
