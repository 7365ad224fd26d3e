"""ViTConfig and the preset table.

Presets follow Table 1 of the ViT paper (Ti and S from DeiT / "How to train your ViT"). Names resolve in
both spellings: the paper's ("B/16", "ViT-B/16", "R50+ViT-B/16") and timm's ("vit_base_patch16_224",
"vit_base_r50_s16_224").
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any

POOLS = ("token", "gap", "map")
# "quick": x * sigmoid(1.702 x), the activation OpenAI's CLIP weights were trained with.
GELUS = ("exact", "tanh", "quick")
RESAMPLE_MODES = ("jax", "timm", "hf", "torchvision", "dinov2", "open_clip")
SCORES = ("softmax", "sigmoid")
# Which image embedding a family's users mean (manifest `embedding.kind`), and whether it is compared by cosine.
FAMILIES = ("vit", "deit", "dinov2", "clip", "siglip")
STD_CONV_STYLES = ("var", "std")


@dataclass(frozen=True)
class ViTConfig:
    """Everything that defines a ViT's architecture and numerics.

    `img_size` is (H, W). `patch_size` is the effective stride in pixels: for hybrids the ResNet stem's
    stride times the size of the patches cut from its feature map.
    """

    img_size: tuple[int, int] = (224, 224)
    patch_size: int = 16
    in_chans: int = 3
    num_classes: int = 1000
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_dim: int = 3072
    qkv_bias: bool = True
    class_token: bool = True
    pool: str = "token"
    representation_size: int | None = None
    drop_rate: float = 0.0
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.0
    layer_norm_eps: float = 1e-6
    gelu: str = "exact"
    resample_mode: str = "timm"
    # Hybrid (paper §3.1): None means a plain ViT; () means the ResNet root block only.
    resnet_layers: tuple[int, ...] | None = None
    resnet_width: int = 64
    # vit_jax standardises with w / (std + 1e-5) and GroupNorm eps 1e-6; timm with w / sqrt(var + 1e-8), 1e-5.
    std_conv_style: str = "var"
    std_conv_eps: float = 1e-8
    group_norm_eps: float = 1e-5
    # The families' pieces (DeiT, DINOv2, CLIP, SigLIP), each off by default; parameter names are timm's.
    dist_token: bool = False  # DeiT: a distillation token after [class], read by `head_dist`; heads averaged
    reg_tokens: int = 0  # DINOv2-reg (Darcet et al. 2024): register tokens after [class] / [dist]
    no_embed_class: bool = False  # the prefix tokens get no position embedding (pos_embed covers patches only)
    init_values: float | None = None  # LayerScale: per-channel gammas on both residual branches (DINOv2)
    norm_pre: bool = False  # a LayerNorm on the tokens before the encoder (CLIP's ln_pre)
    patch_bias: bool = True  # CLIP's patch projection has no bias
    proj_dim: int | None = None  # CLIP: a bias-free projection of the pooled token (the image embedding)
    embed_norm: bool = False  # L2-normalise the embedding before the head (zero-shot heads)
    scores: str = "softmax"  # how logits become scores: softmax (one label) or sigmoid (SigLIP, multi-label)
    family: str = "vit"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "img_size", _pair(self.img_size))
        if self.resnet_layers is not None:
            object.__setattr__(self, "resnet_layers", tuple(self.resnet_layers))
        _check_choice("pool", self.pool, POOLS)
        _check_choice("gelu", self.gelu, GELUS)
        _check_choice("resample_mode", self.resample_mode, RESAMPLE_MODES)
        _check_choice("std_conv_style", self.std_conv_style, STD_CONV_STYLES)
        _check_choice("scores", self.scores, SCORES)
        _check_choice("family", self.family, FAMILIES)
        if self.reg_tokens < 0:
            raise ValueError(f"reg_tokens must be >= 0, got {self.reg_tokens}")
        if self.dist_token and (not self.class_token or self.pool != "token"):
            raise ValueError("dist_token needs class_token=True and pool='token'")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}")
        if self.pool == "token" and not self.class_token:
            raise ValueError("pool='token' needs class_token=True")
        if self.patch_size % self.backbone_stride:
            raise ValueError(f"patch_size {self.patch_size} is not a multiple of the ResNet stride "
                             f"{self.backbone_stride}")
        for n, s in zip(("height", "width"), self.img_size, strict=True):
            if s <= 0 or s % self.patch_size:
                raise ValueError(f"img_size {n} {s} is not a positive multiple of patch_size {self.patch_size}")

    @property
    def grid_size(self) -> tuple[int, int]:
        return self.img_size[0] // self.patch_size, self.img_size[1] // self.patch_size

    @property
    def num_prefix_tokens(self) -> int:
        """Tokens before the patches: [class], [dist], registers (timm's order)."""
        return int(self.class_token) + int(self.dist_token) + self.reg_tokens

    @property
    def num_pos_prefix_tokens(self) -> int:
        """Prefix tokens that carry a position embedding (the leading rows of `pos_embed`)."""
        return 0 if self.no_embed_class else self.num_prefix_tokens

    @property
    def embed_dim_out(self) -> int:
        """Width of the image embedding: the projection's, the pre-logits layer's, or the encoder's."""
        return self.proj_dim or self.representation_size or self.embed_dim

    @property
    def backbone_stride(self) -> int:
        return backbone_stride(self.resnet_layers)

    def replace(self, **changes: Any) -> ViTConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["img_size"] = list(self.img_size)
        if self.resnet_layers is not None:
            d["resnet_layers"] = list(self.resnet_layers)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ViTConfig:
        check_fields(cls, d, "ViTConfig fields")
        return cls(**d)


def check_fields(cls: type, d: dict[str, Any], what: str) -> None:
    """ValueError naming every key of `d` that is not a field of the dataclass `cls`."""
    unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ValueError(f"unknown {what}: {', '.join(unknown)}")


def backbone_stride(resnet_layers: tuple[int, ...] | None) -> int:
    """Pixel stride of the hybrid's ResNet (1 for a plain ViT): root 4, then 2 per stage after the first."""
    if resnet_layers is None:
        return 1
    return 4 * 2 ** max(len(resnet_layers) - 1, 0)


def _pair(x: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    if isinstance(x, int):
        return (x, x)
    h, w = x
    return (int(h), int(w))


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}; expected one of {', '.join(choices)}")


# Model sizes: (embed_dim, depth, num_heads, mlp_dim). Paper Table 1, plus Ti and S.
SIZES: dict[str, tuple[int, int, int, int]] = {
    "Ti": (192, 12, 3, 768),
    "S": (384, 12, 6, 1536),
    "B": (768, 12, 12, 3072),
    "L": (1024, 24, 16, 4096),
    "H": (1280, 32, 16, 5120),
}
PATCHES = (8, 14, 16, 32)
_TIMM_SIZE = {"tiny": "Ti", "small": "S", "base": "B", "large": "L", "huge": "H"}
_SIZE_TIMM = {v: k for k, v in _TIMM_SIZE.items()}
# Heads by width, for checkpoints that do not record them (timm and torchvision state dicts).
HEADS_BY_WIDTH = {d: h for d, _, h, _ in SIZES.values()}


def _preset(size: str, patch: int, img: int = 224, hybrid: bool = False, **kw: Any) -> ViTConfig:
    d, depth, heads, mlp = SIZES[size]
    cfg: dict[str, Any] = dict(embed_dim=d, depth=depth, num_heads=heads, mlp_dim=mlp, patch_size=patch,
                               img_size=(img, img))
    if hybrid:
        cfg["resnet_layers"] = (3, 4, 9)
    cfg.update(kw)
    return ViTConfig(**cfg)


def preset_names() -> list[str]:
    """Every canonical preset name, paper style ("B/16") and timm style ("vit_base_patch16_224")."""
    names = [f"{s}/{p}" for s in SIZES for p in PATCHES] + ["R50+B/16"]
    names += [f"vit_{_SIZE_TIMM[s]}_patch{p}_224" for s in SIZES for p in PATCHES] + ["vit_base_r50_s16_224"]
    return names


_PAPER = re.compile(r"^(?:(?P<r50>R50\+))?(?:ViT-)?(?P<size>Ti|S|B|L|H)/(?P<patch>\d+)$")
_TIMM = re.compile(r"^vit_(?P<size>tiny|small|base|large|huge)_patch(?P<patch>\d+)(?P<gap>_gap)?_(?P<img>\d+)$")
_TIMM_R50 = re.compile(r"^vit_(?P<size>base|large)_r50_s16_(?P<img>\d+)$")


def get_config(name: str, **overrides: Any) -> ViTConfig:
    """Resolve a preset name to a ViTConfig; keyword overrides replace fields (e.g. num_classes=10)."""
    key = name.split(".")[0]  # timm's "arch.pretrained_tag"
    if m := _PAPER.match(key):
        cfg = _preset(m["size"], int(m["patch"]), hybrid=bool(m["r50"]))
    elif m := _TIMM.match(key):
        gap = dict(class_token=False, pool="gap") if m["gap"] else {}
        cfg = _preset(_TIMM_SIZE[m["size"]], int(m["patch"]), int(m["img"]), **gap)
    elif m := _TIMM_R50.match(key):
        cfg = _preset(_TIMM_SIZE[m["size"]], 16, int(m["img"]), hybrid=True)
    else:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(preset_names())} "
                         "(timm names may end in any image size or '_gap_<size>')")
    if cfg.patch_size not in PATCHES:
        raise ValueError(f"unknown patch size {cfg.patch_size} in {name!r}; presets have {PATCHES}")
    return cfg.replace(**overrides) if overrides else cfg
