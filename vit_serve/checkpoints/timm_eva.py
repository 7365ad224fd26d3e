"""timm `Eva` state dicts (timm.models.eva: DINOv3, PE, EVA / EVA-02, RoPE-ViT) -> our layout.

The architecture comes from its timm name (`vit_serve.config.get_config`: RoPE variant, SwiGLU, norms, pooling);
the widths, depth, head and grid from the weights. Renamed: `gamma_1/2` -> `ls1/ls2.gamma`; EVA's `q_bias` /
`v_bias` -> `qkv.bias` with a zero key third (our `k_bias=False` keeps it zero); separate `q_proj` / `k_proj` /
`v_proj` -> one `qkv`; the packed SwiGLU `mlp.fc1` (timm GluMlp: gate first) -> `mlp.fc1_g` / `mlp.fc1_x`. The
rest (RoPE-mixed's `rope.freqs`, `attn.norm`, `mlp.norm`, `fc_norm`, `attn_pool.*`) keeps timm's names.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from vit_serve.checkpoints.converted import CheckpointError
from vit_serve.config import ViTConfig

EVA_FAMILIES = ("dinov3", "pe", "eva", "ropevit")
_BLOCK = re.compile(r"^blocks\.(\d+)\.")
_POOLS = {"token": "token", "avg": "gap", "map": "map"}


def _attn(sd: dict[str, torch.Tensor], p: str) -> None:
    """EVA's attention parameters under prefix `p` ("blocks.i.attn.") -> one `qkv` weight and bias, in place."""
    if f"{p}q_proj.weight" in sd:
        w = [sd.pop(f"{p}{n}_proj.weight") for n in "qkv"]
        sd[f"{p}qkv.weight"] = torch.cat(w)
        biases = [sd.pop(f"{p}{n}_proj.bias", None) for n in "qkv"]
        if biases[0] is not None:
            sd[f"{p}qkv.bias"] = torch.cat([b if b is not None else torch.zeros_like(biases[0]) for b in biases])
    if f"{p}q_bias" in sd:
        q, v = sd.pop(f"{p}q_bias"), sd.pop(f"{p}v_bias")
        sd[f"{p}qkv.bias"] = torch.cat([q, torch.zeros_like(q), v])


def _mlp(sd: dict[str, torch.Tensor], p: str, swiglu: bool) -> None:
    """The packed SwiGLU fc1 [2h, D] (gate rows first) under prefix `p` -> fc1_g / fc1_x, in place."""
    if not swiglu or f"{p}fc1.weight" not in sd:
        return
    for kind in ("weight", "bias"):
        if (t := sd.pop(f"{p}fc1.{kind}", None)) is not None:
            sd[f"{p}fc1_g.{kind}"], sd[f"{p}fc1_x.{kind}"] = t.chunk(2, dim=0)


def rename_eva(weights: Mapping[str, torch.Tensor], swiglu: bool) -> dict[str, torch.Tensor]:
    """A timm Eva state dict in our parameter names (see the module docstring)."""
    sd = {k: v for k, v in weights.items()}
    for k in [k for k in sd if k.endswith((".gamma_1", ".gamma_2"))]:
        sd[k[:-len("gamma_1")] + ("ls1.gamma" if k.endswith("1") else "ls2.gamma")] = sd.pop(k)
    depth = 1 + max(int(m[1]) for k in sd if (m := _BLOCK.match(k)))
    for i in range(depth):
        _attn(sd, f"blocks.{i}.attn.")
        _mlp(sd, f"blocks.{i}.mlp.", swiglu)
    return sd


def _grid(base: ViTConfig, sd: Mapping[str, torch.Tensor], patch: int, prefix: int, no_embed_class: bool,
          img: Any) -> tuple[int, int]:
    """The patch grid: a recorded image size, else the absolute embeddings' square grid, else the arch's."""
    if img is not None:
        h, w = (img, img) if isinstance(img, int) else img
        return h // patch, w // patch
    if "pos_embed" in sd:
        n = sd["pos_embed"].shape[1] - (0 if no_embed_class else prefix)
        side = math.isqrt(n)
        if side * side != n:
            raise CheckpointError(f"cannot infer a square patch grid from {n} position embeddings; a timm hub "
                                  "config.json with model_args.img_size says")
        return side, side
    return base.img_size[0] // base.patch_size, base.img_size[1] // base.patch_size


def eva_config(base: ViTConfig, sd: Mapping[str, torch.Tensor], model_args: Mapping[str, Any]) -> ViTConfig:
    """`base` (the architecture's config) with the widths, depth, heads, head and grid of the weights (our names)
    and the hub config's `model_args` (num_heads, img_size, global_pool, attn_pool_num_heads, ref_feat_shape)."""
    proj = sd["patch_embed.proj.weight"]
    d, patch = proj.shape[0], proj.shape[-1]
    fields: dict[str, Any] = dict(embed_dim=d, patch_size=patch, in_chans=proj.shape[1],
                                  depth=1 + max(int(m[1]) for k in sd if (m := _BLOCK.match(k))),
                                  mlp_dim=sd["blocks.0.mlp.fc2.weight"].shape[1],
                                  num_classes=sd["head.weight"].shape[0] if "head.weight" in sd else 0,
                                  num_heads=model_args.get("num_heads") or base.num_heads,
                                  reg_tokens=sd["reg_token"].shape[1] if "reg_token" in sd else 0)
    if "attn_pool.mlp.fc1.weight" in sd:
        fields["pool_mlp_dim"] = sd["attn_pool.mlp.fc1.weight"].shape[0]
        fields["pool_heads"] = model_args.get("attn_pool_num_heads") or base.pool_heads
    if base.rope is not None and (ref := model_args.get("ref_feat_shape")) is not None:
        ref = (ref, ref) if isinstance(ref, int) else tuple(ref)
        fields["rope"] = dataclasses.replace(base.rope, ref_grid=ref)
    if (pool := model_args.get("global_pool")) in _POOLS:
        fields["pool"] = _POOLS[pool]
    prefix = int(base.class_token) + int(base.dist_token) + fields["reg_tokens"]
    gh, gw = _grid(base, sd, patch, prefix, base.no_embed_class, model_args.get("img_size"))
    fields["img_size"] = (gh * patch, gw * patch)
    return base.replace(**fields)


def convert_timm_eva(sd: Mapping[str, torch.Tensor], base: ViTConfig, hub_config: Mapping[str, Any],
                     **overrides: Any) -> tuple[ViTConfig, dict[str, torch.Tensor]]:
    """(config, our state dict) of a timm Eva state dict whose architecture resolved to `base`."""
    state = rename_eva({k: v.float() if v.is_floating_point() else v for k, v in sd.items()}, base.mlp == "swiglu")
    try:
        cfg = eva_config(base, state, hub_config.get("model_args", {}))
        return (cfg.replace(**overrides) if overrides else cfg), state
    except (KeyError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"timm Eva state dict: cannot infer the model ({e})") from e

