"""Attention rollout through token merges (vit_serve.explain.rollout_matrix with `merges`, explain_forward).

References: a 1 + 4 token case worked out by hand; the rollout of the code before token merging (copied here) for
r = 0; and an independent re-derivation over the input tokens from the merge sources the model traces
(`trace_source`), which never calls the rollout's own merge step (see `expanded_rollout`).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import vit_serve
from vit_serve.explain import (
    discard_lowest,
    explain_forward,
    fuse_heads,
    grad_rollout,
    rollout,
    rollout_matrix,
    rollout_to_map,
)
from vit_serve.tome import LayerMerge, bipartite_soft_matching


def test_rollout_through_one_merge_by_hand() -> None:
    """[class] c + patches p1..p4 (a 2 x 2 grid), one head, discard 0.

    Layer 1: uniform attention 1/5, so Â_1 = rownorm(A + I) = (A + I) / 2: 0.6 on the diagonal, 0.1 elsewhere,
    and R_1 = Â_1. Then one merge (r = 1) by keys chosen so that p2 (an A-token, index 2) is closest to p1 (a
    B-token, index 1): the tokens become [c, p4, {p1, p2}, p3] (protected first, kept A-tokens, B-tokens), and
    the merged row is the size-weighted (1, 1) mean of R_1's rows p1 and p2: [.1, .35, .35, .1, .1].
    Layer 2, over the 4 tokens: c attends [.1, .4, .2, .3] to [c, p4, m, p3], the others uniformly .25, so
    Â_2's c row = ([.1, .4, .2, .3] + e_c) / 2 = [.55, .2, .1, .15], other rows .625 on the diagonal, .125 off.
      R[c]  = .55 c + .2 p4 + .1 m + .15 p3 = [.375, .125, .125, .175, .2]
      R[p4] = .625 p4 + .125 (c + m + p3)   = [.1625, .13125, .13125, .1625, .4125]
      R[m]  = .625 m + .125 (c + p4 + p3)   = [.1625, .25625, .25625, .1625, .1625]
      R[p3] = .625 p3 + .125 (c + p4 + m)   = [.1625, .13125, .13125, .4125, .1625]
    Map (token pool): R[c] over the patches, [[.125, .125], [.175, .2]]. GAP: the patch rows weighted by their
    sizes (1, 2, 1): (R[p4] + 2 R[m] + R[p3]) / 4 over the patches = [[.19375, .19375], [.225, .225]].
    """
    keys = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [1.0, 0.1], [0.0, 1.0], [1.0, 1.0]]])
    m = bipartite_soft_matching(keys, 1, protected=1)
    assert m is not None
    assert m.merge(torch.arange(5.0)[None, :, None], "amax").flatten().tolist() == [0, 4, 2, 3]  # [c, p4, m, p3]
    assert m.src_idx.flatten().tolist() == [1] and m.dst_idx.flatten().tolist() == [0]  # a-token 2 -> b-token 1
    a1 = torch.full((1, 1, 5, 5), 0.2, dtype=torch.float64)
    a2 = torch.full((1, 1, 4, 4), 0.25, dtype=torch.float64)
    a2[0, 0, 0] = torch.tensor([0.1, 0.4, 0.2, 0.3], dtype=torch.float64)
    merges = [LayerMerge(m, None), LayerMerge(None, torch.tensor([[[1.0], [1.0], [2.0], [1.0]]]))]
    r = rollout_matrix([a1, a2], merges=merges)
    expected = torch.tensor([
        [0.375, 0.125, 0.125, 0.175, 0.2],
        [0.1625, 0.13125, 0.13125, 0.1625, 0.4125],
        [0.1625, 0.25625, 0.25625, 0.1625, 0.1625],
        [0.1625, 0.13125, 0.13125, 0.4125, 0.1625],
    ], dtype=torch.float64)
    torch.testing.assert_close(r[0], expected, rtol=0, atol=1e-15)
    token = rollout([a1, a2], (2, 2), 1, "token", merges=merges)
    torch.testing.assert_close(token.map[0], torch.tensor([[0.125, 0.125], [0.175, 0.2]], dtype=torch.float64),
                               rtol=0, atol=1e-15)
    gap = rollout([a1, a2], (2, 2), 1, "gap", merges=merges)
    torch.testing.assert_close(gap.map[0], torch.tensor([[0.19375, 0.19375], [0.225, 0.225]], dtype=torch.float64),
                               rtol=0, atol=1e-15)
    assert gap.query == "patch-mean"


def tiny(randomize, seed: int = 0, **kw) -> vit_serve.VisionTransformer:
    """A random 3-layer Ti/16 at 64 x 64 (a 4 x 4 grid), non-trivial weights (tests/conftest.py's randomize)."""
    torch.manual_seed(seed)
    return randomize(vit_serve.create_model("Ti/16", depth=3, img_size=64, num_classes=10, **kw), seed=seed).eval()


def rollout_before_token_merging(attentions, head_fusion="mean", discard_ratio=0.0, keep_first=True):
    """vit_serve.explain.rollout_matrix as it was before token merging (one identity, from the first layer)."""
    first = attentions[0]
    eye = torch.eye(first.shape[-1], dtype=first.dtype, device=first.device).expand_as(first[:, 0])
    result = eye
    for attn in attentions:
        a = discard_lowest(fuse_heads(attn, head_fusion), discard_ratio, keep_first) + eye
        a = a / a.sum(dim=-1, keepdim=True)
        result = a @ result
    return result


POOLS = {
    "token": {},
    "registers": {"reg_tokens": 2, "no_embed_class": True},
    "gap": {"pool": "gap", "class_token": False},
    "map": {"pool": "map", "class_token": False},
}


@pytest.mark.parametrize("kind", list(POOLS))
def test_without_merges_the_rollout_is_the_plain_one_bit_for_bit(kind: str, randomize) -> None:
    model = tiny(randomize, **POOLS[kind])
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    p, pool = model.num_prefix_tokens, model.cfg.pool
    with torch.no_grad():
        logits, attentions = model(x, return_attention=True)
        encoder = attentions[:-1] if pool == "map" else attentions
        probe = None
        if pool == "map":
            q = fuse_heads(attentions[-1])[:, 0]
            probe = q / q.sum(dim=-1, keepdim=True)
        want = rollout_to_map(rollout_before_token_merging(encoder, "mean", 0.9, p > 0), (4, 4), p, pool, probe)
        for r in (None, 0, [0, 0, 0]):
            if r is not None:
                model.set_token_merging(r)
            e = explain_forward(model, x, "mean", 0.9)
            assert e.merges == [] and torch.equal(e.logits, logits)
            assert torch.equal(e.heatmap.map, want.map) and e.heatmap.query == want.query
        # layers that merge nothing leave the rollout as it is
        none = [LayerMerge(None, None)] * len(encoder)
        assert torch.equal(rollout_matrix(encoder, "max", 0.5, merges=none), rollout_matrix(encoder, "max", 0.5))


@pytest.mark.parametrize("kind", list(POOLS))
@pytest.mark.parametrize(("head_fusion", "discard_ratio"), [("mean", 0.0), ("max", 0.9), ("min", 0.5)])
def test_rows_sum_to_one_through_merges(kind: str, head_fusion: str, discard_ratio: float, randomize) -> None:
    model = tiny(randomize, **POOLS[kind])
    model.set_token_merging([3, 2, 3])
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    p = model.num_prefix_tokens
    with torch.no_grad():
        e = explain_forward(model, x, head_fusion, discard_ratio)
    encoder = e.attentions[:-1] if model.cfg.pool == "map" else e.attentions
    assert [a.shape[-1] for a in encoder] == [p + 16, p + 13, p + 11]
    assert [m.matching.r for m in e.merges] == [3, 2, 3]
    r = rollout_matrix(encoder, head_fusion, discard_ratio, p > 0, e.merges)
    assert r.shape == (2, p + 8, p + 16)  # the final tokens' rows over the input tokens
    assert (r >= 0).all()
    torch.testing.assert_close(r.sum(dim=-1), torch.ones(2, p + 8), rtol=0, atol=1e-6)
    assert e.heatmap.map.shape == (2, 4, 4) and torch.isfinite(e.heatmap.map).all()


def expanded_rollout(model: vit_serve.VisionTransformer, x: torch.Tensor, head_fusion: str, discard_ratio: float
                     ) -> torch.Tensor:
    """The rollout map re-derived over the N_0 input tokens, from the merge sources alone (float64).

    The sources S_l [T_l, N_0] (0/1: which input tokens token t holds) of the tokens entering layer l come from
    the model's own tracing (`trace_source`) with the schedule cut after layer l - 1 (a merge depends only on the
    layers before it). Every input token j is then a node of its own: it attends as its token g(j) does, and a
    token's weight is shared evenly by the input tokens it holds, E_l[j, k] = Â_l[g(j), g(k)] / size(g(k)) =
    S^T Â_l diag(1/size) S; after layer l's merge, every input token's row is the mean over the input tokens of its
    new group, Π = S'^T diag(1/size') S'. So X_0 = I, X_l = Π_l E_l X_{l-1}, and the map reads X_L over the input
    tokens: the [class] token's row, the mean of the patch rows (GAP: every original patch alike), or for MAP
    the probe's row spread over each final token's input tokens, q^T diag(1/size_L) S_L X_L.
    Merged tokens hold the mean over their input tokens because ToMe's size-weighted average of groups is that
    mean; no size is taken from the recorded merges.
    """
    schedule = list(model.token_merging.r)
    p, pool, n0 = model.num_prefix_tokens, model.cfg.pool, model.num_prefix_tokens + 16
    sources = []  # S entering layer l, l = 0 .. L (L: after the last merge)
    for cut in range(len(schedule) + 1):
        head = schedule[:cut] + [0] * (len(schedule) - cut)
        if not any(head):
            sources.append(torch.eye(n0, dtype=torch.float64).expand(x.shape[0], n0, n0))
            continue
        model.set_token_merging(head, trace_source=True)
        with torch.no_grad():
            model(x)
        sources.append(model.tome_source.double())
    model.set_token_merging(schedule)
    with torch.no_grad():
        _, attentions = model(x, return_attention=True)
    encoder = attentions[:-1] if pool == "map" else attentions
    maps = []
    for b in range(x.shape[0]):
        xl = torch.eye(n0, dtype=torch.float64)
        for layer, attn in enumerate(encoder):
            a = discard_lowest(fuse_heads(attn[b:b + 1].double(), head_fusion), discard_ratio, p > 0)[0]
            a = a + torch.eye(a.shape[-1], dtype=torch.float64)
            a = a / a.sum(dim=-1, keepdim=True)
            s, s_next = sources[layer][b], sources[layer + 1][b]
            spread = s.T @ a @ torch.diag(1 / s.sum(dim=-1)) @ s
            mean = s_next.T @ torch.diag(1 / s_next.sum(dim=-1)) @ s_next
            xl = mean @ spread @ xl
        if pool == "token":
            row = xl[0, p:]
        elif pool == "map":
            q = fuse_heads(attentions[-1][b:b + 1].double(), head_fusion)[0, 0]
            s = sources[-1][b]
            row = ((q / q.sum()) @ torch.diag(1 / s.sum(dim=-1)) @ s @ xl)[p:]
        else:
            row = xl[p:, p:].mean(dim=0)
        maps.append(row.reshape(4, 4))
    return torch.stack(maps)


@pytest.mark.parametrize("kind", list(POOLS))
@pytest.mark.parametrize("discard_ratio", [0.0, 0.9])
def test_the_composition_equals_the_expansion_over_the_merge_sources(kind: str, discard_ratio: float,
                                                                      randomize) -> None:
    model = tiny(randomize, **POOLS[kind])
    model.set_token_merging([3, 2, 3])
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = explain_forward(model, x, "mean", discard_ratio).heatmap.map
    want = expanded_rollout(model, x, "mean", discard_ratio)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    model.set_token_merging(0)
    with torch.no_grad():
        plain = explain_forward(model, x, "mean", discard_ratio).heatmap.map
    assert (plain - got).abs().max() > 1e-3  # the merges change the map: the comparison above means something


FAMILY_KEYS = ["deit", "dinov2_reg", "siglip"]


@pytest.mark.parametrize("key", [*FAMILY_KEYS, "gap"])
def test_families_with_prefix_tokens_and_token_merging(key: str, randomize) -> None:
    """Every family with prefix tokens (tests/family_models.py: DeiT's [dist], DINOv2's registers, SigLIP's MAP
    head; and a GAP model): with ToMe the map covers the grid, is finite, non-negative, and its mass over the
    patches is at most 1 (rows sum to 1 over all input tokens, prefix ones included)."""
    if key == "gap":
        model = tiny(randomize, pool="gap", class_token=False, reg_tokens=1, no_embed_class=True)
        img, grid = 64, (4, 4)
    else:
        pytest.importorskip("timm")
        from tests.family_models import FAMILIES, ours, timm_model

        fam = dataclasses.replace(FAMILIES[key], img=4 * FAMILIES[key].options["patch_size"])
        model = ours(fam, timm_model(fam))
        img, grid = fam.img, (4, 4)
    model.set_token_merging([4, 3])
    x = torch.randn(2, 3, img, img, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        e = explain_forward(model, x, "mean", 0.9)
    heat = e.heatmap.map
    assert heat.shape == (2, *grid) and torch.isfinite(heat).all() and (heat >= 0).all()
    mass = heat.sum(dim=(1, 2))
    assert (mass > 0).all() and (mass <= 1 + 1e-6).all()
    assert e.heatmap.query == {"deit": "cls", "dinov2_reg": "cls", "siglip": "map-probe", "gap": "patch-mean"}[key]
    # the prefix tokens stay first and unmerged: token counts drop by the schedule's r on the patches only
    p = model.num_prefix_tokens
    encoder = e.attentions[:-1] if model.cfg.pool == "map" else e.attentions
    assert [a.shape[-1] for a in encoder][:2] == [p + 16, p + 12]
    g = grad_rollout(model, x)
    assert g.map.shape == (2, *grid) and torch.isfinite(g.map).all()
