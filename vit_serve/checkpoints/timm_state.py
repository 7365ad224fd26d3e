"""timm `VisionTransformer` state dicts -> our layout (timm's parameter names are ours)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from vit_serve.checkpoints.converted import CheckpointError, Converted, strip_prefixes
from vit_serve.checkpoints.unsupported import UnsupportedCheckpoint
from vit_serve.config import HEADS_BY_WIDTH, ViTConfig, backbone_stride, get_config, unsupported_reason
from vit_serve.preprocess import PreprocessConfig

_BLOCK = re.compile(r"^blocks\.(\d+)\.")
_STAGE = re.compile(r"^patch_embed\.backbone\.stages\.(\d+)\.blocks\.(\d+)\.")


_SWIGLU_KEYS = re.compile(r"^blocks\.0\.mlp\.(w12|w1|w2|w3|fc1_g|fc1_x)\.")
_ACTS = {"gelu": "exact", "gelu_tanh": "tanh", "quick_gelu": "quick"}


def is_timm_layout(keys: Iterable[str]) -> bool:
    """timm's ViT-like layout: a patch conv plus absolute position embeddings or timm-named blocks (BEiT and
    EVA come here too, to be refused by name)."""
    keys = set(keys)
    return "patch_embed.proj.weight" in keys and ("pos_embed" in keys or "blocks.0.norm1.weight" in keys)


def _missing_pieces(sd: Mapping[str, torch.Tensor], arch: str | None) -> str | None:
    """One line naming what a state dict / architecture needs that our model lacks, or None."""
    if arch and (why := unsupported_reason(arch)):
        return f"{arch}: {why}"
    found = []
    if any("relative_position_bias_table" in k for k in sd):
        found.append("BEiT-style relative position bias (relative_position_bias_table)")
    if any(k.startswith("rope.") or ".rope." in k for k in sd):
        found.append("rotary position embeddings (rope.*)")
    fc1, fc2 = sd.get("blocks.0.mlp.fc1.weight"), sd.get("blocks.0.mlp.fc2.weight")
    if any(_SWIGLU_KEYS.match(k) for k in sd) or (fc1 is not None and fc2 is not None and fc1.shape[0] != fc2.shape[1]):
        found.append("a SwiGLU MLP (mlp.w12 / fc1 twice fc2's width)")
    if "blocks.0.attn.q_bias" in sd:
        found.append("separate q/v biases (attn.q_bias, EVA / BEiT)")
    if "fc_norm.weight" in sd:
        found.append("fc_norm (a LayerNorm after pooling)")
    if "pos_embed" not in sd:
        found.append("absolute position embeddings (no pos_embed)")
    if "attn_pool.latent" in sd and sd["attn_pool.latent"].shape[1] != 1:
        found.append("an attention pool with several latents")
    if not found:
        return None
    eva = "EVA-02-like " if "blocks.0.attn.q_bias" in sd and "SwiGLU" in " ".join(found) else ""
    return f"{eva}timm model not supported: needs " + "; ".join(found)


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


def _name_hints(arch: str) -> dict[str, Any]:
    """What an architecture name outside the presets still says (timm's naming): family, act, CLIP's eps."""
    hints: dict[str, Any] = {}
    for fam in ("deit", "dinov2", "clip", "siglip"):
        if fam in arch:
            hints["family"] = fam
    if "quickgelu" in arch:
        hints["gelu"] = "quick"
    if "_clip_" in arch:
        hints["layer_norm_eps"] = 1e-5
    return hints


def _family_from_keys(fields: Mapping[str, Any]) -> dict[str, Any]:
    """No architecture name: the family from the keys, with timm's defaults for it (see convert_timm)."""
    if fields["dist_token"]:
        return {"family": "deit"}
    if fields["norm_pre"]:
        return {"family": "clip", "layer_norm_eps": 1e-5}
    if fields["pool"] == "map":
        return {"family": "siglip"}
    if fields["init_values"] is not None or fields["reg_tokens"]:
        return {"family": "dinov2"}
    return {}


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
    fields["dist_token"] = "dist_token" in sd
    fields["reg_tokens"] = sd["reg_token"].shape[1] if "reg_token" in sd else 0
    fields["norm_pre"] = "norm_pre.weight" in sd
    fields["patch_bias"] = "patch_embed.proj.bias" in sd
    fields["pool"] = "map" if "attn_pool.latent" in sd else "token" if fields["class_token"] else "gap"
    if model_args.get("global_pool") == "avg":
        fields["pool"] = "gap"
    fields["num_classes"] = sd["head.weight"].shape[0] if "head.weight" in sd else 0
    base = get_config(arch) if arch and _known(arch) else None
    has_ls = "blocks.0.ls1.gamma" in sd
    fields["init_values"] = (model_args.get("init_values") or (base and base.init_values) or 1e-5) if has_ls else None
    prefix = int(fields["class_token"]) + int(fields["dist_token"]) + fields["reg_tokens"]
    grid, fields["no_embed_class"] = _grid(sd["pos_embed"].shape[1], prefix, fields["patch_size"],
                                           model_args.get("img_size"), fields["reg_tokens"] > 0)
    fields["img_size"] = (grid[0] * fields["patch_size"], grid[1] * fields["patch_size"])
    heads = model_args.get("num_heads") or (base.num_heads if base else HEADS_BY_WIDTH.get(d))
    if heads is None:
        raise CheckpointError(f"cannot infer the number of attention heads for width {d}; "
                              "pass the timm architecture name (--arch)")
    fields["num_heads"] = heads
    if base is not None:
        named = ("std_conv_style", "std_conv_eps", "group_norm_eps", "layer_norm_eps", "gelu", "family")
        fields = {**{k: getattr(base, k) for k in named}, **fields}
    else:
        fields = {**(_name_hints(arch) if arch else _family_from_keys(fields)), **fields}
    if isinstance(model_args.get("act_layer"), str) and model_args["act_layer"] in _ACTS:
        fields["gelu"] = _ACTS[model_args["act_layer"]]
    return ViTConfig(resample_mode="timm", **fields)


def _known(arch: str) -> bool:
    try:
        get_config(arch)
    except ValueError:
        return False
    return True


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
    """Convert a timm ViT / R50-hybrid / DeiT / DINOv2 / CLIP / SigLIP state dict; reproduces
    `timm.create_model(arch)` exactly.

    From the keys: [dist] token (`dist_token`, `head_dist`), registers (`reg_token` [1, R, D]), no_embed_class
    (`pos_embed` rows = N rather than prefix + N), LayerScale (`blocks.i.ls1.gamma`), norm_pre, patch bias,
    MAP pooling (`attn_pool.latent`), mlp_dim (fc1). From the architecture name: heads, LayerNorm eps (1e-5
    for timm's CLIP towers), the activation (QuickGELU for `*quickgelu*`; per SigLIP arch exact or tanh, as
    timm builds them) and the family. Without a name the family comes from the keys, with timm's defaults:
    norm_pre -> CLIP (eps 1e-5, exact GELU: OpenAI weights need the `_quickgelu_` name), attn_pool -> SigLIP
    (exact GELU: SigLIP 2 shapes need their name), LayerScale / registers -> DINOv2, dist_token -> DeiT.
    Refused in one line naming what is missing: EVA-02 (RoPE, SwiGLU), BEiT (relative position bias), SwiGLU
    MLPs (DINOv2 giant), fc_norm.

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
    if missing := _missing_pieces(sd, arch):
        raise UnsupportedCheckpoint(missing)
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
