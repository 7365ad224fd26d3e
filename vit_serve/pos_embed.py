"""Position-embedding resampling (paper §3.2: "2D interpolation of the pre-trained position embeddings").

One pure function; each mode is named after the reference implementation whose numbers it reproduces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# mode -> (F.interpolate mode, align_corners, antialias)
_MODES: dict[str, tuple[str, bool, bool]] = {
    # vit_jax checkpoint.interpolate_posembed: scipy.ndimage.zoom(order=1), which maps corner to corner.
    "jax": ("bilinear", True, False),
    # timm.layers.resample_abs_pos_embed defaults.
    "timm": ("bicubic", False, True),
    # transformers ViTEmbeddings.interpolate_pos_encoding.
    "hf": ("bicubic", False, False),
    # torchvision.models.vision_transformer.interpolate_embeddings.
    "torchvision": ("bicubic", True, False),
}


def is_tracing() -> bool:
    """True while torch.jit tracing or ONNX / torch.export capture: shape checks must not become constants."""
    return (torch.jit.is_tracing() or torch.onnx.is_in_onnx_export()
            or torch.compiler.is_exporting())


def resample_pos_embed(
    pos_embed: torch.Tensor,
    old_grid: tuple[int, int],
    new_grid: tuple[int, int],
    num_prefix_tokens: int = 1,
    mode: str = "timm",
) -> torch.Tensor:
    """Resample learned position embeddings from one patch grid to another.

    Args:
        pos_embed: [1, num_prefix_tokens + gh * gw, D], patch tokens in row-major (h, w) order.
        old_grid: (gh, gw) of `pos_embed`. new_grid: (gh', gw') wanted; both may be non-square.
        num_prefix_tokens: leading tokens ([class]) copied unchanged.
        mode: "jax" (bilinear, align_corners=True = scipy.ndimage.zoom(order=1) as in vit_jax),
            "timm" (bicubic, antialias, align_corners=False), "hf" (bicubic, no antialias, as transformers),
            "torchvision" (bicubic, align_corners=True).

    Returns:
        [1, num_prefix_tokens + gh' * gw', D] in the input's dtype; the input itself when the grids match
        (outside tracing, so that an exported graph keeps the resize for other sizes).
    """
    if mode not in _MODES:
        raise ValueError(f"unknown resample mode {mode!r}; expected one of {', '.join(_MODES)}")
    gh, gw = old_grid
    if pos_embed.shape[1] != num_prefix_tokens + gh * gw:
        raise ValueError(f"pos_embed has {pos_embed.shape[1]} tokens, expected {num_prefix_tokens} + {gh}x{gw}")
    if not is_tracing() and tuple(old_grid) == tuple(new_grid):
        return pos_embed
    interp, align_corners, antialias = _MODES[mode]
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    dim = pos_embed.shape[-1]
    # scipy.ndimage.zoom computes in float64; matching it within 2e-6 needs the same precision. Exported
    # graphs stay in float32 (ONNX runtimes have no float64 Resize; logits move by ~1e-6).
    wide = mode == "jax" and not is_tracing()
    grid = grid.to(torch.float64 if wide else torch.float32).reshape(1, gh, gw, dim).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=(new_grid[0], new_grid[1]), mode=interp,
                         align_corners=align_corners, antialias=antialias)
    grid = grid.permute(0, 2, 3, 1).reshape(1, -1, dim).to(pos_embed.dtype)
    return torch.cat([prefix, grid], dim=1)
