"""Hugging Face transformers ViT (`ViTForImageClassification`, `ViTModel`) -> our layout; the folder reader and
the model_type dispatch for every transformers family, and the steps their converters share.

Families (one module each, built from the steps below): hf_dinov2 (dinov2, dinov2_with_registers), hf_clip
(clip_vision_model, clip), hf_siglip (siglip_vision_model, siglip). Other model types are refused in one line
naming what they need (BEiT's relative position bias, DINOv3's RoPE, ...).

Reference reproduced: `transformers.models.vit.modeling_vit` (transformers 5.x, read at 5.24). Its forward is
the paper's pre-LN ViT, so the conversion is a renaming plus one fusion (separate q, k, v -> one qkv):

    transformers name (on disk | in memory since 5.0)        ours                  shape
    embeddings.patch_embeddings.projection                   patch_embed.proj      [D, C, P, P], [D]
    embeddings.cls_token                                     cls_token             [1, 1, D]
    embeddings.position_embeddings                           pos_embed             [1, 1 + N, D]
    L.layernorm_before                                       blocks.{i}.norm1      [D]
    L.attention.attention.{query,key,value} | L.attention.{q,k,v}_proj
                                                             blocks.{i}.attn.qkv   3 x [D, D] -> [3D, D]
    L.attention.output.dense | L.attention.o_proj            blocks.{i}.attn.proj  [D, D]
    L.layernorm_after                                        blocks.{i}.norm2      [D]
    L.intermediate.dense | L.mlp.fc1                         blocks.{i}.mlp.fc1    [M, D]
    L.output.dense | L.mlp.fc2                               blocks.{i}.mlp.fc2    [D, M]
    layernorm                                                norm                  [D]
    classifier (ViTForImageClassification only)              head                  [K, D]

with L = `encoder.layer.{i}` on disk, `layers.{i}` in memory; q, k, v rows (and biases) are concatenated
in that order, which is how our fused qkv is split into heads.

Keys may carry the `vit.` prefix (ViTForImageClassification) or not (ViTModel). Dropped on purpose:
`pooler.dense` (ViTModel's dense + tanh pooler; ViTForImageClassification does not use it, it classifies the
final-LayerNorm [class] token directly) and `embeddings.mask_token` (only used for masked image modelling).
Anything else that is not consumed is an error, as is anything missing.

Numerics carried over from config.json: `layer_norm_eps` (HF default 1e-12, not timm's 1e-6), `hidden_act`
("gelu"/"gelu_python" -> exact erf GELU, "gelu_pytorch_tanh"/"gelu_new" -> tanh approximation), `qkv_bias`.
Position embeddings are resampled for other resolutions the way `ViTEmbeddings.interpolate_pos_encoding`
does (bicubic, align_corners=False, no antialias: resample_mode "hf").
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from vit_serve.checkpoints.converted import (
    CheckpointError,
    Converted,
    check_against_model,
    describe_keys,
    make_config,
    one_line,
    resample_to,
)
from vit_serve.checkpoints.io import read_weights
from vit_serve.config import ViTConfig
from vit_serve.pos_embed import resample_pos_embed
from vit_serve.preprocess import PreprocessConfig

__all__ = ["FAMILY_ACTIVATIONS", "HF_ACTIVATIONS", "Taker", "check_consumed", "convert_hf_vit", "encoder_fields",
           "family_preprocess", "finish", "fused_qkv", "hf_activation", "hf_int", "hf_pair", "hf_preprocess",
           "is_hf_layout", "read_hf_weights", "read_json", "strip_prefix"]

# config.json `hidden_act` -> our ViTConfig.gelu
HF_ACTIVATIONS: dict[str, str] = {
    "gelu": "exact",
    "gelu_python": "exact",
    "gelu_pytorch_tanh": "tanh",
    "gelu_new": "tanh",
}
# The families' converters also read "quick_gelu" (x * sigmoid(1.702 x), OpenAI CLIP's weights).
FAMILY_ACTIVATIONS: dict[str, str] = {**HF_ACTIVATIONS, "quick_gelu": "quick"}

# PIL resample codes as stored in preprocessor_config.json -> PreprocessConfig.interpolation
_PIL_RESAMPLE: dict[int, str] = {
    0: "nearest",
    1: "lanczos",
    2: "bilinear",
    3: "bicubic",
    4: "box",
    5: "hamming",
}

# Our per-block names -> (legacy on-disk suffix, transformers >= 5 in-memory suffix) for plain renames.
_BLOCK_RENAMES: dict[str, tuple[str, str]] = {
    "norm1": ("layernorm_before", "layernorm_before"),
    "attn.proj": ("attention.output.dense", "attention.o_proj"),
    "norm2": ("layernorm_after", "layernorm_after"),
    "mlp.fc1": ("intermediate.dense", "mlp.fc1"),
    "mlp.fc2": ("output.dense", "mlp.fc2"),
}
_QKV: tuple[tuple[str, ...], tuple[str, ...]] = (
    ("attention.attention.query", "attention.attention.key", "attention.attention.value"),
    ("attention.q_proj", "attention.k_proj", "attention.v_proj"),
)
_LAYER_PREFIX = ("encoder.layer.", "layers.")
_DROPPED = re.compile(r"^(pooler\.dense\.(weight|bias)|embeddings\.mask_token)$")
_LAYER_NORM_KEY = re.compile(r"^(?:vit\.)?(?:encoder\.layer|layers)\.\d+\.layernorm_before\.weight$")


def is_hf_layout(keys: Iterable[str]) -> bool:
    """True for a transformers ViT state dict (with or without the `vit.` prefix, legacy or 5.x names)."""
    keys = set(keys)
    for prefix in ("", "vit."):
        if {
            f"{prefix}embeddings.patch_embeddings.projection.weight",
            f"{prefix}embeddings.position_embeddings",
        } <= keys:
            return any(_LAYER_NORM_KEY.match(k) for k in keys)
    return False


def hf_pair(value: Any, name: str) -> tuple[int, int]:
    if isinstance(value, bool):
        raise CheckpointError(f"config.json {name}={value!r} is not a size")
    if isinstance(value, int):
        return value, value
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return int(value[0]), int(value[1])
    raise CheckpointError(f"config.json {name}={value!r}: expected an integer or a pair of integers")


def _strip_vit_prefix(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in weights.items():
        name = k[len("vit.") :] if k.startswith("vit.") else k
        if name in out:
            raise CheckpointError(f"transformers checkpoint holds both {name!r} and 'vit.{name}'")
        out[name] = v
    return out


class Taker:
    """Pops tensors by name, remembering what was missing and converting to contiguous float32."""

    def __init__(self, sd: dict[str, torch.Tensor]) -> None:
        self.sd = sd
        self.used: set[str] = set()
        self.missing: list[str] = []

    def __call__(self, key: str, required: bool = True) -> torch.Tensor | None:
        if key not in self.sd:
            if required:
                self.missing.append(key)
            return None
        self.used.add(key)
        t = self.sd[key]
        if not isinstance(t, torch.Tensor):
            t = torch.as_tensor(t)
        return t.detach().to(torch.float32).contiguous()


def _labels(config: Mapping[str, Any], num_classes: int) -> list[str] | None:
    id2label = config.get("id2label")
    if not num_classes or not id2label:
        return None
    try:
        by_index = {int(k): str(v) for k, v in id2label.items()}
    except (AttributeError, TypeError, ValueError) as e:
        raise CheckpointError(f"config.json id2label is not a mapping of integer ids to names ({e})") from e
    labels = [by_index.get(i) for i in range(len(by_index))]
    if any(name is None for name in labels):
        raise CheckpointError("config.json id2label ids are not 0..N-1")
    if all(name == f"LABEL_{i}" for i, name in enumerate(labels)):
        return None  # transformers' placeholder names carry no information
    if len(labels) != num_classes:
        raise CheckpointError(
            f"config.json id2label names {len(labels)} classes but the classifier has {num_classes} outputs"
        )
    return labels  # type: ignore[return-value]


def _size_dict(value: Any, name: str) -> dict[str, int]:
    """transformers `get_size_dict` with default_to_square=True (ViTImageProcessor)."""
    if isinstance(value, Mapping):
        return {str(k): v for k, v in value.items() if v is not None}
    if isinstance(value, int) and not isinstance(value, bool):
        return {"height": value, "width": value}
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return {"height": int(value[0]), "width": int(value[1])}
    raise CheckpointError(f"preprocessor_config.json {name}={value!r} is not a size")


def _crop_pct(crop: int, resize: int) -> float:
    """crop / resize, nudged down an ulp if needed so that floor(crop / pct) == resize, as we resize."""
    pct = crop / resize
    if math.floor(crop / pct) != resize:
        pct = math.nextafter(pct, 0.0)
    return pct


def _triple(value: Any, name: str) -> tuple[float, float, float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (float(value),) * 3
    if isinstance(value, (list, tuple)) and len(value) == 3:
        return tuple(float(v) for v in value)  # type: ignore[return-value]
    raise CheckpointError(f"preprocessor_config.json {name}={value!r}: expected 3 numbers")


def _interpolation(resample: Any) -> str:
    """preprocessor_config.json `resample` (a PIL code or a filter name) -> PreprocessConfig.interpolation."""
    if isinstance(resample, str):
        return resample.lower()
    if isinstance(resample, int) and resample in _PIL_RESAMPLE:
        return _PIL_RESAMPLE[resample]
    raise CheckpointError(f"preprocessor_config.json resample={resample!r} is not a supported PIL filter")


def _geometry(p: Mapping[str, Any], image_size: tuple[int, int]) -> tuple[tuple[int, int], float, str]:
    """`size` and the centre crop of a processor -> (output (H, W), crop_pct, crop_mode)."""
    size = _size_dict(p.get("size", {"height": image_size[0], "width": image_size[1]}), "size")
    crop = _size_dict(p["crop_size"], "crop_size") if p.get("do_center_crop") and p.get("crop_size") else None
    if crop is not None and not {"height", "width"} <= set(crop):
        raise CheckpointError(
            f"preprocessor_config.json crop_size={p['crop_size']!r}: expected height and width"
        )
    if {"height", "width"} <= set(size):
        return _squash_geometry(int(size["height"]), int(size["width"]), crop)
    if "shortest_edge" in size and "longest_edge" not in size and crop is not None:
        s = int(size["shortest_edge"])
        out = (int(crop["height"]), int(crop["width"]))
        if out[0] != out[1] or out[0] > s:
            raise CheckpointError(
                f"preprocessor_config.json: shortest_edge {s} with crop {out[0]}x{out[1]} "
                "is not expressible (the crop must be square and no larger than the resize)"
            )
        return out, _crop_pct(out[0], s), "center"
    raise CheckpointError(
        f"preprocessor_config.json size={p.get('size')!r} (do_center_crop={p.get('do_center_crop')!r}) "
        "gives an image-dependent input size; expected height/width, or shortest_edge with a centre crop"
    )


def _squash_geometry(h: int, w: int, crop: Mapping[str, int] | None) -> tuple[tuple[int, int], float, str]:
    """A resize to h x w (aspect ratio not kept), then maybe a centre crop -> (output, crop_pct, "squash")."""
    if crop is None:
        return (h, w), 1.0, "squash"
    out = (int(crop["height"]), int(crop["width"]))
    pct = _crop_pct(out[0], h)
    if math.floor(out[1] / pct) != w:
        raise CheckpointError(
            f"preprocessor_config.json: resize {h}x{w} then crop {out[0]}x{out[1]} crops the two "
            "edges by different fractions, which our preprocessing contract cannot express"
        )
    return out, pct, "squash"


def _normalisation(p: Mapping[str, Any]) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """(mean, std) on values in [0, 1]: HF's (x * factor - mean) / std with any rescale factor folded in."""
    if p.get("do_normalize", True):
        mean = _triple(p.get("image_mean", 0.5), "image_mean")
        std = _triple(p.get("image_std", 0.5), "image_std")
    else:
        mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    factor = float(p.get("rescale_factor", 1 / 255)) if p.get("do_rescale", True) else 1.0
    scale = factor * 255.0  # HF: (x * factor - mean) / std; ours: (x / 255 - mean') / std'
    if scale <= 0:
        raise CheckpointError(f"preprocessor_config.json rescale_factor={factor!r} must be positive")
    if abs(scale - 1.0) > 1e-9:
        mean = tuple(m / scale for m in mean)  # type: ignore[assignment]
        std = tuple(s / scale for s in std)  # type: ignore[assignment]
    return mean, std


def hf_preprocess(
    preprocessor: Mapping[str, Any] | None, image_size: tuple[int, int] = (224, 224)
) -> PreprocessConfig:
    """The preprocessing contract of a transformers image processor, as our PreprocessConfig.

    Without a preprocessor_config.json: `ViTImageProcessor` defaults (transformers 5.24): resize (squash,
    aspect ratio not kept) to image_size with bilinear filtering, no crop, rescale 1/255, mean = std = 0.5.

    With one: `size` {height, width} (or an int / [h, w]) -> squash resize, optionally followed by a centre
    crop of `crop_size` (DeiT style); `size` {shortest_edge} + centre crop -> our "center" crop mode;
    `resample` PIL code -> filter; `image_mean` / `image_std` (`do_normalize`), `rescale_factor`
    (`do_rescale`; a factor other than 1/255 is folded into mean and std). Processors that output a size
    that depends on the image (shortest_edge without a crop, no resize) raise CheckpointError.

    Our resize goes through PIL, like transformers' `ViTImageProcessorPil`; the default torchvision-backend
    `ViTImageProcessor` resizes tensors with antialiasing and can differ from PIL by a grey level.
    """
    p = dict(preprocessor or {})
    if not p.get("do_resize", True):
        raise CheckpointError(
            "preprocessor_config.json has do_resize=false: the input size would depend on the image, "
            "which a fixed preprocessing contract cannot express"
        )
    interpolation = _interpolation(p.get("resample", 2))
    out, pct, mode = _geometry(p, image_size)
    mean, std = _normalisation(p)
    if out != tuple(image_size):
        warnings.warn(
            f"preprocessor_config.json produces {out[0]}x{out[1]} images for a model configured at "
            f"{image_size[0]}x{image_size[1]}; the contract uses the model's size",
            stacklevel=3,
        )
    try:
        return PreprocessConfig(
            input_size=tuple(image_size),
            mean=mean,
            std=std,
            interpolation=interpolation,
            crop_pct=pct,
            crop_mode=mode,
        )
    except ValueError as e:
        raise CheckpointError(f"preprocessor_config.json: {one_line(e)}") from e


def _config_fields(config: Mapping[str, Any], num_classes: int) -> dict[str, Any]:
    model_type = config.get("model_type", "vit")
    if model_type != "vit":
        raise CheckpointError(
            f"config.json model_type={model_type!r}: only transformers 'vit' models are supported"
        )
    act = config.get("hidden_act", "gelu")
    if act not in HF_ACTIVATIONS:
        raise CheckpointError(
            f"config.json hidden_act={act!r} is not supported; expected one of {', '.join(HF_ACTIVATIONS)}"
        )
    if not isinstance(config.get("qkv_bias", True), bool):
        raise CheckpointError(f"config.json qkv_bias={config.get('qkv_bias')!r} is not a boolean")
    ph, pw = hf_pair(config.get("patch_size", 16), "patch_size")
    if ph != pw:
        raise CheckpointError(f"config.json patch_size={ph}x{pw}: only square patches are supported")
    fields: dict[str, Any] = {
        "img_size": hf_pair(config.get("image_size", 224), "image_size"),
        "patch_size": ph,
        "in_chans": config.get("num_channels", 3),
        "num_classes": num_classes,
        "embed_dim": config.get("hidden_size", 768),
        "depth": config.get("num_hidden_layers", 12),
        "num_heads": config.get("num_attention_heads", 12),
        "mlp_dim": config.get("intermediate_size", 3072),
        "qkv_bias": config.get("qkv_bias", True),
        "class_token": True,
        "pool": "token",
        "representation_size": None,
        "layer_norm_eps": float(config.get("layer_norm_eps", 1e-12)),
        "gelu": HF_ACTIVATIONS[act],
        "resample_mode": "hf",
    }
    for name in ("in_chans", "embed_dim", "depth", "num_heads", "mlp_dim"):
        if not isinstance(fields[name], int) or isinstance(fields[name], bool) or fields[name] <= 0:
            raise CheckpointError(f"config.json gives {name}={fields[name]!r}; expected a positive integer")
    return fields


def _style(sd: Mapping[str, torch.Tensor], source: str) -> int:
    """0 for legacy on-disk names (`encoder.layer.{i}`), 1 for transformers 5 in-memory ones (`layers.{i}`)."""
    legacy = any(k.startswith(_LAYER_PREFIX[0]) for k in sd)
    modern = any(k.startswith(_LAYER_PREFIX[1]) for k in sd)
    if legacy and modern:
        raise CheckpointError(f"{source}: mixes legacy 'encoder.layer.' and transformers 5 'layers.' names")
    return 1 if modern else 0


def _fused(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    """q, k, v ([D, D] weights or [D] biases) stacked into one qkv ([3D, D] or [3D]); None if one is missing."""
    return torch.cat(parts, dim=0) if all(t is not None for t in parts) else None  # type: ignore[arg-type]


def _block(take: Taker, i: int, style: int, qkv_bias: bool, source: str) -> dict[str, torch.Tensor | None]:
    """Layer `i` under our names `blocks.{i}.*`: plain renames plus the q, k, v fusion."""
    pre = f"{_LAYER_PREFIX[style]}{i}."
    out: dict[str, torch.Tensor | None] = {}
    for ours, theirs in _BLOCK_RENAMES.items():
        for leaf in ("weight", "bias"):
            out[f"blocks.{i}.{ours}.{leaf}"] = take(f"{pre}{theirs[style]}.{leaf}")
    qkv_w = [take(f"{pre}{n}.weight") for n in _QKV[style]]
    if all(t is not None for t in qkv_w) and len({tuple(t.shape) for t in qkv_w}) != 1:
        raise CheckpointError(
            f"{source}: layer {i} query/key/value weights differ in shape {[tuple(t.shape) for t in qkv_w]}"
        )
    if (w := _fused(qkv_w)) is not None:
        out[f"blocks.{i}.attn.qkv.weight"] = w
    if qkv_bias and (b := _fused([take(f"{pre}{n}.bias") for n in _QKV[style]])) is not None:
        out[f"blocks.{i}.attn.qkv.bias"] = b
    return out


def _renamed(take: Taker, cfg: ViTConfig, style: int, classifier_w: torch.Tensor | None, source: str
             ) -> dict[str, torch.Tensor | None]:
    """Every tensor of a transformers ViT of `cfg` under our names (None where the checkpoint lacks it)."""
    out: dict[str, torch.Tensor | None] = {
        "patch_embed.proj.weight": take("embeddings.patch_embeddings.projection.weight"),
        "patch_embed.proj.bias": take("embeddings.patch_embeddings.projection.bias"),
        "cls_token": take("embeddings.cls_token"),
        "pos_embed": take("embeddings.position_embeddings"),
    }
    for i in range(cfg.depth):
        out.update(_block(take, i, style, cfg.qkv_bias, source))
    out["norm.weight"] = take("layernorm.weight")
    out["norm.bias"] = take("layernorm.bias")
    if classifier_w is not None:
        out["head.weight"] = classifier_w
        out["head.bias"] = take("classifier.bias")
    return out


def _check_consumed(take: Taker, weights: Mapping[str, torch.Tensor], depth: int, source: str) -> None:
    """CheckpointError listing what was missing or left over, named as the checkpoint spells them."""
    prefixed = any(k.startswith("vit.") for k in weights)  # then name keys with the `vit.` prefix

    def spelled(key: str) -> str:
        return f"vit.{key}" if prefixed and not key.startswith("classifier.") else key

    if take.missing:
        raise CheckpointError(f"{source}: missing keys: {describe_keys([spelled(k) for k in take.missing])}")
    unexpected = sorted(
        k if k in weights else spelled(k) for k in take.sd if k not in take.used and not _DROPPED.match(k)
    )
    if unexpected:
        raise CheckpointError(
            f"{source}: unexpected keys (not part of a transformers ViT with "
            f"{depth} layers): {describe_keys(unexpected)}"
        )

# -- steps shared with the families' converters (hf_dinov2, hf_clip, hf_siglip) ------------------------------
def hf_int(config: Mapping[str, Any], name: str, default: int) -> int:
    """A positive integer field of config.json (`default` when absent); CheckpointError otherwise."""
    value = config.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(f"config.json gives {name}={value!r}; expected a positive integer")
    return value


def encoder_fields(vcfg: Mapping[str, Any], patch: int, eps: float) -> dict[str, Any]:
    """The encoder's shape from a transformers vision config (HF defaults where absent; `patch` and `eps` are the
    family's defaults) -> ViTConfig fields, no head."""
    return {
        "img_size": hf_pair(vcfg.get("image_size", 224), "image_size"),
        "patch_size": hf_int(vcfg, "patch_size", patch), "in_chans": hf_int(vcfg, "num_channels", 3),
        "num_classes": 0, "embed_dim": hf_int(vcfg, "hidden_size", 768),
        "depth": hf_int(vcfg, "num_hidden_layers", 12), "num_heads": hf_int(vcfg, "num_attention_heads", 12),
        "mlp_dim": hf_int(vcfg, "intermediate_size", 3072), "qkv_bias": True,
        "layer_norm_eps": float(vcfg.get("layer_norm_eps", eps)),
    }


def hf_activation(config: Mapping[str, Any], default: str) -> str:
    """config.json `hidden_act` -> ViTConfig.gelu (FAMILY_ACTIVATIONS), refusing activations we do not have."""
    act = config.get("hidden_act", default)
    if act not in FAMILY_ACTIVATIONS:
        raise CheckpointError(
            f"config.json hidden_act={act!r} is not supported; expected one of {', '.join(FAMILY_ACTIVATIONS)}"
        )
    return FAMILY_ACTIVATIONS[act]


def strip_prefix(weights: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """`weights` with `prefix` removed from the keys that carry it (a wrapper's attribute name)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in weights.items():
        name = k[len(prefix) :] if k.startswith(prefix) else k
        if name in out:
            raise CheckpointError(f"transformers checkpoint holds both {name!r} and {prefix + name!r}")
        out[name] = v
    return out


def fused_qkv(take: Taker, names: tuple[str, str, str], out: str, bias: bool = True) -> dict[str, torch.Tensor | None]:
    """Separate q, k, v Linears (`names`, prefixes without .weight) -> `{out}.weight` [3D, D] (and `.bias`
    [3D]), rows concatenated in q, k, v order: how our fused qkv is split. None where a part is missing."""
    res = {f"{out}.weight": _fused([take(f"{n}.weight") for n in names])}
    if bias:
        res[f"{out}.bias"] = _fused([take(f"{n}.bias") for n in names])
    return res


def check_consumed(take: Taker, source: str, what: str, dropped: re.Pattern[str] | None = None) -> None:
    """CheckpointError listing missing keys, then keys neither used nor matched by `dropped` (on purpose)."""
    if take.missing:
        raise CheckpointError(f"{source}: missing keys: {describe_keys(take.missing)}")
    unexpected = sorted(k for k in take.sd if k not in take.used and not (dropped and dropped.match(k)))
    if unexpected:
        raise CheckpointError(f"{source}: unexpected keys (not part of {what}): {describe_keys(unexpected)}")


def family_preprocess(preprocessor: Mapping[str, Any] | None, defaults: Mapping[str, Any],
                      image_size: tuple[int, int], default_to_square: bool) -> PreprocessConfig:
    """`hf_preprocess` for a family's image processor: its class defaults (`defaults`) under the file's keys.

    With `default_to_square=False` (CLIPImageProcessor, BitImageProcessor) an integer `size` means the
    shortest edge, as transformers' `get_size_dict` reads it; `crop_size` integers are square.
    """
    p = {**defaults, **(preprocessor or {})}
    if not default_to_square and isinstance(p.get("size"), int) and not isinstance(p.get("size"), bool):
        p["size"] = {"shortest_edge": p["size"]}
    return hf_preprocess(p, image_size)


def finish(native: ViTConfig, cfg: ViTConfig, state: dict[str, torch.Tensor | None], source: str,
           preprocess: PreprocessConfig) -> Converted:
    """Check names and shapes against our model of `native`, resample `pos_embed` to `cfg`'s grid (patch
    rows only when `no_embed_class`) with `cfg.resample_mode`, and wrap it up (no labels: base models)."""
    sd = {k: v for k, v in state.items() if v is not None}
    check_against_model(native, sd, f"{source} (as described by its config.json)")
    if cfg.img_size != native.img_size and "pos_embed" in sd:  # RoPE-only models have none to resample
        pos = resample_pos_embed(sd["pos_embed"], native.grid_size, cfg.grid_size, native.num_pos_prefix_tokens,
                                 cfg.resample_mode)
        sd["pos_embed"] = pos.contiguous()
    return Converted(cfg, sd, source=source, labels=None, preprocess=preprocess.with_size(*cfg.img_size))


# model_type -> what our model lacks for it (refused in one line).
UNSUPPORTED: dict[str, str] = {
    "beit": "relative position bias (BEiT)",
    "data2vec-vision": "relative position bias (data2vec-vision is BEiT's architecture)",
    "dinov3_convnext": "a ConvNeXt (DINOv3's ConvNeXt distillations are not ViTs)",
    "radio": "RADIO's multi-teacher adaptor heads and its own position embeddings (CPE)",
    "clip_text_model": "a vision tower (this folder is a CLIP text tower alone)",
    "siglip_text_model": "a vision tower (this folder is a SigLIP text tower alone)",
    "siglip2_text_model": "a vision tower (this folder is a SigLIP 2 text tower alone)",
    "deit": "the transformers DeiT layout (convert timm's deit_* weights instead)",
    "swin": "shifted-window attention (Swin)",
}


def convert_hf_vit(
    config: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor],
    preprocessor: Mapping[str, Any] | None = None,
    *,
    source: str | None = None,
    **overrides: Any,
) -> Converted:
    """Convert a transformers `ViTForImageClassification` / `ViTModel` checkpoint to our layout (pure).

    `vit_serve.checkpoints.hf_models.convert_hf` sends every model_type to its converter; this is "vit"'s.

    Args:
        config: the checkpoint's config.json as a dict (hidden_size, num_hidden_layers, num_attention_heads,
            intermediate_size, layer_norm_eps, hidden_act, image_size, patch_size, num_channels, qkv_bias,
            id2label).
        weights: its state dict, legacy on-disk names (`encoder.layer.{i}.attention.attention.query`, what
            `save_pretrained` writes and the hub holds) or transformers 5 in-memory names
            (`layers.{i}.attention.q_proj`), with or without the `vit.` prefix; any float dtype.
        preprocessor: preprocessor_config.json as a dict; None -> ViTImageProcessor defaults
            (see :func:`hf_preprocess`).
        source: where the checkpoint came from, for messages.
        overrides: ViTConfig fields to replace. A different `img_size` resamples `pos_embed` with the
            (possibly overridden) `resample_mode`.

    Returns:
        Converted with float32 tensors in our (timm) names. num_classes = classifier rows (0 for ViTModel:
        our head is then the identity and `forward` returns the final-LayerNorm [class] token, i.e. HF's
        `last_hidden_state[:, 0]`, not the pooler output). Labels come from id2label unless they are the
        `LABEL_<i>` placeholders.

    Raises:
        CheckpointError: unsupported hidden_act / model_type, missing or unexpected keys (all listed),
            shapes that disagree with config.json.
    """
    source = source or "transformers ViT checkpoint"
    sd = _strip_vit_prefix(weights)
    style = _style(sd, source)
    take = Taker(sd)
    classifier_w = take("classifier.weight", required=False)
    num_classes = int(classifier_w.shape[0]) if classifier_w is not None else 0
    native, cfg = make_config(_config_fields(config, num_classes), overrides, source)
    out = _renamed(take, native, style, classifier_w, source)
    _check_consumed(take, weights, native.depth, source)
    state: dict[str, torch.Tensor] = {k: v for k, v in out.items() if v is not None}
    check_against_model(native, state, f"{source} (as described by its config.json)")
    state = resample_to(state, native, cfg)
    labels = _labels(config, num_classes)
    pre_cfg = hf_preprocess(preprocessor, native.img_size).with_size(*cfg.img_size)
    return Converted(cfg, state, source=source, labels=labels, preprocess=pre_cfg)


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {one_line(e)}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"cannot read {path}: expected a JSON object")
    return data


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (folder / single).is_file():
            weights, _ = read_weights(folder / single)
            return weights
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (folder / index).is_file():
            weight_map = read_json(folder / index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{folder / index} has no weight_map")
            merged: dict[str, torch.Tensor] = {}
            for shard in sorted(set(weight_map.values())):
                part, _ = read_weights(folder / shard)
                merged.update(part)
            return merged
    raise CheckpointError(
        f"{folder} has no model.safetensors, pytorch_model.bin or sharded index next to its config.json"
    )
