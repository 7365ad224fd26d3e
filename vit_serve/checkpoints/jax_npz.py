"""vit_jax / AugReg / big_vision `.npz` checkpoints -> our layout (timm parameter names).

The mapping is the one of timm's `_load_weights` (timm/models/vision_transformer.py); every ViTConfig field
is read off the arrays, and the numerics are those of the flax source: tanh-GELU, LayerNorm eps 1e-6,
bilinear (scipy `zoom`) position-embedding resampling and, for hybrids, vit_jax's weight standardisation
w / (std + 1e-5) with GroupNorm eps 1e-6.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vit_serve.checkpoints.converted import CheckpointError, Converted, describe_keys
from vit_serve.config import ViTConfig, backbone_stride
from vit_serve.preprocess import PreprocessConfig

__all__ = ["convert_npz", "is_npz_layout", "npz_prefix"]

# Longest first: "params/img/" (big_vision two-tower towers) before "params/".
PREFIXES = ("params/img/", "opt/target/", "params/", "")
_ANCHOR = "embedding/kernel"
_ENCODER_BLOCK = re.compile(r"^Transformer/encoderblock_(\d+)/")
_RESNET_UNIT = re.compile(r"^block(\d+)/unit(\d+)/")


def npz_prefix(keys: Iterable[str]) -> str | None:
    """The parameter-tree prefix of a vit_jax / big_vision checkpoint ('', 'opt/target/', 'params/', ...).

    None when the keys do not look like one: neither `<prefix>embedding/kernel` nor `<prefix>Transformer/...`.
    """
    keys = set(keys)
    for p in PREFIXES:
        if p + _ANCHOR in keys:
            return p
    for p in PREFIXES:
        if any(k.startswith(p + "Transformer/") for k in keys):
            return p
    return None


def is_npz_layout(keys: Iterable[str]) -> bool:
    """True for vit_jax / AugReg / big_vision parameter names (`embedding/kernel`, `Transformer/...`)."""
    return npz_prefix(keys) is not None


def _as_float32(name: str, a: Any) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype.kind == "V" and a.dtype.itemsize == 2:  # bfloat16 saved without ml_dtypes: raw 16-bit words
        a = (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif a.dtype.name == "bfloat16" or a.dtype.kind == "f":
        a = a.astype(np.float32, copy=False)
    else:
        raise CheckpointError(f"npz array {name!r} has dtype {a.dtype}, expected a floating-point array")
    return a


class _Arrays:
    """Keys relative to the prefix; records what was read and what was missing."""

    def __init__(self, weights: Mapping[str, Any], prefix: str) -> None:
        self.prefix = prefix
        self.w = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
        self.used: set[str] = set()
        self.missing: list[str] = []
        self._f32: dict[str, np.ndarray] = {}  # cast once (stacked layouts are read once per layer)

    def __contains__(self, key: str) -> bool:
        return key in self.w

    def shape(self, key: str) -> tuple[int, ...] | None:
        return tuple(np.shape(self.w[key])) if key in self.w else None

    def get(self, key: str, idx: int | None = None) -> np.ndarray | None:
        if key not in self.w:
            self.missing.append(self.prefix + key)
            return None
        self.used.add(key)
        if key not in self._f32:
            self._f32[key] = _as_float32(self.prefix + key, self.w[key])
        a = self._f32[key]
        if idx is not None:
            if a.ndim == 0 or a.shape[0] <= idx:
                raise CheckpointError(
                    f"npz array {self.prefix + key!r} of shape {a.shape} has no layer {idx} "
                    "on its leading (scan) axis"
                )
            a = a[idx]
        return a


def _hybrid_layers(arr: _Arrays) -> tuple[int, ...]:
    units: dict[int, int] = {}
    for k in arr.w:
        if m := _RESNET_UNIT.match(k):
            units[int(m[1])] = max(units.get(int(m[1]), 0), int(m[2]))
    stages = max(units, default=0)
    absent = [f"{arr.prefix}block{i}/" for i in range(1, stages + 1) if i not in units]
    if absent:
        raise CheckpointError(f"npz hybrid checkpoint is missing ResNet stage(s) {', '.join(absent)}")
    return tuple(units[i] for i in range(1, stages + 1))


def _infer_config(arr: _Arrays, stacked: bool, big_vision: bool, mha: str, mlp: str) -> ViTConfig:
    p = arr.prefix
    kernel = arr.shape(_ANCHOR)
    if kernel is None:
        raise CheckpointError(f"npz checkpoint is missing {p + _ANCHOR!r} (the patch embedding)")
    if len(kernel) != 4 or kernel[0] != kernel[1]:
        raise CheckpointError(
            f"{p + _ANCHOR!r} has shape {kernel}; expected a square conv kernel [P, P, C, D] "
            "(flattened / non-square patch embeddings are not supported)"
        )
    k, _, c_in, d = kernel
    fields: dict[str, Any] = dict(embed_dim=d, in_chans=c_in, patch_size=k)
    root = arr.shape("conv_root/kernel")
    if root is not None:  # R50+ViT hybrid (paper §3.1): BiT ResNet, then k x k (usually 1x1) patches
        if len(root) != 4:
            raise CheckpointError(f"{p}conv_root/kernel has shape {root}; expected [7, 7, C, width]")
        layers = _hybrid_layers(arr)
        stride = backbone_stride(layers)
        fields.update(
            resnet_layers=layers,
            resnet_width=root[3],
            in_chans=root[2],
            patch_size=stride * k,
            std_conv_style="std",
            std_conv_eps=1e-5,
            group_norm_eps=1e-6,
        )

    if stacked:
        ln = arr.shape("Transformer/encoderblock/LayerNorm_0/scale")
        depth = ln[0] if ln else 0
        block, lead = "Transformer/encoderblock/", 1
    else:
        idx = [int(m[1]) for key in arr.w if (m := _ENCODER_BLOCK.match(key))]
        depth = max(idx) + 1 if idx else 0
        block, lead = "Transformer/encoderblock_0/", 0
    if depth < 1:
        raise CheckpointError(f"npz checkpoint has no encoder blocks ({p}Transformer/encoderblock_0/...)")
    query = arr.shape(f"{block}{mha}/query/kernel")
    if query is None or len(query) != 3 + lead or query[lead] != d:
        raise CheckpointError(
            f"cannot infer the number of heads: {p}{block}{mha}/query/kernel has shape "
            f"{query}; expected [{'depth, ' * lead}{d}, heads, head_dim]"
        )
    fc1 = arr.shape(f"{block}{mlp}/Dense_0/kernel")
    if fc1 is None:
        raise CheckpointError(f"npz checkpoint is missing {p}{block}{mlp}/Dense_0/kernel")
    fields.update(
        depth=depth, num_heads=query[lead + 1], mlp_dim=fc1[-1], qkv_bias=f"{block}{mha}/query/bias" in arr
    )

    class_token = "cls" in arr
    fields.update(class_token=class_token, pool="token" if class_token else "gap")
    if (pre := arr.shape("pre_logits/kernel")) is not None:
        fields["representation_size"] = pre[-1]
    head = arr.shape("head/kernel")
    fields["num_classes"] = head[-1] if head is not None else 0

    pos_key = _pos_key(arr, big_vision)
    pos = arr.shape(pos_key)
    if pos is None:
        raise CheckpointError(f"npz checkpoint is missing {p + pos_key!r} (learned position embeddings)")
    n_patch = _patch_tokens(pos, class_token, big_vision, p + pos_key)
    side = math.isqrt(n_patch)
    fields["img_size"] = (side * fields["patch_size"],) * 2
    return ViTConfig(gelu="tanh", layer_norm_eps=1e-6, resample_mode="jax", **fields)


def _pos_key(arr: _Arrays, big_vision: bool) -> str:
    keys = ("pos_embedding", "Transformer/posembed_input/pos_embedding")
    first, second = keys if big_vision else keys[::-1]
    return second if first not in arr and second in arr else first


def _patch_tokens(shape: tuple[int, ...], class_token: bool, big_vision: bool, name: str) -> int:
    """Patch tokens in a position table: vit_jax's has a [class] slot, big_vision's may not."""
    if len(shape) not in (2, 3) or (len(shape) == 3 and shape[0] != 1):
        raise CheckpointError(f"{name!r} has shape {shape}; expected [1, tokens, D]")
    n = shape[-2]
    candidates = [n] if not class_token else [n - 1, n] if big_vision else [n - 1]
    for m in candidates:
        if m >= 1 and math.isqrt(m) ** 2 == m:
            return m
    raise CheckpointError(
        f"cannot infer the image size from {name!r}: {n} position tokens"
        f"{' (incl. [class])' if class_token else ''} do not form a square patch grid; "
        "non-square grids cannot be inferred from an .npz checkpoint"
    )


def _t(a: np.ndarray) -> np.ndarray:
    """flax -> torch layout (timm's `_n2p`): conv HWIO -> OIHW, dense [in, out] -> [out, in]."""
    if a.ndim == 4:
        return a.transpose(3, 2, 0, 1)
    if a.ndim == 2:
        return a.T
    return a


@dataclass(frozen=True)
class _Naming:
    """Where a checkpoint keeps its blocks and what it calls their sub-modules."""

    stacked: bool  # one Transformer/encoderblock/ whose arrays have a leading depth axis (nn.scan)
    big_vision: bool  # big_vision rather than vit_jax (position table, sub-module numbering)
    mha: str  # the attention sub-module
    mlp: str  # the MLP sub-module
    ln2: str  # the second LayerNorm


def _naming(arr: _Arrays) -> _Naming:
    """Sub-module numbering: vit_jax counts every submodule of the block, big_vision each kind separately."""
    stacked = "Transformer/encoderblock/LayerNorm_0/scale" in arr
    big_vision = arr.prefix.startswith("params/") or "pos_embedding" in arr or stacked
    block = "Transformer/encoderblock/" if stacked else "Transformer/encoderblock_0/"
    has_1 = f"{block}MultiHeadDotProductAttention_1/query/kernel" in arr
    has_0 = f"{block}MultiHeadDotProductAttention_0/query/kernel" in arr
    if has_0 or (big_vision and not has_1):
        return _Naming(stacked, big_vision, "MultiHeadDotProductAttention_0", "MlpBlock_0", "LayerNorm_1")
    return _Naming(stacked, big_vision, "MultiHeadDotProductAttention_1", "MlpBlock_3", "LayerNorm_2")


class _Reader:
    """Arrays in torch layout: `vec` flattens (scales, biases), `mat` transposes (kernels); None if missing."""

    def __init__(self, arr: _Arrays) -> None:
        self.arr = arr

    def vec(self, key: str, idx: int | None = None) -> np.ndarray | None:
        a = self.arr.get(key, idx)
        return None if a is None else a.reshape(-1)

    def mat(self, key: str, idx: int | None = None) -> np.ndarray | None:
        a = self.arr.get(key, idx)
        return None if a is None else _t(a)


def _resnet_arrays(r: _Reader, layers: tuple[int, ...]) -> dict[str, np.ndarray | None]:
    """The BiT ResNet stem and stages of a hybrid, under `patch_embed.backbone.*`."""
    pe = "patch_embed.backbone."
    sd: dict[str, np.ndarray | None] = {
        pe + "stem.conv.weight": r.mat("conv_root/kernel"),
        pe + "stem.norm.weight": r.vec("gn_root/scale"),
        pe + "stem.norm.bias": r.vec("gn_root/bias"),
    }
    for i, n_units in enumerate(layers):
        for j in range(n_units):
            src, dst = f"block{i + 1}/unit{j + 1}/", f"{pe}stages.{i}.blocks.{j}."
            for k in (1, 2, 3):
                sd[f"{dst}conv{k}.weight"] = r.mat(f"{src}conv{k}/kernel")
                sd[f"{dst}norm{k}.weight"] = r.vec(f"{src}gn{k}/scale")
                sd[f"{dst}norm{k}.bias"] = r.vec(f"{src}gn{k}/bias")
            if j == 0:  # the first unit of every stage changes width (and stride): projection shortcut
                sd[f"{dst}downsample.conv.weight"] = r.mat(f"{src}conv_proj/kernel")
                sd[f"{dst}downsample.norm.weight"] = r.vec(f"{src}gn_proj/scale")
                sd[f"{dst}downsample.norm.bias"] = r.vec(f"{src}gn_proj/bias")
    return sd


def _embedding_arrays(r: _Reader, cfg: ViTConfig, big_vision: bool) -> dict[str, np.ndarray | None]:
    """Patch embedding [D, C, P, P], [class] token [1, 1, D] and position table [1, prefix + N, D]."""
    d = cfg.embed_dim
    sd: dict[str, np.ndarray | None] = {
        "patch_embed.proj.weight": r.mat(_ANCHOR),
        "patch_embed.proj.bias": r.vec("embedding/bias"),
    }
    if cfg.class_token:
        cls = r.arr.get("cls")
        sd["cls_token"] = None if cls is None else cls.reshape(1, 1, d)
    pos = r.arr.get(_pos_key(r.arr, big_vision))
    if pos is not None:
        pos = pos.reshape(1, -1, d)
        if cfg.class_token and pos.shape[1] == cfg.grid_size[0] * cfg.grid_size[1]:
            # big_vision adds the table to the patch tokens before prepending [class], which gets none:
            # the same as a zero [class] slot in timm's layout.
            pos = np.concatenate([np.zeros((1, 1, d), np.float32), pos], axis=1)
        sd["pos_embed"] = pos
    return sd


def _block_arrays(r: _Reader, cfg: ViTConfig, names: _Naming, i: int) -> dict[str, np.ndarray | None]:
    """Encoder block `i` under `blocks.{i}.*` (from layer `i` of the stacked arrays when `names.stacked`)."""
    d, mha = cfg.embed_dim, names.mha
    idx = i if names.stacked else None
    src = "Transformer/encoderblock/" if names.stacked else f"Transformer/encoderblock_{i}/"
    dst = f"blocks.{i}."
    sd: dict[str, np.ndarray | None] = {
        dst + "norm1.weight": r.vec(src + "LayerNorm_0/scale", idx),
        dst + "norm1.bias": r.vec(src + "LayerNorm_0/bias", idx),
    }
    # query/key/value kernels [D, heads, head_dim] -> rows of one [3D, D] matrix; biases [heads, head_dim] -> [3D].
    qkv = [r.arr.get(f"{src}{mha}/{n}/kernel", idx) for n in ("query", "key", "value")]
    sd[dst + "attn.qkv.weight"] = (
        None if any(a is None for a in qkv) else np.concatenate([a.reshape(d, -1).T for a in qkv], axis=0)
    )
    if cfg.qkv_bias:
        qkv_b = [r.vec(f"{src}{mha}/{n}/bias", idx) for n in ("query", "key", "value")]
        sd[dst + "attn.qkv.bias"] = None if any(b is None for b in qkv_b) else np.concatenate(qkv_b)
    out = r.arr.get(f"{src}{mha}/out/kernel", idx)  # [heads, head_dim, D]
    sd[dst + "attn.proj.weight"] = None if out is None else out.reshape(-1, d).T
    sd[dst + "attn.proj.bias"] = r.vec(f"{src}{mha}/out/bias", idx)
    sd[dst + "norm2.weight"] = r.vec(f"{src}{names.ln2}/scale", idx)
    sd[dst + "norm2.bias"] = r.vec(f"{src}{names.ln2}/bias", idx)
    for k in (0, 1):
        sd[f"{dst}mlp.fc{k + 1}.weight"] = r.mat(f"{src}{names.mlp}/Dense_{k}/kernel", idx)
        sd[f"{dst}mlp.fc{k + 1}.bias"] = r.vec(f"{src}{names.mlp}/Dense_{k}/bias", idx)
    return sd


def _head_arrays(r: _Reader, cfg: ViTConfig) -> dict[str, np.ndarray | None]:
    """Final LayerNorm [D], pre-logits [R, D] and head [K, R or D], as far as `cfg` has them."""
    sd: dict[str, np.ndarray | None] = {
        "norm.weight": r.vec("Transformer/encoder_norm/scale"),
        "norm.bias": r.vec("Transformer/encoder_norm/bias"),
    }
    if cfg.representation_size:
        sd["pre_logits.0.weight"] = r.mat("pre_logits/kernel")
        sd["pre_logits.0.bias"] = r.vec("pre_logits/bias")
    if cfg.num_classes:
        sd["head.weight"] = r.mat("head/kernel")
        sd["head.bias"] = r.vec("head/bias")
    return sd


def _convert(arr: _Arrays, cfg: ViTConfig, names: _Naming) -> dict[str, np.ndarray]:
    """Every array of a ViT of `cfg`, in timm names and torch layout; every array of `arr` consumed."""
    r = _Reader(arr)
    sd = _resnet_arrays(r, cfg.resnet_layers) if cfg.resnet_layers is not None else {}
    sd.update(_embedding_arrays(r, cfg, names.big_vision))
    for i in range(cfg.depth):
        sd.update(_block_arrays(r, cfg, names, i))
    sd.update(_head_arrays(r, cfg))
    if arr.missing:
        raise CheckpointError(
            f"npz checkpoint is missing {len(arr.missing)} array(s): {describe_keys(arr.missing)}"
        )
    unused = sorted(arr.prefix + k for k in set(arr.w) - arr.used)
    if unused:
        raise CheckpointError(
            f"npz checkpoint has arrays that are not part of a ViT of the inferred "
            f"architecture: {describe_keys(unused)}"
        )
    return {k: v for k, v in sd.items() if v is not None}


@contextmanager
def _npz_errors(what: str) -> Iterator[None]:
    """ValueErrors (other than ours) raised as CheckpointError("npz checkpoint: <what> (<error>)")."""
    try:
        yield
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(f"npz checkpoint: {what} ({e})") from e


def _with_overrides(cfg: ViTConfig, overrides: Mapping[str, Any]) -> ViTConfig:
    """`cfg` with `overrides` (ViTConfig fields) replaced; TypeError for unknown names."""
    if not overrides:
        return cfg
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(ViTConfig)})
    if unknown:
        raise TypeError(f"unknown ViTConfig field(s) in overrides: {', '.join(unknown)}")
    try:
        return cfg.replace(**overrides)
    except ValueError as e:
        raise CheckpointError(f"npz checkpoint: overrides do not fit the model ({e})") from e


def convert_npz(
    weights: Mapping[str, np.ndarray], *, source: str | None = None, **overrides: Any
) -> Converted:
    """Convert a vit_jax / AugReg / big_vision `.npz` ViT (or R50 hybrid); reproduces timm's `_load_weights`
    / vit_jax's checkpoint layout.

    Layouts (flax parameter paths, optionally under `opt/target/`, `params/` or `params/img/`):
        embedding/kernel [P, P, C, D], embedding/bias [D]   (hybrids: [k, k, C_resnet, D], usually k = 1)
        cls [1, 1, D]                                       (absent for GAP models)
        Transformer/posembed_input/pos_embedding [1, 1 + N, D]   (big_vision: pos_embedding [1, N, D])
        Transformer/encoderblock_{i}/LayerNorm_0, MultiHeadDotProductAttention_1/{query,key,value}/kernel
            [D, heads, head_dim] (+ bias [heads, head_dim]), .../out/kernel [heads, head_dim, D], LayerNorm_2,
            MlpBlock_3/Dense_{0,1}/kernel [D, mlp] / [mlp, D]
            (big_vision: MultiHeadDotProductAttention_0, LayerNorm_1, MlpBlock_0; or a single stacked
            Transformer/encoderblock/... whose arrays have a leading depth axis, from nn.scan)
        Transformer/encoder_norm/{scale,bias} [D], pre_logits/{kernel [D, R], bias},
        head/{kernel [D or R, K], bias}
        hybrids: conv_root/kernel [7, 7, C, W], gn_root/{scale,bias},
            block{i}/unit{j}/{conv1,conv2,conv3,conv_proj}/kernel, {gn1,gn2,gn3,gn_proj}/{scale,bias}

    Every ViTConfig field is inferred from the shapes (heads from the query kernel, image size from the
    number of position tokens, assuming a square grid); `overrides` then replace any field. The numerics
    are the flax source's: gelu="tanh", layer_norm_eps=1e-6, resample_mode="jax" and, for hybrids,
    std_conv_style="std", std_conv_eps=1e-5, group_norm_eps=1e-6. Arrays are cast to float32.
    Preprocessing: mean = std = 0.5, bicubic, crop_pct 1.0 at >= 384 px else 0.9 (timm's pretrained cfgs).

    Raises:
        CheckpointError: not an npz ViT layout, missing or unexpected arrays, MAP-head models, shapes that
            do not fit together.
    """
    keys = list(weights)
    prefix = npz_prefix(keys)
    if prefix is None:
        expected = ", ".join(p + _ANCHOR for p in PREFIXES)
        raise CheckpointError(
            f"not a vit_jax / big_vision ViT checkpoint: expected one of {expected} "
            f"(or Transformer/... arrays); got {describe_keys(sorted(keys))}"
        )
    arr = _Arrays(weights, prefix)
    if any(k.startswith("MAPHead_0/") for k in arr.w):
        raise CheckpointError(
            f"{prefix}MAPHead_0: map pooling is not supported (multihead attention-pooling "
            "head of big_vision / SigLIP models); only [class] token and GAP models are"
        )
    names = _naming(arr)
    with _npz_errors("inconsistent shapes"):
        cfg = _infer_config(arr, names.stacked, names.big_vision, names.mha, names.mlp)
    cfg = _with_overrides(cfg, overrides)
    with _npz_errors("arrays do not fit together"):
        arrays = _convert(arr, cfg, names)
    state = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in arrays.items()}

    crop_pct = 1.0 if min(cfg.img_size) >= 384 else 0.9
    pre = PreprocessConfig(
        input_size=cfg.img_size,
        mean=(0.5, 0.5, 0.5),
        std=(0.5, 0.5, 0.5),
        interpolation="bicubic",
        crop_pct=crop_pct,
    )
    kind = "big_vision" if names.big_vision else "vit_jax"
    return Converted(cfg, state, source=source or f"{kind} .npz checkpoint", preprocess=pre)
