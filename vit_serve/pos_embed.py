"""Position-embedding resampling (paper §3.2: "2D interpolation of the pre-trained position embeddings").

One pure function; each mode is named after the reference implementation whose numbers it reproduces.

Two ways to compute the same interpolation. Eagerly, `F.interpolate` itself: the very call each reference makes,
so the numbers are theirs bit for bit. In an exported graph (ONNX, torch.export), the portable form: the
interpolation is separable, so it is two weight matrices applied with matmul, W_h [gh', gh] and W_w [gw', gw],
built from the (possibly symbolic) target size with elementwise ops only (Range, arithmetic, Floor, Abs, Where,
Clip, Equal, ReduceSum). ONNX's `Resize` is not portable: OpenVINO and onnxruntime read its cubic / antialias /
exclude_outside attributes differently (1e-3 apart in the logits), while every runtime computes Range, Mul and
MatMul alike. The portable weights are torch's own formulas evaluated exactly (float64: 1e-14 from
`F.interpolate` in float64); in float32 both forms sit within rounding of that exact result, not of each other
(on N(0, 1) embeddings: torch's float32 kernel up to 1.1e-5 from it, the portable form up to 4e-6).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# mode -> (F.interpolate mode, align_corners, antialias, offset), i.e. the call each reference makes. A non-zero
# offset means the reference passes scale_factor = (new + offset) / old instead of a size.
_MODES: dict[str, tuple[str, bool, bool, float]] = {
    # vit_jax checkpoint.interpolate_posembed: scipy.ndimage.zoom(order=1), which maps corner to corner.
    "jax": ("bilinear", True, False, 0.0),
    # timm.layers.resample_abs_pos_embed defaults (and transformers' Dinov2WithRegisters).
    "timm": ("bicubic", False, True, 0.0),
    # transformers ViTEmbeddings / Dinov2Embeddings / CLIPVisionEmbeddings.interpolate_pos_encoding.
    "hf": ("bicubic", False, False, 0.0),
    # torchvision.models.vision_transformer.interpolate_embeddings.
    "torchvision": ("bicubic", True, False, 0.0),
    # facebookresearch/dinov2 DinoVisionTransformer.interpolate_pos_encoding as released with the first models
    # (interpolate_offset=0.1, interpolate_antialias=False): scale_factor (new + 0.1) / old, "to avoid floating
    # point error" (dino #8). The register models were released with offset 0 and antialias: "timm".
    "dinov2": ("bicubic", False, False, 0.1),
    # open_clip.model.resize_pos_embed (bicubic, antialias, align_corners=False).
    "open_clip": ("bicubic", False, True, 0.0),
    # transformers Siglip2VisionEmbeddings.resize_positional_embeddings (NaFlex): a triangle filter of support
    # max(scale, 1), i.e. bilinear with antialias (vit_serve.naflex.position_weights per image).
    "naflex": ("bilinear", False, True, 0.0),
}


def is_tracing() -> bool:
    """True while torch.jit tracing or ONNX / torch.export capture: shape checks must not become constants."""
    return (torch.jit.is_tracing() or torch.onnx.is_in_onnx_export()
            or torch.compiler.is_exporting())


def _cubic(x: torch.Tensor, a: float) -> torch.Tensor:
    """Keys' cubic convolution kernel at |x| (torch's cubic_convolution1 / cubic_convolution2, same op order)."""
    x = x.abs()
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return torch.where(x < 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


def interpolation_weights(in_size: int, out_size, kind: str, align_corners: bool, antialias: bool,
                          dtype: torch.dtype = torch.float32, device: torch.device | None = None,
                          offset: float = 0.0) -> torch.Tensor:
    """The [out_size, in_size] matrix W with F.interpolate(x)[j] = sum_i W[j, i] x[i] along one axis.

    in_size: a Python int (the checkpoint's grid). out_size: an int, or a SymInt / traced size while
    exporting (it only ever enters `arange`, so the graph keeps it symbolic). kind: "bilinear" or "bicubic".
    Reproduces torch's CPU kernels (aten/src/ATen/native/cpu/UpSampleKernel.cpp):
    - bilinear / bicubic: source index s = scale * j (align_corners, scale = (in-1)/(out-1)) or
      scale * (j + 0.5) - 0.5 (scale = in/out; clamped at 0 for bilinear); taps at floor(s) + {0, 1} or
      floor(s) + {-1, 0, 1, 2}, clamped to the border; bicubic with Keys' a = -0.75.
    - bicubic with antialias (PIL's filter, a = -0.5): centre c = scale * (j + 0.5), support 2 * max(scale, 1),
      w_i = k((i - c + 0.5) / max(scale, 1)) over the inputs in range, normalised to sum 1; bilinear with
      antialias the same with the triangle k(x) = max(0, 1 - |x|) (support max(scale, 1)).
    - offset (F.interpolate given scale_factor = (out + offset) / in rather than a size): scale = in / (out + offset)
      in the formulas above, the output still `out` long.
    """
    # Source positions as ratios of integers (exact in float32 below 2^24), rounded once: torch rounds
    # s = scale * (j + 0.5) - 0.5 before taking its fraction, which costs ~1e-6 in the weights at grids of 20+.
    dst = torch.arange(out_size, dtype=dtype, device=device)
    src = torch.arange(in_size, dtype=dtype, device=device)
    n_out = dst[-1:] + 1  # the output size as a tensor: it stays graph arithmetic, never a traced constant
    if offset:
        if align_corners:
            raise ValueError("an offset scale factor is implemented for align_corners=False only")
        n_out = n_out + offset
    if antialias:
        if align_corners:
            raise ValueError("antialias is implemented for align_corners=False only")
        # (i + 0.5 - scale * (j + 0.5)) / max(scale, 1) with scale = in / out
        num = (2 * src[None, :] + 1) * n_out - in_size * (2 * dst[:, None] + 1)
        x = num / (2 * torch.clamp(n_out, min=in_size))
        w = (1 - x.abs()).clamp(min=0) if kind == "bilinear" else _cubic(x, -0.5)
        return w / w.sum(dim=-1, keepdim=True)
    if align_corners:  # s = j * (in - 1) / (out - 1); a single output row reads input 0, as in torch
        num, den = dst * (in_size - 1), (n_out - 1).clamp(min=1)
    else:  # s = (j + 0.5) * in / out - 0.5
        num, den = in_size * (2 * dst + 1) - n_out, 2 * n_out
        if kind == "bilinear":
            num = num.clamp(min=0)
    first = torch.floor(num / den)
    t = ((num - first * den) / den).clamp(0, 1)
    first = first.clamp(max=in_size - 1)
    if kind == "bilinear":
        taps = [(first, 1 - t), ((first + 1).clamp(max=in_size - 1), t)]
    elif kind == "bicubic":
        a = -0.75
        coeffs = [_cubic(t + 1, a), _cubic(t, a), _cubic(1 - t, a), _cubic(2 - t, a)]
        taps = [((first + k - 1).clamp(0, in_size - 1), c) for k, c in enumerate(coeffs)]
    else:
        raise ValueError(f"unknown interpolation kind {kind!r}; expected bilinear or bicubic")
    w = torch.zeros(1, in_size, dtype=dtype, device=device)
    for index, coeff in taps:  # border taps repeat the edge input, so their weights add up there
        w = w + torch.where(index[:, None] == src[None, :], coeff[:, None], torch.zeros_like(coeff[:, None]))
    return w


def is_exporting() -> bool:
    """True while an ONNX export or torch.export captures the graph (not plain torch.jit tracing)."""
    return torch.onnx.is_in_onnx_export() or torch.compiler.is_exporting()


def resample_pos_embed(
    pos_embed: torch.Tensor,
    old_grid: tuple[int, int],
    new_grid: tuple[int, int],
    num_prefix_tokens: int = 1,
    mode: str = "timm",
    portable: bool | None = None,
) -> torch.Tensor:
    """Resample learned position embeddings from one patch grid to another.

    Args:
        pos_embed: [1, num_prefix_tokens + gh * gw, D], patch tokens in row-major (h, w) order.
        old_grid: (gh, gw) of `pos_embed`. new_grid: (gh', gw') wanted; both may be non-square, and new_grid
            may be symbolic while exporting.
        num_prefix_tokens: leading tokens ([class]) copied unchanged.
        mode: "jax" (bilinear, align_corners=True = scipy.ndimage.zoom(order=1) as in vit_jax),
            "timm" (bicubic, antialias, align_corners=False), "hf" (bicubic, no antialias, as transformers),
            "torchvision" (bicubic, align_corners=True), "dinov2" (bicubic at scale (new + 0.1) / old, the
            DINOv2 release's), "naflex" (bilinear, antialias: SigLIP 2's transformers code), "open_clip" (as
            timm). On non-square grids "dinov2" scales each axis by its own size (the DINOv2 code pairs the
            width's factor with the height axis; equal for square grids).
        portable: the matmul form (`interpolation_weights`) instead of `F.interpolate`; default: while
            exporting (ONNX, torch.export) only, so eager numbers are the references' own.

    Returns:
        [1, num_prefix_tokens + gh' * gw', D] in the input's dtype: `F.interpolate` with that mode's settings on
        the [1, D, gh, gw] grid; the input itself when the grids match (outside tracing, so that an exported
        graph keeps the resampling for other sizes).
    """
    if mode not in _MODES:
        raise ValueError(f"unknown resample mode {mode!r}; expected one of {', '.join(_MODES)}")
    gh, gw = old_grid
    if pos_embed.shape[1] != num_prefix_tokens + gh * gw:
        raise ValueError(f"pos_embed has {pos_embed.shape[1]} tokens, expected {num_prefix_tokens} + {gh}x{gw}")
    if not is_tracing() and tuple(old_grid) == tuple(new_grid):
        return pos_embed
    kind, align_corners, antialias, offset = _MODES[mode]
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    dim = pos_embed.shape[-1]
    # scipy.ndimage.zoom computes in float64; matching it within 2e-6 needs the same precision. Exported
    # graphs stay in float32 (not every runtime runs float64; logits move by ~1e-6).
    dtype = torch.float64 if mode == "jax" and not is_tracing() else torch.float32
    if is_exporting() if portable is None else portable:
        w_h = interpolation_weights(gh, new_grid[0], kind, align_corners, antialias, dtype, pos_embed.device, offset)
        w_w = interpolation_weights(gw, new_grid[1], kind, align_corners, antialias, dtype, pos_embed.device, offset)
        grid = torch.matmul(w_h, grid.to(dtype).reshape(gh, gw * dim)).reshape(-1, gw, dim)  # [gh', gw, D]
        grid = torch.matmul(w_w, grid)  # [gw', gw] @ [gh', gw, D] -> [gh', gw', D]
    else:
        grid = grid.to(dtype).reshape(1, gh, gw, dim).permute(0, 3, 1, 2)
        size = dict(scale_factor=((new_grid[0] + offset) / gh, (new_grid[1] + offset) / gw)) if offset \
            else dict(size=(new_grid[0], new_grid[1]))
        grid = F.interpolate(grid, mode=kind, align_corners=align_corners, antialias=antialias,
                             **size).permute(0, 2, 3, 1)
    grid = grid.reshape(1, -1, dim).to(pos_embed.dtype)
    return torch.cat([prefix, grid], dim=1)


def resample_patch_embed(weight: torch.Tensor, new_size: tuple[int, int], interpolation: str = "bicubic",
                         antialias: bool = True) -> torch.Tensor:
    """FlexiViT's pseudo-inverse resize of a patch-embedding kernel (Beyer et al., CVPR 2023, §3.4; timm's
    `resample_patch_embed`, big_vision's `resample_patchemb`): weight [D, C, p, q] -> [D, C, p', q'].

    With B the resize of a p x q patch to p' x q' as a matrix ([p'q', pq], bicubic with antialiasing), the new
    kernel is pinv(B^T) w: <x, w> = <B x, w'> for every patch x when upsampling, the least-squares best when not.
    Computed in float64, returned in the weight's dtype."""
    old = tuple(weight.shape[-2:])
    new = (int(new_size[0]), int(new_size[1]))
    if old == new:
        return weight
    n = old[0] * old[1]
    basis = torch.eye(n, dtype=torch.float32, device=weight.device).reshape(n, 1, *old)
    b = F.interpolate(basis, size=new, mode=interpolation, antialias=antialias).reshape(n, -1).T.double()
    pinv = torch.linalg.pinv(b.T)  # [p'q', pq]
    out = weight.double().reshape(*weight.shape[:2], n) @ pinv.T
    return out.reshape(*weight.shape[:2], *new).to(weight.dtype)
