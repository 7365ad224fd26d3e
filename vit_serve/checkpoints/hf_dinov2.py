"""Hugging Face transformers DINOv2 (`Dinov2Model`, `Dinov2WithRegistersModel`) -> our layout.

Reference reproduced: `transformers.models.dinov2.modeling_dinov2` and `...dinov2_with_registers` (read at 5.24):
a pre-LN ViT with LayerScale on both residual branches, patch 14, and (with registers) register tokens that
get no position embedding:

    transformers name (legacy on disk | 5.x in memory)            ours                   shape
    embeddings.patch_embeddings.projection                        patch_embed.proj       [D, C, 14, 14], [D]
    embeddings.cls_token                                          cls_token              [1, 1, D]
    embeddings.register_tokens (with registers)                   reg_token              [1, R, D]
    embeddings.position_embeddings                                pos_embed              [1, 1 + N, D]
    L.norm1 / L.norm2                                             blocks.{i}.norm1/norm2 [D]
    L.attention.attention.{query,key,value} | L.attention.{q,k,v}_proj
                                                                  blocks.{i}.attn.qkv    3 x [D, D] -> [3D, D]
    L.attention.output.dense | L.attention.o_proj                 blocks.{i}.attn.proj   [D, D]
    L.layer_scale1.lambda1 / L.layer_scale2.lambda1               blocks.{i}.ls1/ls2.gamma [D]
    L.mlp.fc1 / L.mlp.fc2                                         blocks.{i}.mlp.fc1/fc2 [M, D], [D, M]
    layernorm                                                     norm                   [D]

with L = `encoder.layer.{i}`; `embeddings.mask_token` (masked image modelling only) is dropped. HF adds the
class position embedding to [class] and then inserts the registers after it, unembedded; ours with
`no_embed_class` embeds the patches only, so the class row is folded into `cls_token` (cls + pos[0], the same
sum HF computes, as timm's `_convert_dinov2` does): exact. `pooler_output` is the final-LayerNorm [class]
token, our `forward_head(tokens, pre_logits=True)`.

Resampling for other sizes: Dinov2Embeddings.interpolate_pos_encoding is bicubic without antialias ("hf");
the registers version passes antialias=True ("timm"). Refused: `use_swiglu_ffn` (the giant models' SwiGLU
FFN) and `Dinov2ForImageClassification` (its classifier reads [class; mean of patches]).
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
    fused_qkv,
    hf_activation,
    hf_int,
    hf_pair,
    strip_prefix,
)
from vit_serve.checkpoints.unsupported import UnsupportedCheckpoint
from vit_serve.config import ViTConfig

__all__ = ["BIT_PROCESSOR_DEFAULTS", "OPENAI_CLIP_MEAN", "OPENAI_CLIP_STD", "convert_dinov2", "sized_defaults"]

# BitImageProcessor's class defaults (transformers 5.24), the processor DINOv2 folders name; sizes follow the model.
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BIT_PROCESSOR_DEFAULTS: dict[str, Any] = {"resample": 3, "do_center_crop": True, "image_mean": OPENAI_CLIP_MEAN,
                                          "image_std": OPENAI_CLIP_STD}
_QKV = (("attention.attention.query", "attention.attention.key", "attention.attention.value"),
        ("attention.q_proj", "attention.k_proj", "attention.v_proj"))
_OUT = ("attention.output.dense", "attention.o_proj")
_RENAMES = {"norm1": "norm1", "norm2": "norm2", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
_DROPPED = re.compile(r"^embeddings\.mask_token$")


def _fields(config: Mapping[str, Any], registers: bool) -> dict[str, Any]:
    """config.json of a Dinov2(WithRegisters)Config -> ViTConfig fields (HF defaults where absent)."""
    if config.get("use_swiglu_ffn", False):
        raise UnsupportedCheckpoint("config.json use_swiglu_ffn=true: the SwiGLU FFN of DINOv2-g is not supported "
                              "(vit-serve implements the GELU MLP only)")
    ph, pw = hf_pair(config.get("patch_size", 14), "patch_size")
    if ph != pw:
        raise CheckpointError(f"config.json patch_size={ph}x{pw}: only square patches are supported")
    d = hf_int(config, "hidden_size", 768)
    ratio = config.get("mlp_ratio", 4)
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or ratio <= 0:
        raise CheckpointError(f"config.json mlp_ratio={ratio!r} is not a positive number")
    reg = hf_int(config, "num_register_tokens", 4) if registers else 0
    return {
        "img_size": hf_pair(config.get("image_size", 224), "image_size"), "patch_size": ph,
        "in_chans": hf_int(config, "num_channels", 3), "num_classes": 0, "embed_dim": d,
        "depth": hf_int(config, "num_hidden_layers", 12), "num_heads": hf_int(config, "num_attention_heads", 12),
        "mlp_dim": int(d * ratio), "qkv_bias": bool(config.get("qkv_bias", True)),
        "layer_norm_eps": float(config.get("layer_norm_eps", 1e-6)),
        "gelu": hf_activation(config, "gelu"), "init_values": float(config.get("layerscale_value", 1.0)),
        "reg_tokens": reg, "no_embed_class": bool(reg), "resample_mode": "timm" if registers else "hf",
        "family": "dinov2",
    }


def _block(take: Taker, i: int, qkv_bias: bool) -> dict[str, torch.Tensor | None]:
    """Layer `i` under our names: renames, LayerScale gammas and the q, k, v fusion (either naming)."""
    pre = f"encoder.layer.{i}."
    style = 0 if f"{pre}{_QKV[0][0]}.weight" in take.sd else 1
    out: dict[str, torch.Tensor | None] = {}
    for ours, theirs in (*_RENAMES.items(), ("attn.proj", _OUT[style])):
        for leaf in ("weight", "bias"):
            out[f"blocks.{i}.{ours}.{leaf}"] = take(f"{pre}{theirs}.{leaf}")
    out[f"blocks.{i}.ls1.gamma"] = take(f"{pre}layer_scale1.lambda1")
    out[f"blocks.{i}.ls2.gamma"] = take(f"{pre}layer_scale2.lambda1")
    qkv = tuple(f"{pre}{n}" for n in _QKV[style])
    out.update(fused_qkv(take, qkv, f"blocks.{i}.attn.qkv", qkv_bias))  # type: ignore[arg-type]
    return out


def _embeddings(take: Taker, cfg: ViTConfig) -> dict[str, torch.Tensor | None]:
    """Patch projection, tokens and position embeddings; with registers the class row folded into [class]."""
    out = {"patch_embed.proj.weight": take("embeddings.patch_embeddings.projection.weight"),
           "patch_embed.proj.bias": take("embeddings.patch_embeddings.projection.bias"),
           "cls_token": take("embeddings.cls_token"), "pos_embed": take("embeddings.position_embeddings")}
    if cfg.reg_tokens:
        out["reg_token"] = take("embeddings.register_tokens")
        cls, pos = out["cls_token"], out["pos_embed"]
        if cls is not None and pos is not None:
            out["cls_token"], out["pos_embed"] = cls + pos[:, :1], pos[:, 1:].contiguous()
    return out


def convert_dinov2(config: Mapping[str, Any], weights: Mapping[str, torch.Tensor],
                   preprocessor: Mapping[str, Any] | None = None, *, source: str | None = None,
                   **overrides: Any) -> Converted:
    """Convert a transformers `Dinov2Model` / `Dinov2WithRegistersModel` (model_type dinov2 /
    dinov2_with_registers; also their Backbone classes, which hold the same weights) to our layout (pure).

    Args:
        config: config.json as a dict. weights: the state dict (legacy or 5.x names, optionally under the
            `dinov2.` / `dinov2_with_registers.` prefix). preprocessor: preprocessor_config.json, or None
            for BitImageProcessor's defaults at the model's size. overrides: ViTConfig fields (a different
            `img_size` resamples `pos_embed` with the source's mode).

    Returns:
        Converted with num_classes 0: `forward_head(tokens, pre_logits=True)` is HF's `pooler_output`.
    """
    registers = config.get("model_type") == "dinov2_with_registers"
    source = source or f"transformers {config.get('model_type', 'dinov2')} checkpoint"
    sd = strip_prefix(weights, "dinov2_with_registers." if registers else "dinov2.")
    if any(k.startswith("classifier.") for k in sd):
        raise UnsupportedCheckpoint(f"{source}: Dinov2ForImageClassification is not supported (its classifier reads "
                              "[class; mean of patch tokens]); convert the Dinov2Model backbone")
    native, cfg = make_config(_fields(config, registers), overrides, source)
    take = Taker(sd)
    state = _embeddings(take, native)
    for i in range(native.depth):
        state.update(_block(take, i, native.qkv_bias))
    state["norm.weight"], state["norm.bias"] = take("layernorm.weight"), take("layernorm.bias")
    check_consumed(take, source, f"a transformers DINOv2 with {native.depth} layers", _DROPPED)
    defaults = {**BIT_PROCESSOR_DEFAULTS, **sized_defaults(native.img_size)}
    return finish(native, cfg, state, source, family_preprocess(preprocessor, defaults, native.img_size, False))


def sized_defaults(img_size: tuple[int, int]) -> dict[str, Any]:
    """A shortest-edge resize and centre crop at the model's size (CLIP / Bit processors), squash if not square."""
    h, w = img_size
    if h != w:
        return {"size": {"height": h, "width": w}, "do_center_crop": False}
    return {"size": {"shortest_edge": h}, "crop_size": {"height": h, "width": w}}
