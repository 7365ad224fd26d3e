"""Token merging (vit_serve.tome, VisionTransformer.set_token_merging) against a reference on timm's models.

Reference: re-derived here from the paper's algorithm (Bolya et al. 2023, Sec. 3, and the behaviour of its
reference implementation facebookresearch/ToMe, `tome/patch/timm.py`), written per image with Python loops
over timm's own modules (tests/family_models.py: tiny timm models, random weights): in every block, attention
with + log(size) on the logits (proportional attention), then the tokens split alternately into A and B by
index, each A token's most similar B token by the cosine of the keys averaged over heads, the r A tokens with
the highest similarity merged into theirs by size-weighted average (sizes add), the leading class,
distillation and register tokens never merged, then the MLP; LayerScale kept on both branches (the reference
patch predates timm's LayerScale, so it would drop DINOv2's). The reference's output order (protected tokens,
kept A tokens by index, or by similarity without protected tokens, B tokens) is kept, so tokens are compared
directly, not only logits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.family_models import FAMILIES, ours, timm_model
from vit_serve.tome import bipartite_soft_matching, parse_r, tokens_after

pytest.importorskip("timm")


def reference_merge(x: torch.Tensor, size: torch.Tensor, keys: torch.Tensor, r: int,
                    protected: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One image: x [T, D], size [T], keys [T, C] -> merged (x, size), by the paper's bipartite matching."""
    t = x.shape[0]
    r = min(r, (t - protected) // 2)
    if r <= 0:
        return x, size
    k = keys / keys.norm(dim=-1, keepdim=True)
    a_side = [i for i in range(0, t, 2) if i >= protected]
    b_side = [j for j in range(1, t, 2) if j >= protected]
    best = {i: max(b_side, key=lambda j: float(k[i] @ k[j])) for i in a_side}
    score = {i: float(k[i] @ k[best[i]]) for i in a_side}
    by_score = sorted(a_side, key=lambda i: -score[i])
    merged = set(by_score[:r])
    members = {j: [j] + [i for i in a_side if i in merged and best[i] == j] for j in range(1, t, 2)}
    # the kept A tokens by index when there are protected tokens (the reference sorts them so that the class
    # token stays first), else in the order of their similarity, highest first (the reference leaves them so)
    kept = sorted(by_score[r:]) if protected else by_score[r:]
    order = [*range(protected), *kept, *[j for j in range(1, t, 2) if j >= protected]]
    rows, sizes = [], []
    for i in order:
        group = members.get(i, [i])
        w = size[group]
        rows.append((x[group] * w[:, None]).sum(0) / w.sum())
        sizes.append(w.sum())
    return torch.stack(rows), torch.stack(sizes)


def reference_forward(ref: torch.nn.Module, x: torch.Tensor, schedule: list[int], protected: int,
                      map_pool: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """timm's model with ToMe applied per image: (tokens after the final norm [B, T', D], logits [B, K])."""
    out_tokens, out_logits = [], []
    with torch.no_grad():
        z = ref.norm_pre(ref.patch_drop(ref._pos_embed(ref.patch_embed(x))))
        for tokens in z:
            size = torch.ones(tokens.shape[0])
            for blk, r in zip(ref.blocks, schedule, strict=True):
                attn = blk.attn
                h = blk.norm1(tokens)
                t, d = h.shape
                q, k, v = attn.qkv(h).reshape(t, 3, attn.num_heads, d // attn.num_heads).permute(1, 2, 0, 3)
                q, k = attn.q_norm(q), attn.k_norm(k)
                logits = (q @ k.transpose(-2, -1)) * attn.scale + size.log()[None, None, :]
                y = attn.proj((logits.softmax(-1) @ v).transpose(0, 1).reshape(t, d))
                tokens = tokens + blk.ls1(y)
                tokens, size = reference_merge(tokens, size, k.mean(0), r, protected)
                tokens = tokens + blk.ls2(blk.mlp(blk.norm2(tokens)))
            tokens = ref.norm(tokens)
            out_tokens.append(tokens)
            if map_pool:  # timm's AttentionPoolLatent with the sizes' log on the probe's logits
                pool = ref.attn_pool
                n, c = tokens.shape
                hd = c // pool.num_heads
                pq = pool.q_norm(pool.q(pool.latent[0]).reshape(1, pool.num_heads, hd).transpose(0, 1))
                pk, pv = pool.kv(tokens).reshape(n, 2, pool.num_heads, hd).permute(1, 2, 0, 3)
                pk = pool.k_norm(pk)
                p = ((pq @ pk.transpose(-2, -1)) * pool.scale + size.log()[None, None, :]).softmax(-1)
                y = pool.proj((p @ pv).transpose(0, 1).reshape(1, c))
                y = y + pool.mlp(pool.norm(y))
                out_logits.append(ref.head(y[0]))
            else:
                out_logits.append(ref.forward_head(tokens[None])[0])
    return torch.stack(out_tokens), torch.stack(out_logits)


def pair(key: str, img: int):
    fam = dataclasses.replace(FAMILIES[key], img=img)
    ref = timm_model(fam)
    return fam, ref, ours(fam, ref)


CASES = [  # family, image size (6 x 6 patches), r per layer
    ("deit", 96, [4, 4]), ("deit", 96, [30, 30]),  # r past half the tokens: capped, as the reference
    ("dinov2", 84, [6, 3]), ("dinov2_reg", 84, [5, 8]), ("clip_quickgelu", 96, [2, 7]),
    ("siglip", 96, [5, 5]), ("siglip", 96, [17, 0]),
]


@pytest.mark.parametrize(("key", "img", "r"), CASES, ids=[f"{k}-{img}-r{r[0]}_{r[1]}" for k, img, r in CASES])
def test_token_merging_reproduces_the_reference_on_timm_weights(key: str, img: int, r: list[int]) -> None:
    fam, ref, model = pair(key, img)
    model.set_token_merging(r)
    x = torch.randn(3, 3, img, img, generator=torch.Generator().manual_seed(5))
    protected = model.num_prefix_tokens
    want_tokens, want_logits = reference_forward(ref, x, r, protected, map_pool=fam.options.get("pool") == "map")
    with torch.no_grad():
        tokens = model.forward_features(x)
        logits = model(x)
    n0 = (img // fam.options["patch_size"]) ** 2 + protected
    assert tokens.shape[1] == tokens_after(n0, r, protected)[-1] == want_tokens.shape[1] < n0
    assert (tokens - want_tokens).abs().max() <= 1e-4  # the same tokens in the same order
    assert (logits - want_logits).abs().max() <= 1e-4


def test_r_zero_is_the_model_itself_bit_for_bit() -> None:
    _, _, model = pair("dinov2_reg", 84)
    x = torch.randn(2, 3, 84, 84)
    with torch.no_grad():
        plain = model(x)
        model.set_token_merging(0)
        assert model.token_merging is None
        assert torch.equal(model(x), plain)
        model.set_token_merging([0, 0])
        assert torch.equal(model(x), plain)


def test_prefix_tokens_are_never_merged_and_every_patch_lands_in_one_token() -> None:
    """The merge sources (trace_source): the class and four register tokens each hold only themselves, at
    the front; every input token is held by exactly one output token."""
    _, _, model = pair("dinov2_reg", 84)
    model.set_token_merging([12, 12], trace_source=True)
    with torch.no_grad():
        model(torch.randn(2, 3, 84, 84))
    source = model.tome_source
    n0 = 36 + 5
    assert source.shape == (2, tokens_after(n0, [12, 12], 5)[-1], n0) == (2, 41 - 12 - 12, 41)
    assert torch.equal(source[:, :5, :5], torch.eye(5).expand(2, 5, 5))
    assert torch.equal(source[:, :5, 5:], torch.zeros(2, 5, 36))
    assert torch.equal(source.sum(dim=1), torch.ones(2, n0))


def test_gap_pools_the_patches_weighted_by_their_sizes() -> None:
    """Merging two identical-keyed tokens into one changes nothing for a mean over patches: with sizes, the
    pooled vector is the mean over what the tokens hold."""
    x = torch.randn(1, 7, 8)
    m = bipartite_soft_matching(torch.randn(1, 7, 4), 2, protected=1)
    from vit_serve.tome import merge_wavg

    merged, size = merge_wavg(m, x, None)
    assert torch.allclose((merged[:, 1:] * size[:, 1:]).sum(1) / size[:, 1:].sum(1), x[:, 1:].mean(1), atol=1e-6)
    assert size.sum() == 7 and merged.shape == (1, 5, 8)


def test_parse_r_follows_the_reference_schedules() -> None:
    assert parse_r(4, 3) == [3, 3, 3, 3]
    assert parse_r(4, [1, 2]) == [1, 2, 0, 0]
    # (r, -1): the paper's decreasing schedule, min_val = int(r * 2), max_val = 0 (reference's parse_r formula)
    assert parse_r(5, (4, -1.0)) == [8, 6, 4, 2, 0]
    for bad in (-1, [1, -2], (2, 3.0), 1.5, [1, 2, 3, 4, 5]):
        with pytest.raises(ValueError, match="token merging"):
            parse_r(4, bad)
