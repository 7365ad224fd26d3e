"""Attention rollout with RoPE (vit_serve.explain.rollout on our probabilities, taken after q and k are rotated),
against the rollout of timm's own `Eva` attention probabilities (hooked at `attn.attn_drop` with the fused kernel
off; for PE's MAP pool the probe recomputed from timm's latent, q and kv), through jacobgil/vit-explain's rollout
as in tests/test_explain_families.py (EVA-02, average-pooled: the mean of the patch rows). Registers (DINOv3) are
prefix tokens: out of the map, as for DINOv2-reg. At the native grid and a non-square one (timm with
dynamic_img_size=True)."""

from __future__ import annotations

import pytest
import torch

from tests.test_explain_families import reference_map, timm_attentions, vit_explain_rollout
from vit_serve.checkpoints import build_model
from vit_serve.checkpoints.timm_state import convert_timm

timm = pytest.importorskip("timm")

CASES = {
    "vit_small_patch16_dinov3": dict(embed_dim=96, img_size=64, global_pool="token"),
    "vit_pe_core_tiny_patch16_384": dict(embed_dim=48, img_size=64, ref_feat_shape=(4, 4)),
    "eva02_tiny_patch14_224": dict(embed_dim=48, img_size=56),
    "vit_small_patch16_rope_mixed_224": dict(embed_dim=96, img_size=64),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request):
    name, kw = request.param, CASES[request.param]
    ref = timm.create_model(name, pretrained=False, num_classes=5, depth=3, dynamic_img_size=True, **kw).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ref.state_dict().values():
            if p.is_floating_point():
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    hub = {"architecture": name, "model_args": {k: v for k, v in kw.items() if k != "embed_dim"}}
    return name, ref, build_model(convert_timm(ref.state_dict(), name, hub_config=hub))


@pytest.mark.parametrize("patches", ["native", "12x9"])
@pytest.mark.parametrize("discard_ratio", [0.0, 0.9])
def test_rope_rollout_matches_vit_explain_on_timms_attention(pair, patches, discard_ratio):
    from vit_export.parity import compare_rollout

    from vit_serve.explain import rollout

    name, ref, model = pair
    cfg, prefix, p = model.cfg, model.num_prefix_tokens, model.cfg.patch_size
    grid = cfg.grid_size if patches == "native" else (12, 9)
    x = torch.randn(2, 3, grid[0] * p, grid[1] * p, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, attentions = model(x, return_attention=True)
    probs = timm_attentions(ref, x)
    assert len(probs) == len(attentions)
    assert max((a - b).abs().max().item() for a, b in zip(attentions, probs, strict=True)) <= 1e-5
    heat = rollout(attentions, grid, prefix, cfg.pool, "mean", discard_ratio)
    assert heat.map.shape == (2, *grid)
    if cfg.pool == "gap":  # EVA-02's pooled output is the patch mean: the mean of the patch rows
        r = vit_explain_rollout(probs, discard_ratio, spare_first=prefix > 0)
        expected = r[:, prefix:, prefix:].mean(dim=1).reshape(-1, *grid)
    else:
        expected = reference_map(probs, cfg.pool, prefix, grid, discard_ratio)
    cmp = compare_rollout(expected.numpy(), attentions, grid, prefix, cfg.pool, "mean", discard_ratio)
    print(f"{name} {grid} discard {discard_ratio}: max |Δ| {cmp.max_abs:.2e}, near {cmp.near}")
    assert cmp.ok, cmp
