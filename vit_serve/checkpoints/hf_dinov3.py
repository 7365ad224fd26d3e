"""Hugging Face transformers DINOv3 ViTs (`DINOv3ViTModel`, `DINOv3ViTBackbone`; model_type dinov3_vit) -> ours.

Reference reproduced: `transformers.models.dinov3_vit.modeling_dinov3_vit` (read at 5.25): a pre-LN ViT with
LayerScale on both branches, [class] then the register tokens then the patches, no absolute position embedding,
and 2-D RoPE on the patch tokens' q and k only (coordinates of the patch centres normalised to [-1, 1] per axis,
periods rope_theta ** (4 i / head_dim), the "half" layout: our `RopeConfig(kind="dinov3", rotate_half=True)`):

    transformers name (5.x | as the hub's files store it)        ours                           shape
    embeddings.patch_embeddings                                   patch_embed.proj               [D, C, P, P], [D]
    embeddings.cls_token / embeddings.register_tokens             cls_token / reg_token          [1, 1|R, D]
    model.layer.{i}. | layer.{i}.  (L below)
    L.norm1 / L.norm2                                             blocks.{i}.norm1 / norm2       [D]
    L.attention.{q,k,v}_proj                                      blocks.{i}.attn.qkv            3 x [D, D] -> [3D, D]
    L.attention.o_proj                                            blocks.{i}.attn.proj           [D, D]
    L.layer_scale1.lambda1 / L.layer_scale2.lambda1               blocks.{i}.ls1 / ls2.gamma     [D]
    L.mlp.up_proj / L.mlp.down_proj (GELU MLP)                    blocks.{i}.mlp.fc1 / fc2       [M, D], [D, M]
    L.mlp.gate_proj / up_proj / down_proj (use_gated_mlp: SwiGLU) blocks.{i}.mlp.fc1_g / fc1_x / fc2
    norm                                                          norm                           [D]

Biases the config turns off (key_bias false by default, query/value/proj/mlp_bias) are zeros in our fused
layers, except the key's: `k_bias=False`. `embeddings.mask_token` (masked image modelling only) is dropped.
`pooler_output` is the final-LayerNorm [class] token, our `forward_head(tokens, pre_logits=True)`: the embedding
DINOv3 is used with upstream (pool "token", recorded in the manifest as the config's `pool`). The weights are
gated by Meta's licence: they are read from the user's own folder (or hub token), never redistributed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from vit_serve.checkpoints.converted import CheckpointError, Converted, make_config
from vit_serve.checkpoints.hf_transformers import (
    Taker,
    check_consumed,
    family_preprocess,
    finish,
    hf_activation,
    hf_int,
    hf_pair,
    strip_prefix,
)
from vit_serve.checkpoints.unsupported import UnsupportedCheckpoint
from vit_serve.config import RopeConfig

__all__ = ["DINOV3_PROCESSOR_DEFAULTS", "check_dinov3", "convert_dinov3"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# DINOv3ViTImageProcessor's class defaults (transformers 5.25): squash to 224 x 224, bilinear, ImageNet statistics.
DINOV3_PROCESSOR_DEFAULTS: dict[str, Any] = {"size": {"height": 224, "width": 224}, "resample": 2,
                                             "image_mean": IMAGENET_MEAN, "image_std": IMAGENET_STD}
_DROPPED = re.compile(r"^embeddings\.mask_token$")
SEVEN_B_WIDTH = 4096  # DINOv3 ViT-7B/16's hidden_size; the distilled ViTs are at most 1280 (H+)


def check_dinov3(config: Mapping[str, Any]) -> None:
    """UnsupportedCheckpoint (one line) for the DINOv3 configs we refuse, from config.json alone (before the
    weights are read): the 7B (hidden_size 4096), as timm's `vit_7b_patch16_dinov3` is refused."""
    if hf_int(config, "hidden_size", 384) >= SEVEN_B_WIDTH:
        raise UnsupportedCheckpoint(f"config.json model_type='dinov3_vit' with hidden_size={config['hidden_size']}: "
                                    "the 7B DINOv3 (6.7B parameters) is beyond what vit-serve exports and serves")


def _fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json of a DINOv3ViTConfig -> ViTConfig fields (HF defaults where absent)."""
    check_dinov3(config)
    ph, pw = hf_pair(config.get("patch_size", 16), "patch_size")
    if ph != pw:
        raise CheckpointError(f"config.json patch_size={ph}x{pw}: only square patches are supported")
    gated = bool(config.get("use_gated_mlp", False))
    if gated and config.get("hidden_act", "gelu") != "silu":
        raise UnsupportedCheckpoint(f"config.json use_gated_mlp with hidden_act={config.get('hidden_act')!r}: only "
                                    "the SiLU-gated MLP (SwiGLU) is supported")
    q, k, v = (bool(config.get(f"{n}_bias", d)) for n, d in (("query", True), ("key", False), ("value", True)))
    return {
        "img_size": hf_pair(config.get("image_size", 224), "image_size"), "patch_size": ph,
        "in_chans": hf_int(config, "num_channels", 3), "num_classes": 0,
        "embed_dim": hf_int(config, "hidden_size", 384), "depth": hf_int(config, "num_hidden_layers", 12),
        "num_heads": hf_int(config, "num_attention_heads", 6), "mlp_dim": hf_int(config, "intermediate_size", 1536),
        "qkv_bias": q or k or v, "k_bias": k or not (q or v),
        "layer_norm_eps": float(config.get("layer_norm_eps", 1e-5)),
        "gelu": "exact" if gated else hf_activation(config, "gelu"), "mlp": "swiglu" if gated else "gelu",
        "init_values": float(config.get("layerscale_value", 1.0)),
        "reg_tokens": int(config.get("num_register_tokens", 0)), "class_token": True, "pool": "token",
        "pos_embed": False, "rope": RopeConfig(kind="dinov3", temperature=float(config.get("rope_theta", 100.0)),
                                               grid_indexing="ij", rotate_half=True),
        "family": "dinov3",
    }


def _bias_or_zeros(take: Taker, key: str, present: bool, dim: int) -> torch.Tensor | None:
    return take(key) if present else torch.zeros(dim)


def _block(take: Taker, pre: str, i: int, config: Mapping[str, Any], dim: int, mlp_dim: int
           ) -> dict[str, torch.Tensor | None]:
    """Layer `i` (HF prefix `pre`) under our names, absent biases as zeros."""
    out: dict[str, torch.Tensor | None] = {}
    for n in ("norm1", "norm2"):
        out[f"blocks.{i}.{n}.weight"], out[f"blocks.{i}.{n}.bias"] = take(f"{pre}{n}.weight"), take(f"{pre}{n}.bias")
    a = f"{pre}attention."
    parts = [take(f"{a}{n}_proj.weight") for n in "qkv"]
    out[f"blocks.{i}.attn.qkv.weight"] = None if any(p is None for p in parts) else torch.cat(parts)  # type: ignore
    flags = [bool(config.get(f"{n}_bias", d)) for n, d in (("query", True), ("key", False), ("value", True))]
    if any(flags):
        biases = [_bias_or_zeros(take, f"{a}{n}_proj.bias", f, dim) for n, f in zip("qkv", flags, strict=True)]
        out[f"blocks.{i}.attn.qkv.bias"] = None if any(b is None for b in biases) else torch.cat(biases)  # type: ignore
    out[f"blocks.{i}.attn.proj.weight"] = take(f"{a}o_proj.weight")
    out[f"blocks.{i}.attn.proj.bias"] = _bias_or_zeros(take, f"{a}o_proj.bias", config.get("proj_bias", True), dim)
    out[f"blocks.{i}.ls1.gamma"] = take(f"{pre}layer_scale1.lambda1")
    out[f"blocks.{i}.ls2.gamma"] = take(f"{pre}layer_scale2.lambda1")
    mlp_bias = bool(config.get("mlp_bias", True))
    names = ((("gate_proj", "fc1_g", mlp_dim), ("up_proj", "fc1_x", mlp_dim)) if config.get("use_gated_mlp")
             else (("up_proj", "fc1", mlp_dim),)) + (("down_proj", "fc2", dim),)
    for theirs, ours, width in names:
        out[f"blocks.{i}.mlp.{ours}.weight"] = take(f"{pre}mlp.{theirs}.weight")
        out[f"blocks.{i}.mlp.{ours}.bias"] = _bias_or_zeros(take, f"{pre}mlp.{theirs}.bias", mlp_bias, width)
    return out


def convert_dinov3(config: Mapping[str, Any], weights: Mapping[str, torch.Tensor],
                   preprocessor: Mapping[str, Any] | None = None, *, source: str | None = None,
                   **overrides: Any) -> Converted:
    """Convert a transformers `DINOv3ViTModel` / `DINOv3ViTBackbone` (model_type dinov3_vit) to our layout (pure).

    Args:
        config: config.json as a dict. weights: the state dict (5.x `model.layer.*` or the hub files'
            `layer.*` names). preprocessor: preprocessor_config.json, or None for DINOv3ViTImageProcessor's
            defaults. overrides: ViTConfig fields (another `img_size` needs nothing resampled: RoPE follows
            the grid).

    Returns:
        Converted with num_classes 0: `forward_head(tokens, pre_logits=True)` is HF's `pooler_output`.
    """
    source = source or "transformers dinov3_vit checkpoint"
    sd = strip_prefix(weights, "dinov3.")
    native, cfg = make_config(_fields(config), overrides, source)
    take = Taker(sd)
    state: dict[str, torch.Tensor | None] = {
        "patch_embed.proj.weight": take("embeddings.patch_embeddings.weight"),
        "patch_embed.proj.bias": take("embeddings.patch_embeddings.bias"), "cls_token": take("embeddings.cls_token")}
    if native.reg_tokens:
        state["reg_token"] = take("embeddings.register_tokens")
    elif "embeddings.register_tokens" in sd and sd["embeddings.register_tokens"].numel() == 0:
        take("embeddings.register_tokens")  # HF keeps an empty [1, 0, D] parameter without registers
    layer = "model.layer." if any(k.startswith("model.layer.") for k in sd) else "layer."
    for i in range(native.depth):
        state.update(_block(take, f"{layer}{i}.", i, config, native.embed_dim, native.mlp_dim))
    state["norm.weight"], state["norm.bias"] = take("norm.weight"), take("norm.bias")
    check_consumed(take, source, f"a transformers DINOv3 ViT with {native.depth} layers", _DROPPED)
    h, w = native.img_size  # the processor's class default is 224 x 224, the size of the released models
    defaults = {**DINOV3_PROCESSOR_DEFAULTS, "size": {"height": h, "width": w}}
    return finish(native, cfg, state, source, family_preprocess(preprocessor, defaults, native.img_size, True))
