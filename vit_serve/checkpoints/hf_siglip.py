"""Hugging Face transformers SigLIP vision towers (`SiglipVisionModel`, the vision half of `SiglipModel`) ->
our layout.

Reference reproduced: `transformers.models.siglip.modeling_siglip` (read at 5.24): a pre-LN ViT without a
class token (position embeddings on the patches only), GELU-tanh, a final LayerNorm on every token, and the
multihead attention-pooling head whose output is `pooler_output`:

    transformers name (optionally under `vision_model.`)   ours                     shape
    embeddings.patch_embedding                             patch_embed.proj         [D, C, P, P], [D]
    embeddings.position_embedding.weight                   pos_embed                [N, D] -> [1, N, D]
    encoder.layers.{i}.*  (as CLIP's, hf_clip.encoder_layer)   blocks.{i}.*
    post_layernorm                                         norm                     [D]
    head.probe                                             attn_pool.latent         [1, 1, D]
    head.attention.in_proj_weight / _bias  (nn.MultiheadAttention: rows q, k, v)
                                                           attn_pool.q [:D], attn_pool.kv [D:]
    head.attention.out_proj                                attn_pool.proj           [D, D]
    head.layernorm                                         attn_pool.norm           [D]
    head.mlp.fc1 / head.mlp.fc2                            attn_pool.mlp.fc1 / fc2  [M, D], [D, M]

Our `forward_head(tokens, pre_logits=True)` is `pooler_output` (= SiglipModel.get_image_features'). The text
tower's keys (`text_model.*`, `logit_scale`, `logit_bias`) are set aside (hf_clip.split_towers).
Resampling: SiglipVisionEmbeddings.interpolate_pos_encoding is F.interpolate(size=..., bicubic,
align_corners=False) without antialias on the patch grid: mode "hf" with no prefix rows. Refused:
`vision_use_head=false` (no pooled embedding to reproduce).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from vit_serve.checkpoints.converted import Converted, make_config
from vit_serve.checkpoints.hf_clip import encoder_layer, split_towers, vision_config
from vit_serve.checkpoints.hf_transformers import (
    Taker,
    check_consumed,
    encoder_fields,
    family_preprocess,
    finish,
    hf_activation,
    strip_prefix,
)
from vit_serve.checkpoints.unsupported import UnsupportedCheckpoint

__all__ = ["SIGLIP_PROCESSOR_DEFAULTS", "convert_siglip", "head_state"]

# SiglipImageProcessor's class defaults (transformers 5.24): squash resize, mean = std = 0.5; size: the model's.
SIGLIP_PROCESSOR_DEFAULTS: dict[str, Any] = {"resample": 3, "image_mean": (0.5, 0.5, 0.5),
                                             "image_std": (0.5, 0.5, 0.5)}
_DROPPED = re.compile(r"^embeddings\.position_ids$")


def _fields(vcfg: Mapping[str, Any]) -> dict[str, Any]:
    """SiglipVisionConfig fields (HF defaults where absent) -> ViTConfig fields."""
    if not vcfg.get("vision_use_head", True):
        raise UnsupportedCheckpoint("config.json vision_use_head=false: this SigLIP tower has no attention-pool head, "
                              "so there is no pooled embedding to reproduce")
    return {
        **encoder_fields(vcfg, patch=16, eps=1e-6),
        "gelu": hf_activation(vcfg, "gelu_pytorch_tanh"), "class_token": False, "pool": "map",
        "no_embed_class": True, "resample_mode": "hf", "family": "siglip",
    }


def head_state(take: Taker, d: int) -> dict[str, torch.Tensor | None]:
    """SiglipMultiheadAttentionPoolingHead -> attn_pool.*: nn.MultiheadAttention's packed in-projection split
    into the probe's query rows [:D] and the tokens' key/value rows [D:]."""
    w, b = take("head.attention.in_proj_weight"), take("head.attention.in_proj_bias")
    out: dict[str, torch.Tensor | None] = {
        "attn_pool.latent": take("head.probe"),
        "attn_pool.q.weight": w[:d] if w is not None else None, "attn_pool.q.bias": b[:d] if b is not None else None,
        "attn_pool.kv.weight": w[d:] if w is not None else None,
        "attn_pool.kv.bias": b[d:] if b is not None else None,
    }
    for ours, theirs in (("proj", "attention.out_proj"), ("norm", "layernorm"), ("mlp.fc1", "mlp.fc1"),
                         ("mlp.fc2", "mlp.fc2")):
        for leaf in ("weight", "bias"):
            out[f"attn_pool.{ours}.{leaf}"] = take(f"head.{theirs}.{leaf}")
    return out


def convert_siglip(config: Mapping[str, Any], weights: Mapping[str, torch.Tensor],
                   preprocessor: Mapping[str, Any] | None = None, *, source: str | None = None,
                   **overrides: Any) -> Converted:
    """Convert a transformers SigLIP vision tower (model_type siglip_vision_model, or siglip: SiglipModel's
    vision half) to our layout (pure); the text tower's keys are left aside.

    Returns:
        Converted with num_classes 0, no class token, pool "map": `forward_head(tokens, pre_logits=True)` is
        HF's `pooler_output`. Preprocessing from preprocessor_config.json over SiglipImageProcessor's defaults.
    """
    source = source or f"transformers {config.get('model_type', 'siglip')} checkpoint"
    vcfg = vision_config(config, "siglip")
    vision, _text = split_towers(weights)
    if any(k.startswith("classifier.") for k in vision):
        raise UnsupportedCheckpoint(f"{source}: SiglipForImageClassification is not supported (its classifier reads "
                              "the mean of the tokens); convert SiglipVisionModel")
    native, cfg = make_config(_fields(vcfg), overrides, source)
    take = Taker(strip_prefix(vision, "vision_model."))
    pos = take("embeddings.position_embedding.weight")
    state: dict[str, torch.Tensor | None] = {
        "patch_embed.proj.weight": take("embeddings.patch_embedding.weight"),
        "patch_embed.proj.bias": take("embeddings.patch_embedding.bias"),
        "pos_embed": pos.unsqueeze(0) if pos is not None else None,
    }
    for i in range(native.depth):
        state.update(encoder_layer(take, i))
    state["norm.weight"], state["norm.bias"] = take("post_layernorm.weight"), take("post_layernorm.bias")
    state.update(head_state(take, native.embed_dim))
    check_consumed(take, source, f"a transformers SigLIP vision tower with {native.depth} layers", _DROPPED)
    h, w = native.img_size
    defaults = {**SIGLIP_PROCESSOR_DEFAULTS, "size": {"height": h, "width": w}}
    return finish(native, cfg, state, source, family_preprocess(preprocessor, defaults, native.img_size, True))
