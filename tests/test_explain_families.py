"""Attention rollout (vit_serve.explain.rollout) for every family, against timm's own attention probabilities.

Reference: each tiny timm model of tests/family_models.py run with `attn.fused_attn = False`, its softmax
probabilities hooked at every block's `attn.attn_drop` (for SigLIP also the attention pool's probe, recomputed
from timm's own `attn_pool.latent`, `q`, `kv`), fed through the rollout of jacobgil/vit-explain (vit_rollout.py
`rollout`: mean over heads, the int(N² · ratio) lowest weights zeroed with [0, 0] spared, + I, rows normalised,
the product over layers), read from the [class] row, or for SigLIP from the probe row (head mean, normalised)
times the rollout. Maps are compared with vit_export.parity.compare_rollout: within 1e-5 beyond what flipping
weights within rounding of a discard threshold can explain (the rule of the export's rollout check).
"""

from __future__ import annotations

import pytest
import torch

from tests.family_models import FAMILIES, ours, timm_model

pytest.importorskip("timm")
KEYS = ["deit", "dinov2_reg", "clip", "siglip"]


def timm_attentions(ref: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """timm's softmax probabilities: L tensors [B, heads, N, N] (hooked at attn_drop), and for a MAP model the
    pool's probe [B, heads, 1, N] last (recomputed from timm's latent, q and kv on the pool's input)."""
    probs: list[torch.Tensor] = []
    pool_in: list[torch.Tensor] = []
    hooks = []
    for blk in ref.blocks:
        blk.attn.fused_attn = False
        hooks.append(blk.attn.attn_drop.register_forward_hook(lambda m, i, o: probs.append(o.detach())))
    pool = getattr(ref, "attn_pool", None)
    if pool is not None:
        hooks.append(pool.register_forward_pre_hook(lambda m, args: pool_in.append(args[0].detach())))
    try:
        with torch.no_grad():
            ref(x)
    finally:
        for h in hooks:
            h.remove()
    if pool is not None:
        t = pool_in[0]
        b, n, c = t.shape
        hd = c // pool.num_heads
        q = pool.q(pool.latent.expand(b, -1, -1)).reshape(b, -1, pool.num_heads, hd).transpose(1, 2)
        k = pool.kv(t).reshape(b, n, 2, pool.num_heads, hd).permute(2, 0, 3, 1, 4)[0]
        q, k = pool.q_norm(q), pool.k_norm(k)
        probs.append(((q * pool.scale) @ k.transpose(-2, -1)).softmax(dim=-1).detach())
    return probs


def vit_explain_rollout(attentions: list[torch.Tensor], discard_ratio: float, spare_first: bool) -> torch.Tensor:
    """jacobgil/vit-explain's rollout per image (rows normalised as vit_serve does): [B, N, N]."""
    n = attentions[0].shape[-1]
    result = torch.eye(n).repeat(attentions[0].shape[0], 1, 1)
    for attn in attentions:
        fused = attn.mean(dim=1).clone()
        for flat in fused.view(fused.shape[0], -1):
            _, idx = flat.topk(int(flat.size(-1) * discard_ratio), -1, False)
            flat[idx[idx != 0] if spare_first else idx] = 0
        a = fused + torch.eye(n)
        a = a / a.sum(dim=-1, keepdim=True)
        result = a @ result
    return result


def reference_map(probs: list[torch.Tensor], pool: str, prefix: int, grid: tuple[int, int],
                  discard_ratio: float) -> torch.Tensor:
    """The reference map [B, gh, gw]: the [class] row, or the probe row times the rollout (SigLIP)."""
    encoder = probs[:-1] if pool == "map" else probs
    r = vit_explain_rollout(encoder, discard_ratio, spare_first=prefix > 0)
    if pool == "map":
        q = probs[-1].mean(dim=1)[:, 0]
        row = ((q / q.sum(dim=-1, keepdim=True))[:, None] @ r)[:, 0]
    else:
        row = r[:, 0]
    return row[:, prefix:].reshape(-1, *grid)


@pytest.fixture(scope="module", params=KEYS)
def family(request):
    fam = FAMILIES[request.param]
    ref = timm_model(fam)
    model = ours(fam, ref)
    x = torch.randn(3, 3, fam.img, fam.img, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, attentions = model(x, return_attention=True)
    return fam, model, timm_attentions(ref, x), list(attentions)


def test_our_attentions_are_timms(family):
    """Same probabilities before any rollout (timm's order: [cls, dist, reg..., patches])."""
    _, model, probs, attentions = family
    assert len(probs) == len(attentions) == model.cfg.depth + (model.cfg.pool == "map")
    for a, b in zip(attentions, probs, strict=True):
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-6


@pytest.mark.parametrize("discard_ratio", [0.0, 0.9])
def test_rollout_matches_vit_explain_on_timms_attention(family, discard_ratio):
    from vit_export.parity import compare_rollout

    from vit_serve.explain import rollout

    fam, model, probs, attentions = family
    cfg, prefix = model.cfg, model.num_prefix_tokens
    grid = (fam.img // cfg.patch_size,) * 2
    heat = rollout(attentions, grid, prefix, cfg.pool, "mean", discard_ratio)
    n = attentions[0].shape[-1]
    assert prefix == int(cfg.class_token) + int(cfg.dist_token) + cfg.reg_tokens
    assert heat.map.shape == (3, *grid) and n == prefix + grid[0] * grid[1]  # prefix columns are not in it
    assert heat.query == ("map-probe" if cfg.pool == "map" else "cls")
    ref = reference_map(probs, cfg.pool, prefix, grid, discard_ratio)
    cmp = compare_rollout(ref.numpy(), attentions, grid, prefix, cfg.pool, "mean", discard_ratio)
    print(f"{fam.key} discard {discard_ratio}: max |Δ| {cmp.max_abs:.2e}, near {cmp.near}, beyond {cmp.beyond:.2e}")
    assert cmp.ok, cmp
