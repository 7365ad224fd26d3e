"""What a ViT attends to and what it learned: pure functions on attention probabilities and weights.

Attention rollout (Abnar & Zuidema, 2020) and gradient-weighted rollout (Chefer et al., 2021) for
`GET /explain`, the exported explain graph and `vit-serve inspect`; and the inspections of the ViT paper's
§4.5 (Figure 7): principal components of the patch-embedding filters, position-embedding similarity and
mean attention distance. Only torch is needed. Every tensor op in `rollout` has an ONNX counterpart, so the
same code runs inside an exported graph (with dynamic resolution, too: no shape becomes a Python number).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch

HEAD_FUSIONS = ("mean", "max", "min")
# The rollout settings used when none are asked for: vit-explain's defaults (mean fusion, drop the weakest 90%).
# Every default in the project (exports, the gateway, the CLIs, the manifest) is these two names.
DEFAULT_HEAD_FUSION = "mean"
DEFAULT_DISCARD_RATIO = 0.9


def fuse_heads(attn: torch.Tensor, head_fusion: str = "mean") -> torch.Tensor:
    """[B, heads, N, N] -> [B, N, N] by the mean, max or min over heads."""
    if head_fusion == "mean":
        return attn.mean(dim=1)
    if head_fusion == "max":
        return attn.amax(dim=1)
    if head_fusion == "min":
        return attn.amin(dim=1)
    raise ValueError(f"unknown head_fusion {head_fusion!r}; expected one of {', '.join(HEAD_FUSIONS)}")


def discard_lowest(a: torch.Tensor, discard_ratio: float, keep_first: bool = True) -> torch.Tensor:
    """Zero the lowest `discard_ratio` fraction of each image's [N, N] attention weights.

    a: [B, N, N] -> [B, N, N]; discard_ratio in [0, 1) (anything else is a ValueError).

    As in the vit-explain reference (its `rollout`: `flat.topk(int(N² · ratio), largest=False)` zeroed, index 0
    spared), entry [0, 0] (CLS -> CLS) is never discarded when `keep_first`. The rule:
    k = min(floor(N² · p/q), N² - 1) weights go, p/q being the ratio as the fraction it names (the nearest one with
    q <= 2^16: 0.9 = 9/10, so float rounding never moves k). At least one weight (the largest) is always kept:
    a ratio within about 2^-17 of 1 names 1/1 (0.9999999999999999 does), where floor(N² · 1/1) would drop all;
    it keeps only the largest, as the reference's float count int(N² · ratio) < N² does. The threshold is the
    smallest of the N² - k kept weights, found with topk rather than a full sort (10x faster at N = 197) and with
    integer size arithmetic, so N can stay symbolic in an exported graph; the clamp is decided on the ratio alone
    (a Python constant).
    Ties at the threshold are all kept.
    """
    if not 0.0 <= discard_ratio < 1.0:
        raise ValueError(f"discard_ratio must be in [0, 1), got {discard_ratio}")
    if discard_ratio == 0.0:
        return a
    b = a.shape[0]
    flat = a.reshape(b, -1)
    ratio = Fraction(discard_ratio).limit_denominator(1 << 16)
    count = flat.shape[-1]
    # p/q < 1 gives floor(count · p/q) <= count - 1 by itself; only a ratio that rounds to 1/1 needs the clamp.
    keep = 1 if ratio == 1 else count - count * ratio.numerator // ratio.denominator
    threshold = flat.topk(keep, dim=-1).values.amin(dim=-1, keepdim=True)  # the smallest kept weight
    drop = flat < threshold
    if keep_first:
        drop = drop & (torch.arange(flat.shape[-1], device=flat.device) != 0)
    return torch.where(drop, torch.zeros_like(flat), flat).reshape(a.shape)


def rollout_matrix(attentions: Sequence[torch.Tensor], head_fusion: str = "mean", discard_ratio: float = 0.0,
                   keep_first: bool = True) -> torch.Tensor:
    """Attention rollout: R = Â_L ... Â_1 with Â = rownorm(fuse(A) + I) (Abnar & Zuidema 2020, Eq. in §3).

    Per layer: fuse heads, optionally discard the weakest weights, add the identity for the residual path,
    re-normalise each row (keeping the row dimension, so that every row sums to 1; the popular vit-explain
    script divides by a broadcast column sum instead), and multiply onto the running product.

    attentions: L tensors [B, heads, N, N] (softmax probabilities). Returns R [B, N, N], rows summing to 1.
    """
    if not attentions:
        raise ValueError("rollout needs at least one layer of attention")
    first = attentions[0]
    eye = torch.eye(first.shape[-1], dtype=first.dtype, device=first.device).expand_as(first[:, 0])
    result = eye
    for attn in attentions:
        a = discard_lowest(fuse_heads(attn, head_fusion), discard_ratio, keep_first) + eye
        a = a / a.sum(dim=-1, keepdim=True)
        result = a @ result
    return result


def grad_rollout_matrix(attentions: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Gradient-weighted rollout, Chefer et al. 2021 ("Generic Attention-model Explainability", Eq. 5-6).

    R <- R + mean_h((dy_c/dA ⊙ A)^+) R, starting from R = I; the positive part is taken per head before the
    mean, as in the paper and its reference code. attentions, grads: L tensors [B, heads, N, N] -> [B, N, N].
    """
    first = attentions[0]
    result = torch.eye(first.shape[-1], dtype=first.dtype, device=first.device).expand_as(first[:, 0])
    for attn, grad in zip(attentions, grads, strict=True):
        cam = (grad * attn).clamp(min=0).mean(dim=1)
        result = result + cam @ result
    return result


@dataclass(frozen=True)
class Heatmap:
    """A relevance map over the patch grid: `map` [B, gh, gw], and which rows of the rollout it comes from."""

    map: torch.Tensor
    # "cls": the [class] token's row; "patch-mean": the mean of the patch rows (GAP models); "map-probe": the MAP
    # head's probe row (SigLIP) times the encoder's rollout
    query: str


QUERIES = {"token": "cls", "gap": "patch-mean", "map": "map-probe"}


def split_probe(attentions: Sequence[torch.Tensor], pool: str = "token"
                ) -> tuple[Sequence[torch.Tensor], torch.Tensor | None]:
    """A forward pass's attentions -> (the encoder's L tensors [B, heads, N, N], the MAP probe [B, heads, 1, N]).

    `VisionTransformer.forward(x, return_attention=True)` of a pool == "map" model returns the attention pool's
    probe as one extra last entry; other models have none (None)."""
    if pool != "map":
        return attentions, None
    if len(attentions) < 2:
        raise ValueError("a MAP model's rollout needs the encoder's attentions and the pool's probe (last)")
    return attentions[:-1], attentions[-1]


def probe_query(probe: torch.Tensor, head_fusion: str = "mean") -> torch.Tensor:
    """The MAP probe's attention [B, heads, 1, N] -> its fused row [B, N], renormalised to sum to 1.

    The probe is the query (as the [class] row is for token-pooled models): it is neither discarded nor given an
    identity (no residual path runs from the tokens into the pooled vector)."""
    q = fuse_heads(probe, head_fusion)[:, 0]
    return q / q.sum(dim=-1, keepdim=True)


def rollout_to_map(result: torch.Tensor, grid: tuple[int, int], num_prefix_tokens: int = 1,
                   pool: str = "token", probe: torch.Tensor | None = None) -> Heatmap:
    """[B, N, N] rollout -> Heatmap [B, gh, gw] over the patch tokens (prefix tokens: in the graph, not the map).

    Token-pooled models read the [class] token's row (DeiT too: its [dist] token and any registers are rows and
    columns of the graph, cut from the map); GAP models (whose output is the mean of the patch tokens) average the
    patch rows; MAP models (SigLIP) read `probe` [B, N] (`probe_query`) times the rollout: probe -> tokens -> ...
    -> patches. The Heatmap says which.
    """
    p = num_prefix_tokens
    if pool == "token":
        row = result[:, 0, p:]
    elif pool == "map":
        if probe is None:
            raise ValueError("a MAP model's map needs the pool's probe attention")
        row = (probe[:, None, :] @ result)[:, 0, p:]
    else:
        row = result[:, p:, p:].mean(dim=1)
    return Heatmap(row.reshape(result.shape[0], grid[0], grid[1]), QUERIES.get(pool, "patch-mean"))


def rollout(attentions: Sequence[torch.Tensor], grid: tuple[int, int], num_prefix_tokens: int = 1,
            pool: str = "token", head_fusion: str = "mean", discard_ratio: float = 0.0) -> Heatmap:
    """Attention rollout of one forward pass as a map over the (possibly non-square) patch grid.

    attentions: as `VisionTransformer.forward(x, return_attention=True)` gives them: L tensors [B, heads, N, N],
    and for pool == "map" the probe [B, heads, 1, N] last. N counts every token (num_prefix_tokens = [class] +
    [dist] + registers, first); the map [B, gh, gw] covers the patches only."""
    encoder, probe = split_probe(attentions, pool)
    result = rollout_matrix(encoder, head_fusion, discard_ratio, keep_first=num_prefix_tokens > 0)
    query = probe_query(probe, head_fusion) if probe is not None else None
    return rollout_to_map(result, grid, num_prefix_tokens, pool, query)


def grad_rollout(model: torch.nn.Module, x: torch.Tensor, target: int | torch.Tensor | None = None) -> Heatmap:
    """Gradient-weighted rollout of `model` on images x [B, C, H, W] for class `target` (default: top-1).

    Every family: the prefix tokens are in the graph, the map covers the patches. MAP models (SigLIP): the probe's
    gradient-weighted attention mean_h((dy_c/dP ⊙ P)^+) [B, N] (P the probe [B, heads, 1, N]; Chefer et al.'s
    rule for a query that attends into the tokens) times the encoder's relevance R."""
    with torch.enable_grad():
        x = x.detach()
        logits, attentions = model(x, return_attention=True)
        if target is None:
            target = logits.argmax(dim=-1)
        target = torch.as_tensor(target, device=logits.device).reshape(-1).expand(logits.shape[0])
        score = logits.gather(1, target[:, None]).sum()
        grads = torch.autograd.grad(score, attentions)
    pool = model.cfg.pool
    encoder, probe = split_probe([a.detach() for a in attentions], pool)
    enc_grads, probe_grad = split_probe(grads, pool)
    result = grad_rollout_matrix(encoder, enc_grads)
    query = None
    if probe is not None:
        query = (probe_grad * probe).clamp(min=0).mean(dim=1)[:, 0]
    grid = (x.shape[-2] // model.cfg.patch_size, x.shape[-1] // model.cfg.patch_size)
    return rollout_to_map(result, grid, model.num_prefix_tokens, pool, query)


def patch_positions(grid: tuple[int, int], patch_size: int) -> torch.Tensor:
    """Pixel coordinates (y, x) of each patch centre, row-major: [gh * gw, 2]."""
    ys, xs = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing="ij")
    return (torch.stack([ys, xs], dim=-1).reshape(-1, 2).to(torch.float64) + 0.5) * patch_size


def mean_attention_distance(attentions: Sequence[torch.Tensor], grid: tuple[int, int], patch_size: int,
                            num_prefix_tokens: int = 1) -> torch.Tensor:
    """Mean attention distance in pixels per layer and head (the ViT paper's Figure 7 right, App. D.7).

    For each query patch i: sum_j A[i, j] * ||p_i - p_j||, with prefix tokens removed and the rows
    renormalised over patches; averaged over query patches and images.

    attentions: L tensors [B, heads, N, N]. Returns [L, heads] (float64).
    """
    pos = patch_positions(grid, patch_size)
    dist = torch.cdist(pos, pos)  # [Np, Np]
    p = num_prefix_tokens
    out = []
    for attn in attentions:
        a = attn[:, :, p:, p:].to(torch.float64)
        a = a / a.sum(dim=-1, keepdim=True)
        out.append((a * dist.to(a.device)).sum(dim=-1).mean(dim=(0, 2)))
    return torch.stack(out).cpu()


def pos_embed_similarity(pos_embed: torch.Tensor, grid: tuple[int, int], num_prefix_tokens: int = 1) -> torch.Tensor:
    """Cosine similarity of every patch position's embedding to every other (the paper's Figure 7 centre).

    pos_embed: [1, prefix + gh * gw, D] or [prefix + gh * gw, D]. Returns [gh, gw, gh, gw]: entry [i, j]
    is the (gh, gw) similarity map of position (i, j).
    """
    pe = pos_embed.reshape(-1, pos_embed.shape[-1])[num_prefix_tokens:].to(torch.float64)
    pe = pe / pe.norm(dim=-1, keepdim=True).clamp(min=1e-12)
    sim = pe @ pe.T
    return sim.reshape(grid[0], grid[1], grid[0], grid[1])


def filter_pca(weight: torch.Tensor, k: int = 28) -> tuple[torch.Tensor, torch.Tensor]:
    """Principal components of the patch-embedding filters (the paper's Figure 7 left: the top 28).

    weight: [D, C, P, P] (the conv form of E). Filters are centred over D, then decomposed by SVD.
    Returns (components [k, C, P, P], explained-variance ratio [k]); each component's sign is fixed so
    that its largest-magnitude entry is positive.
    """
    d = weight.shape[0]
    x = weight.detach().reshape(d, -1).to(torch.float64)
    x = x - x.mean(dim=0, keepdim=True)
    _, s, vt = torch.linalg.svd(x, full_matrices=False)
    k = min(k, vt.shape[0])
    comps = vt[:k]
    idx = comps.abs().argmax(dim=1)
    comps = comps * comps.gather(1, idx[:, None]).sign()
    var = s**2
    return comps.reshape(k, *weight.shape[1:]), (var / var.sum())[:k]
