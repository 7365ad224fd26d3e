"""open_clip image towers (`CLIP.visual`) -> our layout; reproduces `open_clip model.encode_image` exactly.

Architecture from `open_clip.get_model_config(name)` (`--arch open_clip:ViT-B-32`). Its own ViT maps as

    conv1 -> patch_embed.proj (no bias)     class_embedding -> cls_token     positional_embedding -> pos_embed
    ln_pre -> norm_pre     transformer.resblocks.i.{ln_1, attn.in_proj_*, attn.out_proj, ln_2, mlp.c_fc,
    mlp.c_proj, ls_1.gamma, ls_2.gamma} -> blocks.i.{norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2,
    ls1.gamma, ls2.gamma}     ln_post -> norm     proj [W, E] -> proj.weight [E, W]

LayerNorm eps 1e-5, QuickGELU for the *-quickgelu configs, resample mode "open_clip". SigLIP configs wrap a
timm trunk (`visual.trunk.*`): a timm state dict, converted by `convert_timm` (timm's VisionTransformer, or its
`Eva` for PE-Core-* and EVA02-*: RoPE and SwiGLU, see timm_eva), plus open_clip's optional linear
`visual.head.proj`; with `timm_proj: null` (PE-Core, EVA02) the trunk's own classifier `head` [E, W], with its
bias, is the projection (`proj_bias`). The timm architecture decides what is refused (`unsupported_reason`:
EVA02-E's post-norm blocks, ...); ResNet, ConvNeXt and the other non-ViT towers are refused in one line.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from vit_serve.checkpoints.converted import CheckpointError, Converted, strip_prefixes
from vit_serve.checkpoints.unsupported import UnsupportedCheckpoint
from vit_serve.config import ViTConfig, unsupported_reason
from vit_serve.preprocess import PreprocessConfig

ARCH_PREFIX = "open_clip:"
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
_BLOCK = re.compile(r"^transformer\.resblocks\.(\d+)\.(.+)$")
_BLOCK_NAMES = {
    "ln_1": "norm1", "attn.in_proj_weight": "attn.qkv.weight", "attn.in_proj_bias": "attn.qkv.bias",
    "attn.out_proj": "attn.proj", "ln_2": "norm2", "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2",
    "ls_1.gamma": "ls1.gamma", "ls_2.gamma": "ls2.gamma",
}
_UNSUPPORTED_VISION = {  # open_clip vision_cfg options our ViT does not have
    "attentional_pool": "attentional pooling (CoCa)", "final_ln_after_pool": "LayerNorm after pooling (CLIPA)",
    "qk_norm": "q/k LayerNorm", "scaled_cosine_attn": "scaled cosine attention", "scale_heads": "head scales",
    "scale_attn_inner": "inner attention LayerNorm", "scale_attn": "post-attention LayerNorm",
    "scale_fc": "MLP LayerNorm",
}
_TIMM_REFUSED = (("vit_relpos", "relative position bias (BEiT-style) is not supported"),)
_TIMM_VITS = ("vit_", "eva")  # timm's VisionTransformer and Eva (EVA, EVA-02, PE, DINOv3, RoPE-ViT) towers


def is_open_clip_layout(keys: Iterable[str]) -> bool:
    """An open_clip CLIP / CustomTextCLIP state dict (its image tower under `visual.`)."""
    keys = set(keys)
    return bool({"visual.conv1.weight", "visual.class_embedding"} & keys) or any(
        k.startswith("visual.trunk.") for k in keys)


def is_open_clip_arch(arch: str | None) -> bool:
    return bool(arch) and arch.startswith(ARCH_PREFIX)


def model_config(arch: str) -> dict[str, Any]:
    """open_clip's model config (embed_dim, vision_cfg, text_cfg, ...) for "open_clip:NAME" or "NAME"."""
    name = arch[len(ARCH_PREFIX):] if arch.startswith(ARCH_PREFIX) else arch
    try:
        import open_clip
    except ImportError as e:
        raise CheckpointError(f"--arch {arch} needs open_clip_torch ({e}); pip install 'vit-serve[clip]'") from None
    cfg = open_clip.get_model_config(name)
    if cfg is None:
        raise CheckpointError(f"unknown open_clip model config {name!r} (see open_clip.list_models())")
    return cfg


def vision_problem(cfg: Mapping[str, Any]) -> str | None:
    """Why an open_clip config's image tower cannot be ours (one line), or None."""
    v = cfg.get("vision_cfg", {})
    if name := v.get("timm_model_name"):
        for prefix, why in _TIMM_REFUSED:
            if name.startswith(prefix):
                return f"open_clip tower {name}: {why}"
        if why := unsupported_reason(name):  # decided by the timm architecture, as for timm's own files
            return f"open_clip tower {name}: {why}"
        if not name.startswith(_TIMM_VITS) or "_mci_" in name:
            return f"open_clip tower {name} is not a ViT (only ViT towers are supported)"
        if v.get("timm_pool", "avg") in ("abs_attn", "rot_attn") or v.get("timm_proj", "linear") == "mlp":
            return f"open_clip tower {name}: pool {v.get('timm_pool')!r} / proj {v.get('timm_proj')!r} unsupported"
        return None
    if isinstance(v.get("layers"), (list, tuple)):
        return "open_clip ModifiedResNet towers (RN50, ...) are not ViTs and are not supported"
    for key, what in _UNSUPPORTED_VISION.items():
        if v.get(key):
            return f"open_clip vision option {key} ({what}) is not supported"
    if v.get("block_type") not in (None, "default"):
        return f"open_clip block_type {v['block_type']!r} is not supported"
    if v.get("pool_type", "tok") not in ("tok", "avg"):
        return f"open_clip pool_type {v['pool_type']!r} is not supported"
    return None


def _pretrained_transform(name: str) -> dict[str, Any]:
    """The transform every pretrained tag of open_clip config `name` names (pretrained.py: `_pecfg` for PE-Core's
    0.5 statistics and bilinear squash, `_slpcfg`, ...); {} when it has no tags or they disagree."""
    import open_clip

    keys = ("mean", "std", "interpolation", "resize_mode")
    found = {tuple((k, open_clip.get_pretrained_cfg(name, tag).get(k)) for k in keys)
             for tag in open_clip.list_pretrained_tags_by_model(name)}
    return {k: v for k, v in next(iter(found)) if v is not None} if len(found) == 1 else {}


def _preprocess(cfg: Mapping[str, Any], img: tuple[int, int], siglip: bool, name: str) -> PreprocessConfig:
    """open_clip's image transform for config `name`: its pretrained tags' (else pretrained.py's _pcfg / _slpcfg
    defaults), under the config's own preprocess_cfg."""
    pre = {**_pretrained_transform(name), **(cfg.get("preprocess_cfg") or {})}
    mean = tuple(pre.get("mean", (0.5,) * 3 if siglip else OPENAI_MEAN))
    std = tuple(pre.get("std", (0.5,) * 3 if siglip else OPENAI_STD))
    mode = pre.get("resize_mode", "squash" if siglip else "shortest")
    return PreprocessConfig(input_size=img, mean=mean, std=std, interpolation=pre.get("interpolation", "bicubic"),
                            crop_pct=1.0, crop_mode="squash" if mode == "squash" else "center")


def _vision_fields(cfg: Mapping[str, Any], sd: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    v = cfg["vision_cfg"]
    width, patch = sd["conv1.weight"].shape[0], sd["conv1.weight"].shape[-1]
    n_patch = sd["positional_embedding"].shape[0] - 1
    side = round(n_patch**0.5)
    if side * side != n_patch:
        raise CheckpointError(f"open_clip tower: {n_patch} position embeddings are not a square grid")
    act = (v.get("act_kwargs") or {}).get("approximate")
    gelu = "quick" if cfg.get("quick_gelu") else ("tanh" if act == "tanh" else "exact")
    layers = 1 + max(int(m[1]) for k in sd if (m := _BLOCK.match(k)))
    return dict(
        img_size=(side * patch,) * 2, patch_size=patch, in_chans=sd["conv1.weight"].shape[1], num_classes=0,
        embed_dim=width, depth=layers, num_heads=width // v.get("head_width", 64),
        mlp_dim=sd["transformer.resblocks.0.mlp.c_fc.weight"].shape[0], class_token=True,
        pool="gap" if v.get("pool_type") == "avg" else "token", layer_norm_eps=(v.get("norm_kwargs") or {}).get(
            "eps", 1e-5), gelu=gelu, resample_mode="open_clip", norm_pre="ln_pre.weight" in sd, patch_bias=False,
        init_values=1.0 if "transformer.resblocks.0.ls_1.gamma" in sd else None,
        proj_dim=sd["proj"].shape[1] if "proj" in sd else None, family="clip",
    )


def block_key(key: str) -> str | None:
    """open_clip's `transformer.resblocks.{i}.<name>` -> our `blocks.{i}.<name>` (both towers); None for others."""
    if not (m := _BLOCK.match(key)):
        return None
    rest = m[2]
    for src, dst in _BLOCK_NAMES.items():
        if rest == src or rest.startswith(src + "."):
            rest = dst + rest[len(src):]
            break
    return f"blocks.{m[1]}.{rest}"


def _rename(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, t in sd.items():
        if name := block_key(k):
            out[name] = t
        elif k == "conv1.weight":
            out["patch_embed.proj.weight"] = t
        elif k == "class_embedding":
            out["cls_token"] = t.reshape(1, 1, -1)
        elif k == "positional_embedding":
            out["pos_embed"] = t.unsqueeze(0)
        elif k == "proj":
            out["proj.weight"] = t.t().contiguous()
        else:
            out[k.replace("ln_pre.", "norm_pre.", 1).replace("ln_post.", "norm.", 1)] = t
    return out


def _convert_trunk(visual: Mapping[str, torch.Tensor], cfg: Mapping[str, Any], overrides: dict[str, Any],
                   name: str) -> Converted:
    """A timm trunk (SigLIP configs): timm's own state dict, plus open_clip's linear head projection."""
    from vit_serve.checkpoints.timm_state import convert_timm

    v = cfg["vision_cfg"]
    trunk = {k[len("trunk."):]: t for k, t in visual.items() if k.startswith("trunk.")}
    head = {k: t for k, t in visual.items() if not k.startswith("trunk.")}
    if set(head) - {"head.proj.weight"}:
        raise UnsupportedCheckpoint(f"open_clip timm head {', '.join(sorted(head))} is not supported")
    # `timm_proj: null` (PE-Core, EVA02): the trunk's own classifier [E, W] (with its bias) is the projection
    classifier = {k: trunk.pop(k) for k in ("head.weight", "head.bias") if k in trunk}
    conv = convert_timm(trunk, arch=v["timm_model_name"])
    # a CLIP tower whatever its trunk (PE-Core, EVA02 included): the projected embedding, compared by cosine
    fields: dict[str, Any] = {"family": "siglip" if "siglip" in v["timm_model_name"] else "clip"}
    state = dict(conv.state_dict)
    if "head.proj.weight" in head:  # open_clip's `proj: linear` (bias-free): our CLIP projection
        state["proj.weight"] = head["head.proj.weight"].float()
        fields["proj_dim"] = head["head.proj.weight"].shape[0]
    elif "head.weight" in classifier:
        state["proj.weight"] = classifier["head.weight"].float()
        fields["proj_dim"] = classifier["head.weight"].shape[0]
        if "head.bias" in classifier:
            state["proj.bias"] = classifier["head.bias"].float()
            fields["proj_bias"] = True
    config = conv.config.replace(**fields, resample_mode="open_clip")
    config = config.replace(**overrides) if overrides else config
    siglip = fields["family"] == "siglip"
    return Converted(config, state, source=f"open_clip {v['timm_model_name']} tower", labels=None,
                     preprocess=_preprocess(cfg, config.img_size, siglip, name))


def convert_open_clip(weights: Mapping[str, torch.Tensor], arch: str, **overrides: Any) -> Converted:
    """An open_clip state dict (the whole CLIP model, or its `visual.*` only) -> our image model.

    Args:
        weights: open_clip state dict (`visual.conv1.weight`, ..., text tower keys ignored here).
        arch: "open_clip:NAME", the open_clip model config it was created from.
        overrides: ViTConfig fields to replace.
    """
    cfg = model_config(arch)
    name = arch[len(ARCH_PREFIX):] if arch.startswith(ARCH_PREFIX) else arch
    if problem := vision_problem(cfg):
        raise UnsupportedCheckpoint(problem)
    sd = strip_prefixes(weights, ("module.", "_orig_mod."))
    visual = {k[len("visual."):]: v for k, v in sd.items() if k.startswith("visual.")}
    if not visual:
        raise CheckpointError(f"no open_clip image tower (visual.*) in the state dict for {arch}")
    if cfg["vision_cfg"].get("timm_model_name"):
        return _convert_trunk(visual, cfg, overrides, name)
    try:
        fields = _vision_fields(cfg, visual)
        config = ViTConfig(**fields)
        config = config.replace(**overrides) if overrides else config
    except (KeyError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"open_clip state dict for {arch}: cannot infer the model ({e})") from e
    state = {k: t.float() if t.is_floating_point() else t for k, t in _rename(visual).items()}
    return Converted(config, state, source=f"open_clip {name} state dict", labels=None,
                     preprocess=_preprocess(cfg, config.img_size, False, name))
