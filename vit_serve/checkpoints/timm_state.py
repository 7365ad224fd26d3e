"""timm `VisionTransformer` state dicts -> our layout (timm's parameter names are ours)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from vit_serve.checkpoints.converted import CheckpointError, Converted, strip_prefixes
from vit_serve.config import HEADS_BY_WIDTH, ViTConfig, backbone_stride, get_config
from vit_serve.preprocess import PreprocessConfig

_BLOCK = re.compile(r"^blocks\.(\d+)\.")
_STAGE = re.compile(r"^patch_embed\.backbone\.stages\.(\d+)\.blocks\.(\d+)\.")


def is_timm_layout(keys: Iterable[str]) -> bool:
    keys = set(keys)
    return "patch_embed.proj.weight" in keys and "pos_embed" in keys


def _infer_config(sd: Mapping[str, torch.Tensor], arch: str | None, model_args: Mapping[str, Any]) -> ViTConfig:
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
    fields["mlp_dim"] = sd["blocks.0.mlp.fc1.weight"].shape[0]
    fields["qkv_bias"] = "blocks.0.attn.qkv.bias" in sd
    fields["class_token"] = "cls_token" in sd
    if not fields["class_token"]:
        fields["pool"] = "gap"
    fields["num_classes"] = sd["head.weight"].shape[0] if "head.weight" in sd else 0
    n_patch = sd["pos_embed"].shape[1] - int(fields["class_token"])
    side = math.isqrt(n_patch)
    if side * side != n_patch:
        raise CheckpointError(f"cannot infer a square patch grid from {n_patch} position embeddings")
    fields["img_size"] = (side * fields["patch_size"],) * 2

    base = get_config(arch) if arch else None
    heads = model_args.get("num_heads") or (base.num_heads if base else HEADS_BY_WIDTH.get(d))
    if heads is None:
        raise CheckpointError(f"cannot infer the number of attention heads for width {d}; "
                              "pass the timm architecture name (--arch)")
    fields["num_heads"] = heads
    if model_args.get("global_pool") == "avg":
        fields["pool"] = "gap"
    if model_args.get("fc_norm"):
        raise CheckpointError("timm models with fc_norm (LayerNorm after pooling) are not supported")
    if base is not None:
        fields = {**{k: getattr(base, k) for k in ("std_conv_style", "std_conv_eps", "group_norm_eps")}, **fields}
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
    """Convert a timm ViT / R50-hybrid state dict; reproduces `timm.create_model(arch)` exactly.

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
    try:
        cfg = _infer_config(sd, arch, hub_config.get("model_args", {}))
        cfg = cfg.replace(**overrides) if overrides else cfg
    except (KeyError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"timm state dict: cannot infer the model ({e})") from e
    labels = hub_config.get("label_names")
    pre = _preprocess(hub_config.get("pretrained_cfg", {}), cfg.img_size)
    state = {k: v.float() if v.is_floating_point() else v for k, v in sd.items()}
    return Converted(cfg, state, source="timm state dict", labels=list(labels) if labels else None,
                     preprocess=pre)
