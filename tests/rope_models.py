"""Tiny RoPE models (timm 1.0.31's `Eva`: DINOv3, PE-Core, EVA-02, RoPE-ViT axial and mixed), built from the real
library with random weights, and the same weights in our VisionTransformer (`vit_serve.checkpoints.timm_eva`,
the import a user's `vit-serve convert` runs): the references of tests/export/test_rope_export.py and
tests/serve/test_rope_export_gateway.py.

Each: `timm.create_model(name, pretrained=False, num_classes=10, depth=2, dynamic_img_size=True, **overrides)`
(so that timm computes its own RoPE tables and resamples its own absolute embeddings at other sizes), every float
tensor of the state dict plus 0.2 N(0, 1) (zero-initialised biases and LayerScale 1e-5 stay trivial otherwise).
"""

from __future__ import annotations

import torch

from vit_serve.checkpoints import build_model
from vit_serve.checkpoints.timm_state import convert_timm
from vit_serve.model import VisionTransformer

# timm name -> create_model overrides (tiny: 16 channels per head); SwiGLU: DINOv3-S+ (plain) and EVA-02 (sub-LN).
ROPE_FAMILIES = {
    "dinov3": ("vit_small_patch16_dinov3", dict(embed_dim=96, img_size=64, global_pool="token")),
    "dinov3_swiglu": ("vit_small_plus_patch16_dinov3_qkvb", dict(embed_dim=96, img_size=64, global_pool="token")),
    "pe_core": ("vit_pe_core_tiny_patch16_384", dict(embed_dim=48, img_size=64, ref_feat_shape=(4, 4))),
    "eva02": ("eva02_tiny_patch14_224", dict(embed_dim=48, img_size=56)),
    "rope_axial": ("vit_small_patch16_rope_224", dict(embed_dim=96, img_size=64)),
    "rope_mixed": ("vit_small_patch16_rope_mixed_ape_224", dict(embed_dim=96, img_size=64)),
}
_HUB_ARGS = ("num_heads", "img_size", "global_pool", "ref_feat_shape")


@torch.no_grad()
def timm_rope(key: str, seed: int = 0) -> torch.nn.Module:
    """timm's tiny model of `key` (ROPE_FAMILIES), perturbed weights (seeded), eval mode."""
    import timm

    name, overrides = ROPE_FAMILIES[key]
    ref = timm.create_model(name, pretrained=False, num_classes=10, depth=2, dynamic_img_size=True, **overrides)
    g = torch.Generator().manual_seed(seed)
    for p in ref.state_dict().values():
        if p.is_floating_point():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return ref.eval()


def ours_rope(key: str, ref: torch.nn.Module) -> VisionTransformer:
    """Our model from `ref`'s state dict, converted as a timm hub folder's config.json would have it."""
    name, overrides = ROPE_FAMILIES[key]
    hub = {"architecture": name, "model_args": {k: v for k, v in overrides.items() if k in _HUB_ARGS}}
    return build_model(convert_timm(ref.state_dict(), name, hub_config=hub)).eval()


def dinov3_hub(folder, seed: int, **overrides) -> torch.nn.Module:
    """timm's `vit_small_patch16_dinov3` as an embedder (2 blocks, width 96, 64 px, no head, its [class] token
    pooled; `overrides` to create_model on top), every float tensor plus 0.2 N(0, 1), saved with timm's own
    `save_for_hf` into `folder` (the hub folder `vit-serve convert` reads); returns the timm model in eval mode."""
    import timm
    from timm.models._hub import save_for_hf

    ref = timm.create_model("vit_small_patch16_dinov3", pretrained=False, embed_dim=96, depth=2, img_size=64,
                            num_classes=0, global_pool="token", **overrides).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.state_dict().values():  # LayerScale 1e-5 and zero biases: nothing may stay trivial
            if p.is_floating_point():
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    save_for_hf(ref, folder, safe_serialization=True, model_args=dict(img_size=64, global_pool="token"))
    return ref
