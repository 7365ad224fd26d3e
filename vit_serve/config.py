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
RESAMPLE_MODES = ("jax", "timm", "hf", "torchvision", "dinov2", "open_clip", "naflex")
SCORES = ("softmax", "sigmoid")
# Which image embedding a family's users mean (manifest `embedding.kind`), and whether it is compared by cosine.
FAMILIES = ("vit", "deit", "dinov2", "clip", "siglip", "dinov3", "pe", "eva", "ropevit")
MLPS = ("gelu", "swiglu")
STD_CONV_STYLES = ("var", "std")
ROPE_KINDS = ("axial", "dinov3", "mixed")
GRID_INDEXING = ("ij", "xy")


@dataclass(frozen=True)
class RopeConfig:
    """Which rotary embedding a model uses (see vit_serve.rope); part of ViTConfig (`cfg.rope`).

    kind: "axial", "dinov3" or "mixed". temperature: the frequency base. grid_offset: added to the patch
    coordinates (PE: 1). grid_indexing: "ij" (coordinate channels y, x) or "xy" (x, y). ref_grid: the
    reference grid (H, W) coordinates are rescaled to (EVA-02's `ref_feat_shape`), or None. rotate_half: the
    "half" layout (x * cos + [-x2, x1] * sin) instead of interleaved pairs (DINOv3).
    """

    kind: str = "axial"
    temperature: float = 10000.0
    grid_offset: float = 0.0
    grid_indexing: str = "ij"
    ref_grid: tuple[int, int] | None = None
    rotate_half: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"rope kind {self.kind!r}; expected one of {', '.join(ROPE_KINDS)}")
        if self.grid_indexing not in GRID_INDEXING:
            raise ValueError(f"rope grid_indexing {self.grid_indexing!r}; expected 'ij' or 'xy'")
        if self.ref_grid is not None:
            h, w = self.ref_grid
            object.__setattr__(self, "ref_grid", (int(h), int(w)))
        if self.kind == "mixed" and self.rotate_half:
            raise ValueError("mixed RoPE uses interleaved pairs (rotate_half=False), as timm requires")
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "grid_offset", float(self.grid_offset))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ref_grid"] = list(self.ref_grid) if self.ref_grid is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RopeConfig:
        check_fields(cls, d, "RopeConfig fields")
        return cls(**d)


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
    proj_bias: bool = False  # the projection with a bias (open_clip's timm towers whose classifier is the projection)
    embed_norm: bool = False  # L2-normalise the embedding before the head (zero-shot heads)
    scores: str = "softmax"  # how logits become scores: softmax (one label) or sigmoid (SigLIP, multi-label)
    family: str = "vit"
    # The pieces of timm's `Eva` class (EVA-02, PE, DINOv3, RoPE-ViT), each off by default.
    rope: RopeConfig | None = None  # 2-D rotary position embeddings on the patch tokens' q and k (vit_serve.rope)
    pos_embed: bool = True  # absolute position embeddings; False: RoPE only (with rope set and True: both)
    mlp: str = "gelu"  # "swiglu": fc2(silu(fc1_g x) * fc1_x x), mlp_dim wide per branch (EVA-02, DINOv3+)
    mlp_norm: bool = False  # EVA-02's sub-LayerNorm in the MLP, before fc2 (timm scale_mlp)
    k_bias: bool = True  # False: the key projection has no bias (EVA's q_bias / v_bias); needs qkv_bias
    attn_norm: bool = False  # a LayerNorm on the attention output before its projection (EVA-CLIP, scale_attn_inner)
    fc_norm: bool = False  # a LayerNorm on the pooled token (timm Eva with global_pool='avg')
    final_norm: bool = True  # the encoder's last LayerNorm (absent with fc_norm, and in PE-spatial / PE-lang)
    pool_heads: int | None = None  # MAP pool heads (PE: 8); None: num_heads
    pool_mlp_dim: int | None = None  # MAP pool MLP width; None: mlp_dim
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "img_size", _pair(self.img_size))
        if self.resnet_layers is not None:
            object.__setattr__(self, "resnet_layers", tuple(self.resnet_layers))
        if isinstance(self.rope, dict):
            object.__setattr__(self, "rope", RopeConfig.from_dict(self.rope))
        _check_choice("mlp", self.mlp, MLPS)
        self._check_eva_pieces()
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

    def _check_eva_pieces(self) -> None:
        if self.rope is not None and (self.embed_dim // self.num_heads) % 4:
            raise ValueError(f"2-D RoPE needs a head dimension divisible by 4, got {self.embed_dim // self.num_heads}")
        if not self.k_bias and not self.qkv_bias:
            raise ValueError("k_bias=False (q and v biases only) needs qkv_bias=True")
        if self.pool_heads is not None and self.embed_dim % self.pool_heads:
            raise ValueError(f"embed_dim {self.embed_dim} is not divisible by pool_heads {self.pool_heads}")

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
    def max_patches(self) -> int | None:
        """SigLIP 2 NaFlex's patch budget (the default and the bound of a request's; None: a fixed-size model)."""
        n = self.extra.get("max_patches")
        return None if n is None else int(n)

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
        if self.rope is not None:
            d["rope"] = self.rope.to_dict()
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
# Sizes only timm's family models use (timm/models/vision_transformer.py, deit.py): DeiT-III / CLIP "medium",
# TinyCLIP's "xsmall" and "betwixt", CLIP's "giant" (1408 wide; not DINOv2's) and "gigantic", SigLIP's
# shape-optimised So400m (Alabdulmohsin et al. 2023; mlp 4304 = int(1152 * 3.7362)) and "giantopt".
TIMM_SIZES: dict[str, tuple[int, int, int, int]] = {
    "xsmall": (256, 10, 4, 1024),
    "medium": (512, 12, 8, 2048),
    "betwixt": (640, 12, 10, 2560),
    "giant": (1408, 40, 16, 6144),
    "gigantic": (1664, 48, 16, 8192),
    "so400m": (1152, 27, 16, 4304),
    "giantopt": (1536, 40, 16, 6144),
}
PATCHES = (8, 14, 16, 32)
_TIMM_SIZE = {"tiny": "Ti", "small": "S", "base": "B", "large": "L", "huge": "H"}
_SIZE_TIMM = {v: k for k, v in _TIMM_SIZE.items()}
# Heads by width, for checkpoints that do not record them (timm and torchvision state dicts). Width 1536 is
# left out: timm's SigLIP giantopt has 16 heads there, DINOv2's giant 24.
HEADS_BY_WIDTH = {d: h for d, _, h, _ in [*SIZES.values(), *(TIMM_SIZES[k] for k in TIMM_SIZES if k != "giantopt")]}
# timm builds these SigLIP architectures (the SigLIP 2 shapes) with GELU-tanh, every other SigLIP one with exact
# GELU (`act_layer` in timm/models/vision_transformer.py); `_gap_` variants follow their MAP twin.
_SIGLIP_TANH = frozenset({
    "vit_base_patch32_siglip_256", "vit_large_patch16_siglip_512", "vit_so400m_patch16_siglip_256",
    "vit_so400m_patch16_siglip_384", "vit_so400m_patch16_siglip_512", "vit_giantopt_patch16_siglip_256",
    "vit_giantopt_patch16_siglip_384",
})
# Architectures whose pieces this model does not implement, and what is missing (one line each). Decided by the
# architecture's name, never by the keys a state dict happens to have.
_UNSUPPORTED: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^eva02_enormous"), "EVA-02-E has post-norm blocks (timm EvaBlockPostNorm)"),
    (re.compile(r"^beit"), "BEiT needs relative position bias (relative_position_bias_table)"),
    (re.compile(r"^vit_7b_patch16_dinov3"), "the 7B DINOv3 (6.7B parameters) is beyond what vit-serve exports and "
                                            "serves"),
    (re.compile(r"radio"), "RADIO needs its CPE position embedding and summary / adaptor heads"),
    (re.compile(r"_sapiens2$"), "Sapiens2 needs grouped-query attention, q/k norms and RMSNorm"),
    (re.compile(r"^naflexvit"), "NaFlex (variable resolution at native aspect ratio) needs the naflex path "
                                "(vit_serve.naflex, not in this build)"),
    (re.compile(r"^aimv2_"), "AIMv2 needs RMSNorm"),
    (re.compile(r"_18x2_|_xp_|_pwee_|_dpwee_"), "parallel blocks (timm ParallelThingsBlock / ParallelScalingBlock)"),
    (re.compile(r"_dlittle_|_dwee_"), "differential attention"),
    (re.compile(r"_rpn_"), "res-post-norm blocks (timm ResPostBlock)"),
    (re.compile(r"_tipsv2$"), "TIPSv2's preset (LayerScale 1.0, a register, SwiGLU for the giant) is not mapped yet"),
    (re.compile(r"^test_vit"), "timm's unit-test models"),
)
# Names of timm's ViT modules we have no preset for: refused as such rather than read from a state dict's keys.
_TIMM_STYLE = re.compile(r"^(?:vit_|deit|eva|beit|naflexvit|flexivit|samvit|aimv2)")


def unsupported_reason(name: str) -> str | None:
    """What an architecture named `name` (timm style, any ".tag") needs that this model lacks, or None. timm-style
    names that neither resolve nor match a known refusal are refused as having no preset."""
    key = name.split(".")[0]
    if why := next((why for pattern, why in _UNSUPPORTED if pattern.search(key)), None):
        return why
    if _TIMM_STYLE.match(key) and _resolve(key) is None:
        return "a timm architecture with no vit-serve preset (its options are not mapped)"
    return None


def _dims(size: str) -> tuple[int, int, int, int]:
    return SIZES[_TIMM_SIZE[size]] if size in _TIMM_SIZE else TIMM_SIZES[size]


def _preset(size: str, patch: int, img: int = 224, hybrid: bool = False, **kw: Any) -> ViTConfig:
    """A config of a paper size ("B") or a timm size ("base", "so400m"). An image size that is not a multiple
    of the patch is floored to one, which is what timm's patch conv reads of it (So400m/14 at 384: 27 x 27
    patches, 378 px)."""
    d, depth, heads, mlp = SIZES[size] if size in SIZES else _dims(size)
    img = img // patch * patch
    cfg: dict[str, Any] = dict(embed_dim=d, depth=depth, num_heads=heads, mlp_dim=mlp, patch_size=patch,
                               img_size=(img, img))
    if hybrid:
        cfg["resnet_layers"] = (3, 4, 9)
    cfg.update(kw)
    return ViTConfig(**cfg)


def _deit(m: re.Match[str]) -> ViTConfig:
    """timm deit.py: DeiT (distilled: [dist] token + head_dist); DeiT-III: LayerScale 1e-6, no_embed_class."""
    g = m.groupdict()
    v3 = dict(init_values=1e-6, no_embed_class=True) if g.get("v3") else {}
    return _preset(g["size"], int(g["patch"]), int(g["img"]), family="deit", dist_token=bool(g.get("dist")), **v3)


def _dinov2(m: re.Match[str]) -> ViTConfig:
    """timm's DINOv2 (518 px, LayerScale 1e-5); `_reg4_`: 4 registers without position embeddings; the giant:
    1536 wide, 24 heads, SwiGLU 4096 wide per branch (timm's packed GluMlp, int(1536 * 5.33334) / 2)."""
    reg = int(m["reg"] or 0)
    kw: dict[str, Any] = dict(family="dinov2", init_values=1e-5, reg_tokens=reg, no_embed_class=reg > 0)
    if m["size"] == "giant":
        return ViTConfig(embed_dim=1536, depth=40, num_heads=24, mlp="swiglu", mlp_dim=int(1536 * 5.33334) // 2,
                         patch_size=14, img_size=(518, 518), **kw)
    return _preset(m["size"], int(m["patch"]), 518, **kw)


def _clip(m: re.Match[str]) -> ViTConfig:
    """timm's CLIP image towers: pre_norm (norm_pre, bias-free patch conv), nn.LayerNorm eps 1e-5; QuickGELU
    for the `_quickgelu_` names (OpenAI weights)."""
    return _preset(m["size"], int(m["patch"]), int(m["img"]), family="clip", norm_pre=True, patch_bias=False,
                   layer_norm_eps=1e-5, gelu="quick" if m["quick"] else "exact")


def _siglip(m: re.Match[str]) -> ViTConfig:
    """timm's SigLIP image towers: no class token, MAP pooling (`_gap_`: mean of tokens, no fc_norm)."""
    tanh = m[0].replace("_siglip_gap_", "_siglip_") in _SIGLIP_TANH
    return _preset(m["size"], int(m["patch"]), int(m["img"]), family="siglip", class_token=False,
                   pool="gap" if m["gap"] else "map", gelu="tanh" if tanh else "exact")


# timm.models.eva: DINOv3 (and LingBot-Vision, the same architecture), PE, EVA / EVA-02, RoPE-ViT and timm's own
# RoPE ViTs, each with its numerics (timm 1.0.31's `model_args`).
_EVA_SIZES: dict[str, tuple[int, int, int]] = {
    "tiny": (192, 12, 3), "small": (384, 12, 6), "small_plus": (384, 12, 6), "base": (768, 12, 12),
    "medium": (512, 12, 8), "mediumd": (512, 20, 8), "betwixt": (640, 12, 10), "large": (1024, 24, 16),
    "huge_plus": (1280, 32, 20), "giant": (1536, 40, 24), "gigantic": (1536, 50, 16),
}


_PE_LANG_DEPTH = {"large": 23, "gigantic": 47}


def _eva_base(size: str, patch: int, img: int, **kw: Any) -> ViTConfig:
    d, depth, heads = _EVA_SIZES[size]
    ratio = kw.pop("mlp_ratio", 4.0)
    fields: dict[str, Any] = dict(embed_dim=d, depth=depth, num_heads=heads, mlp_dim=int(d * ratio),
                                  patch_size=patch, img_size=(img, img), resample_mode="timm")
    return ViTConfig(**{**fields, **kw})


def _dinov3(m: re.Match[str]) -> ViTConfig:
    """DINOv3 (timm `vit_*_patch16_dinov3[_qkvb]`, LingBot `*_lingbot`): 4 registers, RoPE only ("dinov3": centred
    coordinates in [-1, 1], temperature 100, half rotation), LayerScale 1e-5, LayerNorm eps 1e-5, EvaAttention (with
    `_qkvb`: q and v biases); `*_plus`: SwiGLU. Pooled by the class token, as upstream (timm defaults to the
    patch average: pool='gap' gives timm's)."""
    size = m["size"]
    lingbot = m["kind"] == "lingbot"
    bias = bool(m["qkvb"]) or (lingbot and size != "giant")
    swiglu = size in ("small_plus", "huge_plus", "giant")
    return _eva_base(size, 16, 512 if lingbot else 256, family="dinov3", reg_tokens=4, pos_embed=False,
                     init_values=1e-5, layer_norm_eps=1e-5, qkv_bias=bias, k_bias=not bias,
                     mlp="swiglu" if swiglu else "gelu", mlp_ratio=8 / 3 if size == "giant" else 4.0,
                     rope=RopeConfig("dinov3", temperature=100, rotate_half=True))


def _pe(m: re.Match[str]) -> ViTConfig:
    """Perception Encoder (timm `vit_pe_{core,spatial,lang}_*`): RoPE ("axial", offset 1, 'xy', rescaled to the
    pretraining grid) and absolute embeddings both, norm_pre with a bias-free patch conv, eps 1e-5. Core: MAP pool
    (8 heads, MLP 4x); spatial and lang: the patch average without any final norm. The gigantic ones have no
    class token and no offset."""
    size, patch, img = m["size"], int(m["patch"]), int(m["img"])
    gig = size == "gigantic"
    grid = 32 if m["kind"] != "core" else img // patch
    kw: dict[str, Any] = dict(family="pe", norm_pre=True, patch_bias=False, layer_norm_eps=1e-5,
                              class_token=not gig, mlp_ratio=5.833333333333333 if gig else 4.0,
                              rope=RopeConfig("axial", grid_offset=0.0 if gig else 1.0, grid_indexing="xy",
                                              ref_grid=(grid, grid)))
    if m["kind"] == "core":
        kw.update(pool="map", pool_heads=8, pool_mlp_dim=int(_EVA_SIZES[size][0] * 4.0))
    else:
        kw.update(pool="gap", final_norm=False)
    if m["kind"] == "lang" or (m["kind"] == "spatial" and gig):
        kw["init_values"] = 0.1
    if m["kind"] == "lang" and size in _PE_LANG_DEPTH:  # PE-lang keeps the blocks before the ones it was cut at
        kw["depth"] = _PE_LANG_DEPTH[size]
    return _eva_base(size, patch, img, **kw)


def _eva(m: re.Match[str]) -> ViTConfig:
    """EVA-02 (timm `eva02_*`): RoPE ("axial", 'ij', rescaled to 16 x 16) with absolute embeddings, SwiGLU
    (`base` / `large`: with the sub-LayerNorm), q and v biases only; patch average + fc_norm, or (`_clip_`) the
    class token, the final norm and EVA-CLIP's attention norm. EVA-01 (`eva_giant_*`): GELU MLP, no RoPE."""
    g = m.groupdict()
    size, patch, img, clip = g["size"], int(g["patch"]), int(g["img"]), bool(g.get("clip"))
    pool = dict(pool="token") if clip else dict(pool="gap", fc_norm=True, final_norm=False)
    if g.get("v1"):
        return ViTConfig(embed_dim=1408, depth=40, num_heads=16, mlp_dim=int(1408 * (6144 / 1408)), patch_size=14,
                         img_size=(img // 14 * 14,) * 2, family="eva", k_bias=False, resample_mode="timm", **pool)
    big = size in ("base", "large")
    d, depth, heads = {"tiny": (192, 12, 3), "small": (384, 12, 6), "base": (768, 12, 12),
                       "large": (1024, 24, 16)}[size]
    return ViTConfig(embed_dim=d, depth=depth, num_heads=heads, mlp_dim=int(d * (4 * 2 / 3)), patch_size=patch,
                     img_size=(img, img), family="eva", k_bias=False, mlp="swiglu", mlp_norm=big,
                     attn_norm=clip, rope=RopeConfig("axial", ref_grid=(16, 16)), resample_mode="timm", **pool)


def _ropevit(m: re.Match[str]) -> ViTConfig:
    """RoPE-ViT (Heo et al. 2024; timm `vit_*_patch16_rope[_mixed][_ape]_224`): RoPE "axial" (temperature 100) or
    "mixed" (learned, temperature 10), 'xy'; `_ape`: with absolute embeddings (patches only). LayerScale 1e-5,
    class token. timm's own `vit_*_patch16_rope_reg<n>_gap_256`: registers, no class token, RoPE rescaled to 16 x
    16, q / v biases, patch average + fc_norm."""
    g = m.groupdict()
    if g.get("reg"):
        bias = g["size"] != "mediumd"
        return _eva_base(g["size"], 16, 256, family="ropevit", class_token=False, reg_tokens=int(g["reg"]),
                         pos_embed=False, pool="gap", fc_norm=True, final_norm=False, init_values=1e-5,
                         qkv_bias=bias, k_bias=not bias, rope=RopeConfig("axial", ref_grid=(16, 16)))
    mixed, ape = bool(g["mixed"]), bool(g["ape"])
    rope = RopeConfig("mixed", temperature=10) if mixed else RopeConfig("axial", temperature=100)
    return _eva_base(g["size"], 16, 224, family="ropevit", pos_embed=ape, no_embed_class=ape, init_values=1e-5,
                     rope=dataclasses.replace(rope, grid_indexing="xy"))


_EVA_FAMILIES: tuple[tuple[re.Pattern[str], Any], ...] = (
    (re.compile(r"^vit_(?P<size>tiny|small|small_plus|base|large|huge_plus)_patch16_(?P<kind>dinov3)(?P<qkvb>_qkvb)?$"),
     _dinov3),
    (re.compile(r"^vit_(?P<size>small|base|large|giant)_patch16_(?P<kind>lingbot)(?P<qkvb>)$"), _dinov3),
    (re.compile(r"^vit_pe_(?P<kind>core)_(?P<size>tiny|small|base|large|gigantic)_patch(?P<patch>14|16)_(?P<img>\d+)$"),
     _pe),
    (re.compile(r"^vit_pe_(?P<kind>spatial|lang)_(?P<size>tiny|small|base|large|gigantic)_patch(?P<patch>14|16)_"
                r"(?P<img>\d+)$"), _pe),
    (re.compile(r"^eva02_(?P<size>tiny|small|base|large)_patch(?P<patch>14|16)_(?P<clip>clip_)?(?P<img>\d+)$"), _eva),
    (re.compile(r"^(?P<v1>eva)_(?P<size>giant)_patch(?P<patch>14)_(?P<clip>clip_)?(?P<img>\d+)$"), _eva),
    (re.compile(r"^vit_(?P<size>small|base|large)_patch16_rope(?P<mixed>_mixed)?(?P<ape>_ape)?_224$"), _ropevit),
    (re.compile(r"^vit_(?P<size>medium|mediumd|betwixt|base)_patch16_rope_reg(?P<reg>\d)_gap_256$"), _ropevit),
)


_PAPER = re.compile(r"^(?:(?P<r50>R50\+))?(?:ViT-)?(?P<size>Ti|S|B|L|H)/(?P<patch>\d+)$")
_TIMM = re.compile(r"^vit_(?P<size>tiny|small|base|large|huge)_patch(?P<patch>\d+)(?P<gap>_gap)?_(?P<img>\d+)$")
_TIMM_R50 = re.compile(r"^vit_(?P<size>base|large)_r50_s16_(?P<img>\d+)$")
_FAMILIES: tuple[tuple[re.Pattern[str], Any], ...] = (
    (re.compile(r"^deit_(?P<size>tiny|small|base)_(?P<dist>distilled_)?patch(?P<patch>16)_(?P<img>\d+)$"), _deit),
    (re.compile(r"^deit(?P<v3>3)_(?P<size>small|medium|base|large|huge)_patch(?P<patch>\d+)_(?P<img>\d+)$"), _deit),
    (re.compile(r"^vit_(?P<size>small|base|large|giant)_patch(?P<patch>14)_(?:reg(?P<reg>\d+)_)?dinov2$"), _dinov2),
    (re.compile(r"^vit_(?P<size>xsmall|medium|betwixt|base|large|huge|giant|gigantic)_patch(?P<patch>\d+)_clip_"
                r"(?P<quick>quickgelu_)?(?P<img>\d+)$"), _clip),
    (re.compile(r"^vit_(?P<size>base|large|so400m|giantopt)_patch(?P<patch>\d+)_siglip_(?P<gap>gap_)?"
                r"(?P<img>\d+)$"), _siglip),
)
FAMILY_PATTERNS = ("deit_{tiny,small,base}_[distilled_]patch16_<img>", "deit3_<size>_patch<p>_<img>",
                   "vit_{small,base,large,giant}_patch14_[reg<n>_]dinov2", "vit_<size>_patch<p>_clip_[quickgelu_]<img>",
                   "vit_{base,large,so400m,giantopt}_patch<p>_siglip_[gap_]<img>",
                   "vit_<size>_patch16_dinov3[_qkvb]", "vit_pe_{core,spatial,lang}_<size>_patch<p>_<img>",
                   "eva02_<size>_patch<p>_[clip_]<img>", "vit_<size>_patch16_rope[_mixed][_ape]_224")


def family_preset_names() -> list[str]:
    """timm names of the families' main presets (DeiT, DeiT-III, DINOv2 (+registers), CLIP, SigLIP)."""
    names = [f"deit_{s}_{d}patch16_{i}" for s in ("tiny", "small", "base") for d in ("", "distilled_")
             for i in (224, 384)]
    names += [f"deit3_{s}_patch16_224" for s in ("small", "medium", "base", "large")] + ["deit3_huge_patch14_224"]
    names += [f"vit_{s}_patch14_{r}dinov2" for s in ("small", "base", "large") for r in ("", "reg4_")]
    names += [f"vit_base_patch{p}_clip_{q}224" for p in (16, 32) for q in ("", "quickgelu_")]
    names += [f"vit_large_patch14_clip_{q}{i}" for q in ("", "quickgelu_") for i in (224, 336)]
    names += ["vit_huge_patch14_clip_224", "vit_medium_patch16_clip_224"]
    names += [f"vit_base_patch16_siglip_{i}" for i in (224, 256, 384, 512)] + ["vit_base_patch32_siglip_256"]
    names += [f"vit_large_patch16_siglip_{i}" for i in (256, 384)]
    names += [f"vit_so400m_patch14_siglip_{i}" for i in (224, 378, 384)] + ["vit_so400m_patch16_siglip_256"]
    names += ["vit_base_patch16_siglip_gap_224", "vit_giantopt_patch16_siglip_256"]
    return names


def preset_names() -> list[str]:
    """Every canonical preset name: paper style ("B/16"), timm style ("vit_base_patch16_224") and the timm
    families' main names (`family_preset_names`)."""
    names = [f"{s}/{p}" for s in SIZES for p in PATCHES] + ["R50+B/16"]
    names += [f"vit_{_SIZE_TIMM[s]}_patch{p}_224" for s in SIZES for p in PATCHES] + ["vit_base_r50_s16_224"]
    return names + family_preset_names()


def _resolve(key: str) -> ViTConfig | None:
    if m := _PAPER.match(key):
        return _preset(m["size"], int(m["patch"]), hybrid=bool(m["r50"]))
    if m := _TIMM.match(key):
        gap = dict(class_token=False, pool="gap") if m["gap"] else {}
        return _preset(_TIMM_SIZE[m["size"]], int(m["patch"]), int(m["img"]), **gap)
    if m := _TIMM_R50.match(key):
        return _preset(_TIMM_SIZE[m["size"]], 16, int(m["img"]), hybrid=True)
    families = (*_FAMILIES, *_EVA_FAMILIES)
    return next((build(m) for pattern, build in families if (m := pattern.match(key))), None)


def get_config(name: str, **overrides: Any) -> ViTConfig:
    """Resolve a preset name to a ViTConfig; keyword overrides replace fields (e.g. num_classes=10).

    timm names carry the family's numerics: DeiT (`_distilled_`: distillation token), DeiT-III, DINOv2
    (`_reg4_`), CLIP (`_quickgelu_`: QuickGELU) and SigLIP. ValueError for unknown names, and for known
    architectures this model does not implement (EVA-02, BEiT, RoPE, SwiGLU), naming what is missing.
    """
    key = name.split(".")[0]  # timm's "arch.pretrained_tag"
    if why := unsupported_reason(key):
        raise ValueError(f"model {name!r} is not supported: {why}")
    cfg = _resolve(key)
    if cfg is None:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(preset_names()[:42])} "
                         "(timm names may end in any image size or '_gap_<size>'), and the timm families "
                         + ", ".join(FAMILY_PATTERNS))
    if cfg.patch_size not in PATCHES:
        raise ValueError(f"unknown patch size {cfg.patch_size} in {name!r}; presets have {PATCHES}")
    return cfg.replace(**overrides) if overrides else cfg
