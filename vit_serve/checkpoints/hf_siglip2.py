"""Hugging Face transformers SigLIP 2 vision towers (`Siglip2VisionModel`, the vision half of `Siglip2Model`;
config.json model_type siglip2 / siglip2_vision_model, no `architectures`) -> our layout.

Reference reproduced: `transformers.models.siglip2.modeling_siglip2` (read at 5.25): SigLIP's tower (hf_siglip's
names and MAP head) with NaFlex inputs. What differs from SigLIP:

    transformers name (optionally under `vision_model.`)   ours                     shape
    embeddings.patch_embedding (nn.Linear on flattened     patch_embed.proj         [D, P*P*C] -> [D, C, P, P]
      (p, q, c) patches)                                   (naflex.linear_to_conv)
    embeddings.position_embedding.weight  ([g*g, D],       pos_embed                [1, g*g, D]
      g = sqrt(num_patches))

`VisionTransformer.forward_patches(patches, spatial_shapes, mask)` is the model's forward on the processor's
outputs (pixel_values, spatial_shapes, pixel_attention_mask); its embedding is `pooler_output`. The plain image
path resamples the grid the NaFlex way too (resample_mode "naflex"), so `forward` on an H x W image equals
`forward_patches` on its patches. The patch budget of the processor (`max_num_patches`, 256 by default) is kept
in `cfg.extra["max_patches"]`: the default and the bound of a request's `max_patches`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from vit_serve.checkpoints.converted import CheckpointError, Converted, make_config
from vit_serve.checkpoints.hf_clip import encoder_layer, split_towers, vision_config
from vit_serve.checkpoints.hf_siglip import head_state
from vit_serve.checkpoints.hf_transformers import (
    Taker,
    check_consumed,
    encoder_fields,
    family_preprocess,
    finish,
    hf_activation,
    hf_int,
    strip_prefix,
)
from vit_serve.checkpoints.unsupported import UnsupportedCheckpoint
from vit_serve.naflex import DEFAULT_MAX_PATCHES, linear_to_conv

__all__ = ["SIGLIP2_PROCESSOR_DEFAULTS", "convert_siglip2", "max_patches_of"]

# Siglip2ImageProcessor's class defaults (transformers 5.25): bilinear (PIL code 2), mean = std = 0.5.
SIGLIP2_PROCESSOR_DEFAULTS: dict[str, Any] = {"resample": 2, "image_mean": (0.5, 0.5, 0.5),
                                              "image_std": (0.5, 0.5, 0.5)}
_NAFLEX_KEYS = ("max_num_patches", "patch_size")


def _grid(vcfg: Mapping[str, Any]) -> int:
    """The stored position-embedding grid side, sqrt(num_patches) (the reference's, square)."""
    n = hf_int(vcfg, "num_patches", DEFAULT_MAX_PATCHES)
    g = math.isqrt(n)
    if g * g != n:
        raise CheckpointError(f"config.json num_patches={n} is not a square grid (transformers reads it as one)")
    return g


def max_patches_of(preprocessor: Mapping[str, Any] | None) -> int:
    """The processor's patch budget: preprocessor_config.json `max_num_patches`, else the class default 256."""
    n = (preprocessor or {}).get("max_num_patches", DEFAULT_MAX_PATCHES)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise CheckpointError(f"preprocessor_config.json max_num_patches={n!r}: expected a positive integer")
    return n


def _fields(vcfg: Mapping[str, Any], max_patches: int) -> dict[str, Any]:
    """Siglip2VisionConfig fields (HF defaults where absent) -> ViTConfig fields."""
    if not vcfg.get("vision_use_head", True):
        raise UnsupportedCheckpoint("config.json vision_use_head=false: this SigLIP 2 tower has no attention-pool "
                                    "head, so there is no pooled embedding to reproduce")
    patch = hf_int(vcfg, "patch_size", 16)
    side = _grid(vcfg) * patch
    return {
        **encoder_fields({**vcfg, "image_size": side}, patch=16, eps=1e-6),
        "gelu": hf_activation(vcfg, "gelu_pytorch_tanh"), "class_token": False, "pool": "map",
        "no_embed_class": True, "resample_mode": "naflex", "family": "siglip",
        "extra": {"max_patches": max_patches},
    }


def convert_siglip2(config: Mapping[str, Any], weights: Mapping[str, torch.Tensor],
                    preprocessor: Mapping[str, Any] | None = None, *, source: str | None = None,
                    **overrides: Any) -> Converted:
    """Convert a transformers SigLIP 2 vision tower (model_type siglip2_vision_model, or siglip2: Siglip2Model's
    vision half) to our layout (pure); the text tower's keys are left aside.

    Returns:
        Converted with num_classes 0, no class token, pool "map", `cfg.extra["max_patches"]` the processor's
        budget; the fixed-size contract (for the plain image path) a squash resize to the stored grid's size.
    """
    source = source or f"transformers {config.get('model_type', 'siglip2')} checkpoint"
    vcfg = vision_config(config, "siglip2")
    vision, _text = split_towers(weights)
    if any(k.startswith("classifier.") for k in vision):
        raise UnsupportedCheckpoint(f"{source}: Siglip2ForImageClassification is not supported (its classifier "
                                    "reads the mean of the tokens); convert Siglip2VisionModel")
    native, cfg = make_config(_fields(vcfg, max_patches_of(preprocessor)), overrides, source)
    take = Taker(strip_prefix(vision, "vision_model."))
    w, pos = take("embeddings.patch_embedding.weight"), take("embeddings.position_embedding.weight")
    state: dict[str, torch.Tensor | None] = {
        "patch_embed.proj.weight": None if w is None else linear_to_conv(w, native.in_chans, native.patch_size),
        "patch_embed.proj.bias": take("embeddings.patch_embedding.bias"),
        "pos_embed": pos.unsqueeze(0) if pos is not None else None,
    }
    for i in range(native.depth):
        state.update(encoder_layer(take, i))
    state["norm.weight"], state["norm.bias"] = take("post_layernorm.weight"), take("post_layernorm.bias")
    state.update(head_state(take, native.embed_dim))
    check_consumed(take, source, f"a transformers SigLIP 2 vision tower with {native.depth} layers")
    h, w_ = native.img_size
    pre = {k: v for k, v in (preprocessor or {}).items() if k not in _NAFLEX_KEYS}
    defaults = {**SIGLIP2_PROCESSOR_DEFAULTS, "size": {"height": h, "width": w_}}
    return finish(native, cfg, state, source, family_preprocess(pre, defaults, native.img_size, True))
