"""torchvision `vit_b_16` / `vit_b_32` / `vit_l_16` / `vit_l_32` / `vit_h_14` state dicts -> our layout.

Reference reproduced: `torchvision.models.vision_transformer.VisionTransformer` (torchvision 0.29), a pre-LN
ViT with LayerNorm eps 1e-6, exact GELU and `nn.MultiheadAttention`, whose packed in-projection has the
same q, k, v row order and head split as our fused qkv:

    torchvision                                              ours                  shape
    conv_proj.{weight,bias}                                  patch_embed.proj      [D, 3, P, P], [D]
    class_token                                              cls_token             [1, 1, D]
    encoder.pos_embedding                                    pos_embed             [1, 1 + N, D]
    L.ln_1                                                   blocks.{i}.norm1      [D]
    L.self_attention.in_proj_weight / in_proj_bias           blocks.{i}.attn.qkv   [3D, D], [3D]
    L.self_attention.out_proj                                blocks.{i}.attn.proj  [D, D]
    L.ln_2                                                   blocks.{i}.norm2      [D]
    L.mlp.0 (older files: L.mlp.linear_1)                    blocks.{i}.mlp.fc1    [M, D]
    L.mlp.3 (older files: L.mlp.linear_2)                    blocks.{i}.mlp.fc2    [D, M]
    encoder.ln                                               norm                  [D]
    heads.pre_logits (only with representation_size)         pre_logits.0          [R, D]
    heads.head                                               head                  [K, R or D]

with L = `encoder.layers.encoder_layer_{i}`. Dimensions come from the shapes; the image size from the
(square) position-embedding grid; the number of heads, which no shape records, from `arch` or the ViT
paper's width -> heads table. Other resolutions resample the position embeddings like torchvision's
`interpolate_embeddings` (bicubic, align_corners=True: resample_mode "torchvision").
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from vit_serve.checkpoints.converted import (
    CheckpointError,
    Converted,
    check_against_model,
    describe_keys,
    make_config,
    resample_to,
    strip_prefixes,
)
from vit_serve.config import HEADS_BY_WIDTH, get_config
from vit_serve.preprocess import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, PreprocessConfig

__all__ = [
    "TORCHVISION_ARCHS",
    "TORCHVISION_WEIGHTS",
    "convert_torchvision",
    "is_torchvision_layout",
    "torchvision_preprocess",
]

# torchvision builder -> (patch_size, num_layers, num_heads, hidden_dim, mlp_dim)
TORCHVISION_ARCHS: dict[str, tuple[int, int, int, int, int]] = {
    "vit_b_16": (16, 12, 12, 768, 3072),
    "vit_b_32": (32, 12, 12, 768, 3072),
    "vit_l_16": (16, 24, 16, 1024, 4096),
    "vit_l_32": (32, 24, 16, 1024, 4096),
    "vit_h_14": (14, 32, 16, 1280, 5120),
}

# Published weights' eval transforms (torchvision ViT_*_Weights): (arch, tag) -> (crop, resize, filter).
# Every one is Resize(resize) + CenterCrop(crop) + ImageNet mean / std. The first tag listed per arch and
# size is the one assumed when the caller does not name it.
TORCHVISION_WEIGHTS: dict[tuple[str, str], tuple[int, int, str]] = {
    ("vit_b_16", "IMAGENET1K_V1"): (224, 256, "bilinear"),
    ("vit_b_16", "IMAGENET1K_SWAG_E2E_V1"): (384, 384, "bicubic"),
    ("vit_b_16", "IMAGENET1K_SWAG_LINEAR_V1"): (224, 224, "bicubic"),
    ("vit_b_32", "IMAGENET1K_V1"): (224, 256, "bilinear"),
    ("vit_l_16", "IMAGENET1K_V1"): (224, 242, "bilinear"),
    ("vit_l_16", "IMAGENET1K_SWAG_E2E_V1"): (512, 512, "bicubic"),
    ("vit_l_16", "IMAGENET1K_SWAG_LINEAR_V1"): (224, 224, "bicubic"),
    ("vit_l_32", "IMAGENET1K_V1"): (224, 256, "bilinear"),
    ("vit_h_14", "IMAGENET1K_SWAG_E2E_V1"): (518, 518, "bicubic"),
    ("vit_h_14", "IMAGENET1K_SWAG_LINEAR_V1"): (224, 224, "bicubic"),
}

_LAYER = re.compile(r"^encoder\.layers\.encoder_layer_(\d+)\.")
_MLP_NAMES = (("mlp.0", "mlp.3"), ("mlp.linear_1", "mlp.linear_2"))


def is_torchvision_layout(keys: Iterable[str]) -> bool:
    """True for a torchvision VisionTransformer state dict (optionally "module."-prefixed)."""
    keys = {k[len("module.") :] if k.startswith("module.") else k for k in keys}
    return {"class_token", "encoder.pos_embedding"} <= keys and any(k.startswith("conv_proj.") for k in keys)


def torchvision_preprocess(
    arch: str | None, image_size: int, weights_tag: str | None = None
) -> PreprocessConfig:
    """The eval transform torchvision publishes for ViT weights, as our PreprocessConfig.

    `ImageClassification(crop_size, resize_size, interpolation)`: Resize(resize) on the shorter side, then
    CenterCrop(crop), ImageNet mean / std. Without `weights_tag` the first published weights of `arch` at
    `image_size` are assumed (IMAGENET1K_V1 at 224: resize 256 bilinear, crop_pct 224/256; vit_l_16 uses 242;
    vit_h_14 at 224 and 384/512/518 checkpoints are SWAG: bicubic, no crop margin); unknown architectures
    and sizes get ImageClassification's defaults, resize 256 bilinear, i.e. crop_pct = 224 / 256.
    """
    if weights_tag is not None:
        if (arch, weights_tag) not in TORCHVISION_WEIGHTS:
            known = ", ".join(f"{a}.{t}" for a, t in TORCHVISION_WEIGHTS)
            raise CheckpointError(f"unknown torchvision weights {arch}.{weights_tag}; known: {known}")
        crop, resize, interp = TORCHVISION_WEIGHTS[(arch, weights_tag)]
        if crop != image_size:
            raise CheckpointError(
                f"torchvision weights {arch}.{weights_tag} are {crop}x{crop}, "
                f"but the checkpoint's position embeddings are for {image_size}x{image_size}"
            )
    else:
        matches = [v for (a, _), v in TORCHVISION_WEIGHTS.items() if a == arch and v[0] == image_size]
        crop, resize, interp = matches[0] if matches else (image_size, 256, "bilinear")
        if not matches:
            crop = 224  # ImageClassification keeps resize_size=256 whatever the crop; express it as 224/256
    return PreprocessConfig(
        input_size=(image_size, image_size),
        mean=IMAGENET_DEFAULT_MEAN,
        std=IMAGENET_DEFAULT_STD,
        interpolation=interp,
        crop_pct=crop / resize,
        crop_mode="center",
    )


def _heads(arch: str | None, width: int, overrides: Mapping[str, Any]) -> tuple[int, str | None]:
    """(num_heads, torchvision arch name if known)."""
    if arch is not None and arch not in TORCHVISION_ARCHS:
        try:
            base = get_config(arch)
        except ValueError as e:
            raise CheckpointError(
                f"unknown architecture {arch!r}: neither a torchvision name "
                f"({', '.join(TORCHVISION_ARCHS)}) nor a preset / timm name"
            ) from e
        if base.embed_dim != width:
            raise CheckpointError(f"architecture {arch!r} has width {base.embed_dim}, the checkpoint {width}")
        return int(overrides.get("num_heads") or base.num_heads), None
    if arch is not None:
        heads = TORCHVISION_ARCHS[arch][2]
    elif overrides.get("num_heads"):
        heads = int(overrides["num_heads"])
    elif width in HEADS_BY_WIDTH:
        heads = HEADS_BY_WIDTH[width]
    else:
        raise CheckpointError(
            f"cannot infer the number of attention heads for width {width}; pass arch= "
            f"({', '.join(TORCHVISION_ARCHS)}) or num_heads="
        )
    return int(overrides.get("num_heads") or heads), arch


@dataclass(frozen=True)
class _Shapes:
    """What a torchvision state dict's shapes tell: patch grid, width, depth, MLP names and width."""

    width: int  # D
    patch: int  # P
    in_chans: int  # C
    side: int  # patches per image side (the position-embedding grid is square)
    depth: int  # encoder layers
    mlp_names: tuple[str, str]  # ("mlp.0", "mlp.3"), or the pre-0.13 ("mlp.linear_1", "mlp.linear_2")
    mlp_dim: int  # M
    has_head: bool  # heads.head present
    num_classes: int  # K rows of heads.head (0 without a head)
    representation_size: int | None  # R rows of heads.pre_logits


def _check_layout(sd: Mapping[str, torch.Tensor], source: str) -> None:
    """CheckpointError for conv-stem variants and state dicts without the patch / position embeddings."""
    if any(k.startswith("conv_proj.conv_") for k in sd):
        raise CheckpointError(
            f"{source}: ViTs with a convolutional stem (conv_stem_configs) are not supported"
        )
    for key in ("conv_proj.weight", "encoder.pos_embedding"):
        if key not in sd:
            raise CheckpointError(f"{source}: missing keys: {key} (not a torchvision VisionTransformer?)")


def _read_shapes(sd: Mapping[str, torch.Tensor], source: str) -> _Shapes:
    """conv_proj.weight [D, C, P, P], encoder.pos_embedding [1, 1 + N, D], the layers and heads -> _Shapes."""
    proj, pos = sd["conv_proj.weight"], sd["encoder.pos_embedding"]
    if proj.ndim != 4 or proj.shape[-1] != proj.shape[-2] or pos.ndim != 3 or pos.shape[0] != 1:
        raise CheckpointError(
            f"{source}: unexpected shapes conv_proj.weight {tuple(proj.shape)}, "
            f"encoder.pos_embedding {tuple(pos.shape)}"
        )
    side = math.isqrt(pos.shape[1] - 1)
    if side * side != pos.shape[1] - 1:
        raise CheckpointError(f"{source}: {pos.shape[1] - 1} position embeddings do not form a square grid")
    layer_ids = {int(m[1]) for k in sd if (m := _LAYER.match(k))}
    depth = max(layer_ids) + 1 if layer_ids else 0
    if depth == 0:
        raise CheckpointError(f"{source}: missing keys: encoder.layers.encoder_layer_0.* (no encoder layers)")
    mlp_names = _MLP_NAMES[1] if "encoder.layers.encoder_layer_0.mlp.linear_1.weight" in sd else _MLP_NAMES[0]
    fc1 = sd.get(f"encoder.layers.encoder_layer_0.{mlp_names[0]}.weight")
    if fc1 is None:
        raise CheckpointError(f"{source}: missing keys: encoder.layers.encoder_layer_0.mlp.0.weight")
    head_w, pre_w = sd.get("heads.head.weight"), sd.get("heads.pre_logits.weight")
    return _Shapes(
        width=int(proj.shape[0]),
        patch=int(proj.shape[-1]),
        in_chans=int(proj.shape[1]),
        side=side,
        depth=depth,
        mlp_names=mlp_names,
        mlp_dim=int(fc1.shape[0]),
        has_head=head_w is not None,
        num_classes=int(head_w.shape[0]) if head_w is not None else 0,
        representation_size=int(pre_w.shape[0]) if pre_w is not None else None,
    )


def _check_arch(shapes: _Shapes, heads: int, arch: str | None, tv_arch: str | None, source: str) -> str | None:
    """The torchvision architecture the shapes are (recognised when `arch` is None), checked against them."""
    if tv_arch is None and arch is None:  # recognise the published architectures by their shapes
        dims = (shapes.patch, shapes.depth, heads, shapes.width, shapes.mlp_dim)
        tv_arch = next((name for name, want in TORCHVISION_ARCHS.items() if want == dims), None)
    if tv_arch is not None:
        want = TORCHVISION_ARCHS[tv_arch]
        got = (shapes.patch, shapes.depth, want[2], shapes.width, shapes.mlp_dim)
        if got != want:
            raise CheckpointError(
                f"{source}: shapes give (patch, layers, heads, width, mlp) = {got}, "
                f"but torchvision {tv_arch} is {want}"
            )
    return tv_arch


def _config_fields(shapes: _Shapes, heads: int) -> dict[str, Any]:
    """ViTConfig fields of a torchvision ViT: pre-LN, [class] token, LayerNorm eps 1e-6, exact GELU."""
    return {
        "img_size": (shapes.side * shapes.patch, shapes.side * shapes.patch),
        "patch_size": shapes.patch,
        "in_chans": shapes.in_chans,
        "num_classes": shapes.num_classes,
        "embed_dim": shapes.width,
        "depth": shapes.depth,
        "num_heads": heads,
        "mlp_dim": shapes.mlp_dim,
        "qkv_bias": True,
        "class_token": True,
        "pool": "token",
        "representation_size": shapes.representation_size,
        "layer_norm_eps": 1e-6,
        "gelu": "exact",
        "resample_mode": "torchvision",
    }


def _renames(shapes: _Shapes) -> dict[str, str]:
    """Our key -> torchvision's key, for every tensor a torchvision ViT of these shapes holds."""
    renames = {
        "patch_embed.proj.weight": "conv_proj.weight",
        "patch_embed.proj.bias": "conv_proj.bias",
        "cls_token": "class_token",
        "pos_embed": "encoder.pos_embedding",
        "norm.weight": "encoder.ln.weight",
        "norm.bias": "encoder.ln.bias",
    }
    block = {
        "norm1": "ln_1",
        "attn.qkv": "self_attention.in_proj",
        "attn.proj": "self_attention.out_proj",
        "norm2": "ln_2",
        "mlp.fc1": shapes.mlp_names[0],
        "mlp.fc2": shapes.mlp_names[1],
    }
    for i in range(shapes.depth):
        for ours, theirs in block.items():
            for leaf in ("weight", "bias"):
                sep = "_" if theirs.endswith("in_proj") else "."
                renames[f"blocks.{i}.{ours}.{leaf}"] = f"encoder.layers.encoder_layer_{i}.{theirs}{sep}{leaf}"
    if shapes.representation_size is not None:
        renames["pre_logits.0.weight"] = "heads.pre_logits.weight"
        renames["pre_logits.0.bias"] = "heads.pre_logits.bias"
    if shapes.has_head:
        renames["head.weight"] = "heads.head.weight"
        renames["head.bias"] = "heads.head.bias"
    return renames


def _renamed(sd: Mapping[str, torch.Tensor], renames: Mapping[str, str], source: str) -> dict[str, torch.Tensor]:
    """`sd` under our names as contiguous float32; every key of `sd` consumed, every renamed one present."""
    missing = [theirs for theirs in renames.values() if theirs not in sd]
    if missing:
        raise CheckpointError(f"{source}: missing keys: {describe_keys(missing)}")
    unexpected = sorted(set(sd) - set(renames.values()))
    if unexpected:
        raise CheckpointError(f"{source}: unexpected keys: {describe_keys(unexpected)}")
    return {ours: sd[theirs].detach().to(torch.float32).contiguous() for ours, theirs in renames.items()}


def convert_torchvision(
    weights: Mapping[str, torch.Tensor],
    arch: str | None = None,
    *,
    weights_tag: str | None = None,
    source: str | None = None,
    **overrides: Any,
) -> Converted:
    """Convert a torchvision VisionTransformer state dict to our layout (pure function).

    Args:
        weights: `torchvision.models.vit_*().state_dict()` (any float dtype, optionally "module."-prefixed;
            MLP names `mlp.0`/`mlp.3` or the pre-0.13 `mlp.linear_1`/`mlp.linear_2`).
        arch: "vit_b_16", "vit_b_32", "vit_l_16", "vit_l_32", "vit_h_14" (checked against the shapes), or a
            preset / timm name; None -> heads from the width (192: 3, 384: 6, 768: 12, 1024/1280: 16).
        weights_tag: torchvision weights name (e.g. "IMAGENET1K_SWAG_E2E_V1") choosing the preprocessing
            contract; see :func:`torchvision_preprocess` for the default.
        source: where the weights came from, for messages.
        overrides: ViTConfig fields to replace. A different `img_size` resamples `pos_embed` with the
            (possibly overridden) `resample_mode`.

    Returns:
        Converted with float32 tensors in our names, layer_norm_eps 1e-6, exact GELU, resample_mode
        "torchvision"; labels None (ImageNet-1k names for a 1000-way head, via Converted).

    Raises:
        CheckpointError: conv-stem variants, missing / unexpected keys (all listed), inconsistent shapes.
    """
    source = source or "torchvision state dict"
    sd = strip_prefixes(weights, ("module.",))
    _check_layout(sd, source)
    shapes = _read_shapes(sd, source)
    heads, tv_arch = _heads(arch, shapes.width, overrides)
    tv_arch = _check_arch(shapes, heads, arch, tv_arch, source)
    native, cfg = make_config(_config_fields(shapes, heads), overrides, source)
    state = _renamed(sd, _renames(shapes), source)
    check_against_model(native, state, source)
    state = resample_to(state, native, cfg)
    pre = torchvision_preprocess(tv_arch, native.img_size[0], weights_tag).with_size(*cfg.img_size)
    return Converted(cfg, state, source=f"{source} ({tv_arch})" if tv_arch else source, preprocess=pre)
