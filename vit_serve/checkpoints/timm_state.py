"""timm state dicts -> our layout: `VisionTransformer` (its parameter names are ours) and, through
`timm_eva`, `Eva` (DINOv3, PE, EVA-02, RoPE-ViT). What a state dict is, is decided by its architecture's name
(--arch or the hub config.json's `architecture`), never by the keys it happens to have."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from vit_serve.checkpoints.converted import CheckpointError, Converted, one_line, strip_prefixes
from vit_serve.checkpoints.timm_eva import EVA_FAMILIES, convert_timm_eva, rename_eva
from vit_serve.checkpoints.unsupported import UnsupportedCheckpoint
from vit_serve.config import ViTConfig, backbone_stride, get_config, unsupported_reason
from vit_serve.preprocess import PreprocessConfig

_BLOCK = re.compile(r"^blocks\.(\d+)\.")
_STAGE = re.compile(r"^patch_embed\.backbone\.stages\.(\d+)\.blocks\.(\d+)\.")
_ACTS = {"gelu": "exact", "gelu_tanh": "tanh", "quick_gelu": "quick"}


def is_timm_layout(keys: Iterable[str]) -> bool:
    """timm's ViT-like layout: a patch conv plus absolute position embeddings or timm-named blocks (BEiT and
    EVA come here too, to be refused by name)."""
    keys = set(keys)
    return "patch_embed.proj.weight" in keys and ("pos_embed" in keys or "blocks.0.norm1.weight" in keys)


def architecture_of(arch: str | None) -> ViTConfig:
    """The config of a timm architecture name; UnsupportedCheckpoint (one line, exit 2) for no name, a refused
    architecture or an unknown one. A bare state dict cannot be told from a plain ViT by its keys (PE-Core's
    rotary embeddings have none), so it needs the name."""
    if not arch:
        raise UnsupportedCheckpoint("a bare timm state dict does not say its architecture: pass --arch NAME (its timm "
                                    "model name, e.g. vit_base_patch16_224), or convert its timm hub folder")
    if why := unsupported_reason(arch):
        raise UnsupportedCheckpoint(f"{arch}: {why}")
    try:
        return get_config(arch)
    except ValueError as e:
        raise UnsupportedCheckpoint(one_line(e)) from e


def _grid(rows: int, prefix: int, patch: int, img: Any, reg: bool) -> tuple[tuple[int, int], bool]:
    """(patch grid, no_embed_class) from `pos_embed` rows: prefix + N (timm's default) or N (no_embed_class).

    A recorded image size (hub config `model_args.img_size`) decides; else the candidate that is a square grid,
    preferring no_embed_class when both are and there are registers (the DINOv2-reg convention)."""
    if img is not None:
        h, w = (img, img) if isinstance(img, int) else img
        n = (h // patch) * (w // patch)
        if rows in (n, n + prefix):
            return (h // patch, w // patch), rows == n and prefix > 0
    options = [(rows - prefix, False)] + ([(rows, True)] if prefix else [])
    square = [(math.isqrt(n), nec) for n, nec in options if n > 0 and math.isqrt(n) ** 2 == n]
    if not square:
        raise CheckpointError(f"cannot infer a square patch grid from {rows} position embeddings with {prefix} "
                              "prefix tokens; a timm hub config.json with model_args.img_size says")
    side, nec = next((s for s in square if s[1]), square[0]) if reg else square[0]
    return (side, side), nec


def _infer_config(sd: Mapping[str, torch.Tensor], base: ViTConfig, model_args: Mapping[str, Any]) -> ViTConfig:
    proj = sd["patch_embed.proj.weight"]  # [D, C_in, k, k]
    d = proj.shape[0]
    fields: dict[str, Any] = dict(embed_dim=d)
    if "patch_embed.backbone.stem.conv.weight" in sd:
        stages: dict[int, int] = {}
        for k in sd:
            if m := _STAGE.match(k):
                stages[int(m[1])] = max(stages.get(int(m[1]), 0), int(m[2]) + 1)
        fields["resnet_layers"] = tuple(stages[i] for i in sorted(stages))
        fields["resnet_width"] = sd["patch_embed.backbone.stem.conv.weight"].shape[0]
        fields["in_chans"] = sd["patch_embed.backbone.stem.conv.weight"].shape[1]
        fields["patch_size"] = backbone_stride(fields["resnet_layers"]) * proj.shape[-1]
    else:
        fields["patch_size"] = proj.shape[-1]
        fields["in_chans"] = proj.shape[1]
    fields["depth"] = 1 + max(int(m[1]) for k in sd if (m := _BLOCK.match(k)))
    fields["mlp_dim"] = sd["blocks.0.mlp.fc2.weight"].shape[1]
    fields["qkv_bias"] = "blocks.0.attn.qkv.bias" in sd
    fields["class_token"] = "cls_token" in sd
    fields["dist_token"] = "dist_token" in sd
    fields["reg_tokens"] = sd["reg_token"].shape[1] if "reg_token" in sd else 0
    fields["norm_pre"] = "norm_pre.weight" in sd
    fields["patch_bias"] = "patch_embed.proj.bias" in sd
    fields["pool"] = "map" if "attn_pool.latent" in sd else "token" if fields["class_token"] else "gap"
    if model_args.get("global_pool") == "avg":
        fields["pool"] = "gap"
    fields["num_classes"] = sd["head.weight"].shape[0] if "head.weight" in sd else 0
    has_ls = "blocks.0.ls1.gamma" in sd
    fields["init_values"] = (model_args.get("init_values") or base.init_values or 1e-5) if has_ls else None
    prefix = int(fields["class_token"]) + int(fields["dist_token"]) + fields["reg_tokens"]
    grid, fields["no_embed_class"] = _grid(sd["pos_embed"].shape[1], prefix, fields["patch_size"],
                                           model_args.get("img_size"), fields["reg_tokens"] > 0)
    fields["img_size"] = (grid[0] * fields["patch_size"], grid[1] * fields["patch_size"])
    fields["num_heads"] = model_args.get("num_heads") or base.num_heads
    named = ("std_conv_style", "std_conv_eps", "group_norm_eps", "layer_norm_eps", "gelu", "family", "mlp")
    fields = {**{k: getattr(base, k) for k in named}, **fields}
    if isinstance(model_args.get("act_layer"), str) and model_args["act_layer"] in _ACTS:
        fields["gelu"] = _ACTS[model_args["act_layer"]]
    return ViTConfig(resample_mode="timm", **fields)


def _preprocess(pretrained_cfg: Mapping[str, Any], img_size: tuple[int, int]) -> PreprocessConfig:
    pc = PreprocessConfig(input_size=img_size)
    keys = {"mean": tuple, "std": tuple, "interpolation": str, "crop_pct": float, "crop_mode": str}
    changes = {k: cast(pretrained_cfg[k]) for k, cast in keys.items() if pretrained_cfg.get(k) is not None}
    return PreprocessConfig(**{**pc.to_dict(), **changes, "input_size": img_size})


def convert_timm(
    weights: Mapping[str, torch.Tensor],
    arch: str | None = None,
    hub_config: Mapping[str, Any] | None = None,
    **overrides: Any,
) -> Converted:
    """Convert a timm ViT / R50-hybrid / DeiT / DINOv2 / CLIP / SigLIP state dict, or an Eva one (DINOv3, PE,
    EVA-02, RoPE-ViT: `timm_eva`); reproduces `timm.create_model(arch)` exactly.

    From the keys: [dist] token (`dist_token`, `head_dist`), registers (`reg_token` [1, R, D]), no_embed_class
    (`pos_embed` rows = N rather than prefix + N), LayerScale (`blocks.i.ls1.gamma`), norm_pre, patch bias,
    MAP pooling (`attn_pool.latent`), mlp_dim (fc2's input). From the architecture name: heads, LayerNorm eps
    (1e-5 for timm's CLIP towers), the activation (QuickGELU for `*quickgelu*`; per SigLIP arch exact or tanh,
    as timm builds them), the MLP (SwiGLU for DINOv2 giant) and the family. The architecture decides
    (`architecture_of`): refused in one line, naming what is missing, without a name (a bare state dict), for a
    refused architecture (BEiT, RADIO, the 7B DINOv3, ...) and an unknown one.

    Args:
        weights: timm state dict (`patch_embed.proj.weight` [D, C, P, P], `pos_embed` [1, 1 + N, D], ...),
            optionally wrapped by DDP ("module.") or torch.compile ("_orig_mod.").
        arch: timm architecture name, for what the weights cannot tell (number of heads).
        hub_config: a timm hub `config.json` (architecture, num_classes, label_names, model_args,
            pretrained_cfg with the preprocessing contract).
        overrides: ViTConfig fields to replace.
    """
    sd = strip_prefixes(weights, ("module.", "_orig_mod.", "model."))
    if not is_timm_layout(sd):
        raise CheckpointError("not a timm VisionTransformer state dict (no patch_embed.proj.weight / pos_embed)")
    hub_config = hub_config or {}
    arch = arch or hub_config.get("architecture")
    base = architecture_of(arch)
    labels = hub_config.get("label_names")
    if base.family in EVA_FAMILIES:
        cfg, state = convert_timm_eva(sd, base, hub_config, **overrides)
        pre = _preprocess(hub_config.get("pretrained_cfg", {}), cfg.img_size)
        return Converted(cfg, state, source="timm Eva state dict", labels=list(labels) if labels else None,
                         preprocess=pre)
    if base.mlp == "swiglu":  # DINOv2 giant: timm's packed GluMlp fc1 -> fc1_g / fc1_x
        sd = rename_eva(sd, swiglu=True)
    try:
        cfg = _infer_config(sd, base, hub_config.get("model_args", {}))
        cfg = cfg.replace(**overrides) if overrides else cfg
    except (KeyError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"timm state dict: cannot infer the model ({e})") from e
    pre = _preprocess(hub_config.get("pretrained_cfg", {}), cfg.img_size)
    state = {k: v.float() if v.is_floating_point() else v for k, v in sd.items()}
    return Converted(cfg, state, source="timm state dict", labels=list(labels) if labels else None,
                     preprocess=pre)
