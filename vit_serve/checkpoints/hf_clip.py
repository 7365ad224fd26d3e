"""Hugging Face transformers CLIP vision towers (`CLIPVisionModel`, `CLIPVisionModelWithProjection`, the vision
half of `CLIPModel`) -> our layout.

Reference reproduced: `transformers.models.clip.modeling_clip` (read at 5.24): a pre-LN ViT with a LayerNorm
before the encoder, a bias-free patch projection, QuickGELU (OpenAI's weights) and a bias-free projection:

    transformers name (under `vision_model.`)         ours                   shape
    embeddings.patch_embedding                        patch_embed.proj       [D, C, P, P] (no bias)
    embeddings.class_embedding                        cls_token              [D] -> [1, 1, D]
    embeddings.position_embedding.weight              pos_embed              [1 + N, D] -> [1, 1 + N, D]
    pre_layrnorm (sic)                                norm_pre               [D]
    L.layer_norm1 / L.layer_norm2                     blocks.{i}.norm1/norm2 [D]
    L.self_attn.{q,k,v}_proj                          blocks.{i}.attn.qkv    3 x [D, D] -> [3D, D]
    L.self_attn.out_proj                              blocks.{i}.attn.proj   [D, D]
    L.mlp.fc1 / L.mlp.fc2                             blocks.{i}.mlp.fc1/fc2
    post_layernorm                                    norm                   [D]
    visual_projection (top level; WithProjection, CLIPModel)   proj          [E, D] (no bias)

with L = `encoder.layers.{i}`. HF applies `post_layernorm` to the pooled [class] token only; ours normalises
every token and then pools: the same numbers for the embedding, `pooler_output` (CLIPVisionModel) or
`image_embeds` (WithProjection; = CLIPModel.get_image_features' pooler_output): our
`forward_head(tokens, pre_logits=True)`. The text tower's keys (`text_model.*`, `text_projection`,
`logit_scale`) are set aside, not converted: :func:`split_towers` hands them to whoever builds text towers.
Resampling: CLIPVisionEmbeddings.interpolate_pos_encoding is bicubic without antialias ("hf").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from vit_serve.checkpoints.converted import CheckpointError, Converted, make_config
from vit_serve.checkpoints.hf_dinov2 import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, sized_defaults
from vit_serve.checkpoints.hf_transformers import (
    Taker,
    check_consumed,
    encoder_fields,
    family_preprocess,
    finish,
    fused_qkv,
    hf_activation,
    strip_prefix,
)
from vit_serve.checkpoints.unsupported import UnsupportedCheckpoint

__all__ = ["CLIP_PROCESSOR_DEFAULTS", "convert_clip", "encoder_layer", "split_towers", "vision_config"]

# CLIPImageProcessor's class defaults (transformers 5.24); sizes follow the model.
CLIP_PROCESSOR_DEFAULTS: dict[str, Any] = {"resample": 3, "do_center_crop": True, "image_mean": OPENAI_CLIP_MEAN,
                                           "image_std": OPENAI_CLIP_STD}
_TEXT = re.compile(r"^(text_model\.|text_projection\.|logit_scale$|logit_bias$)")
_DROPPED = re.compile(r"^embeddings\.position_ids$")  # a buffer older transformers saved
_LAYER = {"norm1": "layer_norm1", "norm2": "layer_norm2", "attn.proj": "self_attn.out_proj",
          "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}


def split_towers(weights: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A CLIPModel / SiglipModel state dict -> (vision keys, text keys: `text_model.*`, `text_projection.*`,
    `logit_scale`, `logit_bias`), names unchanged."""
    vision = {k: v for k, v in weights.items() if not _TEXT.match(k)}
    return vision, {k: v for k, v in weights.items() if _TEXT.match(k)}


def vision_config(config: Mapping[str, Any], dual: str) -> dict[str, Any]:
    """The vision part of config.json: `vision_config` for the two-tower model_type `dual`, else itself."""
    if config.get("model_type") != dual:
        return dict(config)
    vcfg = config.get("vision_config")
    if not isinstance(vcfg, Mapping):
        raise CheckpointError(f"config.json of a {dual!r} model has no vision_config object")
    return dict(vcfg)


def encoder_layer(take: Taker, i: int) -> dict[str, torch.Tensor | None]:
    """CLIP / SigLIP encoder layer `i` (`encoder.layers.{i}`) under our names `blocks.{i}.*`."""
    pre = f"encoder.layers.{i}."
    out: dict[str, torch.Tensor | None] = {}
    for ours, theirs in _LAYER.items():
        for leaf in ("weight", "bias"):
            out[f"blocks.{i}.{ours}.{leaf}"] = take(f"{pre}{theirs}.{leaf}")
    qkv = tuple(f"{pre}self_attn.{n}_proj" for n in "qkv")
    out.update(fused_qkv(take, qkv, f"blocks.{i}.attn.qkv"))  # type: ignore[arg-type]
    return out


def _fields(vcfg: Mapping[str, Any], proj_dim: int | None) -> dict[str, Any]:
    """CLIPVisionConfig fields (HF defaults where absent) -> ViTConfig fields."""
    return {
        **encoder_fields(vcfg, patch=32, eps=1e-5), "gelu": hf_activation(vcfg, "quick_gelu"),
        "norm_pre": True, "patch_bias": False, "proj_dim": proj_dim, "resample_mode": "hf", "family": "clip",
    }


def _renamed(take: Taker, depth: int) -> dict[str, torch.Tensor | None]:
    """Every vision tensor of a transformers CLIP of `depth` layers under our names."""
    cls, pos = take("embeddings.class_embedding"), take("embeddings.position_embedding.weight")
    out: dict[str, torch.Tensor | None] = {
        "patch_embed.proj.weight": take("embeddings.patch_embedding.weight"),
        "cls_token": cls.reshape(1, 1, -1) if cls is not None else None,
        "pos_embed": pos.unsqueeze(0) if pos is not None else None,
        "norm_pre.weight": take("pre_layrnorm.weight"), "norm_pre.bias": take("pre_layrnorm.bias"),
    }
    for i in range(depth):
        out.update(encoder_layer(take, i))
    out["norm.weight"], out["norm.bias"] = take("post_layernorm.weight"), take("post_layernorm.bias")
    return out


def convert_clip(config: Mapping[str, Any], weights: Mapping[str, torch.Tensor],
                 preprocessor: Mapping[str, Any] | None = None, *, source: str | None = None,
                 **overrides: Any) -> Converted:
    """Convert a transformers CLIP vision tower (model_type clip_vision_model, or clip: CLIPModel's vision half
    and `visual_projection`) to our layout (pure); the text tower's keys are left aside.

    Returns:
        Converted with num_classes 0 and, when `visual_projection.weight` is present, proj_dim = its rows:
        `forward_head(tokens, pre_logits=True)` is `image_embeds` (else `pooler_output`). Preprocessing from
        preprocessor_config.json over CLIPImageProcessor's defaults at the model's size.
    """
    source = source or f"transformers {config.get('model_type', 'clip')} checkpoint"
    vcfg = vision_config(config, "clip")
    vision, _text = split_towers(weights)
    if any(k.startswith("classifier.") for k in vision):
        raise UnsupportedCheckpoint(f"{source}: CLIPForImageClassification is not supported (its classifier reads "
                              "the mean of the patch tokens); convert CLIPVisionModel(WithProjection)")
    sd = strip_prefix(vision, "vision_model.")
    take = Taker(sd)
    proj = take("visual_projection.weight", required=False)
    native, cfg = make_config(_fields(vcfg, int(proj.shape[0]) if proj is not None else None), overrides, source)
    state = _renamed(take, native.depth)
    if proj is not None:
        state["proj.weight"] = proj
    check_consumed(take, source, f"a transformers CLIP vision tower with {native.depth} layers", _DROPPED)
    defaults = {**CLIP_PROCESSOR_DEFAULTS, **sized_defaults(native.img_size)}
    return finish(native, cfg, state, source, family_preprocess(preprocessor, defaults, native.img_size, False))
