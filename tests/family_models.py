"""Tiny models of the families people deploy, built from the real library (timm, random weights), and the same
weights in our VisionTransformer: the references of tests/export/test_families.py and
tests/serve/test_families_gateway.py.

Each family: `timm.create_model(name, pretrained=False, embed_dim=64, depth=2, num_heads=4, img_size=...,
num_classes=5, dynamic_img_size=True)` (so the reference resamples its own way at other sizes), every float
parameter randn * 0.2, and our ViTConfig with the options that family's timm model sets; timm's state dict is
our state dict (parameter names are timm's), loaded bit-exactly. The CLIP with projection adds a bias-free
`proj` [E, D] that timm does not have; its reference is timm's pre-logits times proj^T, then the head.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vit_serve.config import ViTConfig
from vit_serve.model import VisionTransformer
from vit_serve.preprocess import PreprocessConfig

DIM, DEPTH, HEADS, CLASSES, PROJ = 64, 2, 4, 5, 32
LABELS = ["tench", "goldfish", "shark", "ray", "cock"]


@dataclass(frozen=True)
class Family:
    """One family: timm's architecture name, its native size, our config's options (besides the sizes)."""

    key: str
    timm_name: str
    img: int
    options: dict
    proj: bool = False


FAMILIES = {f.key: f for f in [
    Family("deit", "deit_small_distilled_patch16_224", 32, dict(patch_size=16, dist_token=True, family="deit")),
    Family("dinov2", "vit_small_patch14_dinov2", 42, dict(patch_size=14, init_values=1e-5, family="dinov2")),
    Family("dinov2_reg", "vit_small_patch14_reg4_dinov2", 42,
           dict(patch_size=14, init_values=1e-5, reg_tokens=4, no_embed_class=True, family="dinov2")),
    Family("clip", "vit_base_patch16_clip_224", 32,
           dict(patch_size=16, norm_pre=True, patch_bias=False, layer_norm_eps=1e-5, family="clip",
                proj_dim=PROJ), proj=True),
    Family("clip_quickgelu", "vit_base_patch16_clip_quickgelu_224", 32,
           dict(patch_size=16, norm_pre=True, patch_bias=False, layer_norm_eps=1e-5, gelu="quick", family="clip")),
    Family("siglip", "vit_base_patch16_siglip_224", 32,
           dict(patch_size=16, class_token=False, pool="map", family="siglip", scores="sigmoid")),
]}


def timm_model(fam: Family, seed: int = 0) -> torch.nn.Module:
    """timm's model of the family, tiny, every float parameter randn * 0.2 (seeded), eval mode."""
    import timm

    m = timm.create_model(fam.timm_name, pretrained=False, embed_dim=DIM, depth=DEPTH, num_heads=HEADS,
                          img_size=fam.img, num_classes=CLASSES, dynamic_img_size=True).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return m


def ours(fam: Family, ref: torch.nn.Module, seed: int = 1) -> VisionTransformer:
    """Our VisionTransformer with `ref`'s weights (strict load), its labels and an ImageNet contract; the
    CLIP-with-projection family also gets a random `proj` and a head of width PROJ (seeded)."""
    cfg = ViTConfig(img_size=(fam.img, fam.img), num_classes=CLASSES, embed_dim=DIM, depth=DEPTH,
                    num_heads=HEADS, mlp_dim=4 * DIM, **fam.options)
    model = VisionTransformer(cfg).eval()
    sd = dict(ref.state_dict())
    if fam.proj:
        g = torch.Generator().manual_seed(seed)
        sd["proj.weight"] = torch.randn(PROJ, DIM, generator=g) * 0.2
        sd["head.weight"] = torch.randn(CLASSES, PROJ, generator=g) * 0.2
    model.load_state_dict(sd, strict=True)
    model.labels = list(LABELS)
    model.preprocess_cfg = PreprocessConfig(input_size=(fam.img, fam.img), crop_pct=1.0)
    return model


def reference(fam: Family, ref: torch.nn.Module, model: VisionTransformer, x: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [B, K], embedding [B, E]) computed by timm: `forward_head(pre_logits=True)` is the embedding
    (times proj^T for the projected CLIP, whose head then reads it)."""
    with torch.no_grad():
        feats = ref.forward_features(x)
        emb = ref.forward_head(feats, pre_logits=True)
        if not fam.proj:
            return ref.forward_head(feats), emb
        emb = emb @ model.proj.weight.T
        return model.head(emb), emb


def triton_export(folder: Path, model: VisionTransformer, name: str, **options: Any) -> Path:
    """`model` saved as folder/NAME.safetensors and exported by vit_export as ONNX and a Triton repository
    (logits and embedding, `options` added); the repository's folder."""
    import vit_export

    import vit_serve

    ckpt = vit_serve.save(model, folder / f"{name}.safetensors")
    result = vit_export.export(ckpt, vit_export.ExportOptions(
        out=folder / "exports", repo=folder / "repo", name=name, formats=("onnx", "triton"),
        outputs="logits,embedding", **options))
    assert result.ok
    return folder / "repo"
