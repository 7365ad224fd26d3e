"""What a ViT attends to and what it learned: pure functions on attention probabilities and weights.

Attention rollout (Abnar & Zuidema, 2020) and gradient-weighted rollout (Chefer et al., 2021) for
`GET /explain`, the exported explain graph and `vit-serve inspect`; and the inspections of the ViT paper's
§4.5 (Figure 7): principal components of the patch-embedding filters, position-embedding similarity and
mean attention distance. Only torch is needed. Every tensor op in `rollout` has an ONNX counterpart, so the
same code runs inside an exported graph (with dynamic resolution, too: no shape becomes a Python number).

With token merging (ToMe, `vit_serve.tome`) the tokens shrink from layer to layer; the rollout follows them
through the merges the forward pass records (`VisionTransformer.forward_explain`), so that its rows stay over
the input tokens. `explain_forward` is the one place that runs a model for its rollout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

import torch

from vit_serve.rollout_options import DEFAULT_DISCARD_RATIO, DEFAULT_HEAD_FUSION, HEAD_FUSIONS
from vit_serve.tome import LayerMerge, merge_wavg

if TYPE_CHECKING:
    from vit_serve.model import VisionTransformer



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


def _compose(attentions: Sequence[torch.Tensor], merges: Sequence[LayerMerge] | None,
             step: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """R_0 = I over the N_0 input tokens; per layer l, R = step(R, A_l, l) ([B, T_l, N_0]), then, where layer l
    merged, each merged group's rows replaced by their size-weighted average (`merge_wavg` with the sizes before
    the merge, exactly as the layer merged its tokens). Returns R [B, T_L, N_0]."""
    if merges and len(merges) != len(attentions):
        raise ValueError(f"{len(merges)} recorded merges for {len(attentions)} layers of attention")
    first = attentions[0]
    result = torch.eye(first.shape[-1], dtype=first.dtype, device=first.device).expand_as(first[:, 0])
    for layer, attn in enumerate(attentions):
        result = step(result, attn, layer)
        merge = merges[layer] if merges else None
        if merge is not None and merge.matching is not None:
            size = None if merge.size is None else merge.size.to(result.dtype)
            result = merge_wavg(merge.matching, result, size)[0]
    return result


def rollout_matrix(attentions: Sequence[torch.Tensor], head_fusion: str = "mean", discard_ratio: float = 0.0,
                   keep_first: bool = True, merges: Sequence[LayerMerge] | None = None) -> torch.Tensor:
    """Attention rollout: R = Â_L ... Â_1 with Â = rownorm(fuse(A) + I) (Abnar & Zuidema 2020, Eq. in §3).

    Per layer: fuse heads, optionally discard the weakest weights, add the identity for the residual path,
    re-normalise each row (keeping the row dimension, so that every row sums to 1; the popular vit-explain
    script divides by a broadcast column sum instead), and multiply onto the running product.

    attentions: L tensors [B, heads, N, N] (softmax probabilities). Returns R [B, N, N], rows summing to 1.

    Through token merges (`merges`: one `LayerMerge` per layer, `VisionTransformer.forward_explain`; None or
    []: none), layer l's attention is [B, heads, T_l, T_l] over the tokens entering it, and R stays over the N_0
    input tokens: R_0 = I_{N_0}; R = Â_l R ([B, T_l, N_0], Â_l with I_{T_l}); where layer l merged, the rows of
    each merged group become their size-weighted average (ToMe's merge_wavg of the tokens themselves, Bolya et
    al. 2023 §3, with the sizes before the merge), so rows still sum to 1. Returns R [B, T_L, N_0] (T_L: the
    tokens after the last merge). Without merges the numbers are exactly those of the plain rollout.
    """
    if not attentions:
        raise ValueError("rollout needs at least one layer of attention")

    def step(result: torch.Tensor, attn: torch.Tensor, layer: int) -> torch.Tensor:
        eye = torch.eye(attn.shape[-1], dtype=attn.dtype, device=attn.device).expand_as(attn[:, 0])
        a = discard_lowest(fuse_heads(attn, head_fusion), discard_ratio, keep_first) + eye
        a = a / a.sum(dim=-1, keepdim=True)
        return a @ result

    return _compose(attentions, merges, step)


def grad_rollout_matrix(attentions: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                        merges: Sequence[LayerMerge] | None = None) -> torch.Tensor:
    """Gradient-weighted rollout, Chefer et al. 2021 ("Generic Attention-model Explainability", Eq. 5-6).

    R <- R + mean_h((dy_c/dA ⊙ A)^+) R, starting from R = I; the positive part is taken per head before the
    mean, as in the paper and its reference code. attentions, grads: L tensors [B, heads, N, N] -> [B, N, N].
    Through token merges, the same composition as `rollout_matrix`'s: [B, T_l, N_0] per layer, the merged
    groups' rows averaged by size; -> [B, T_L, N_0].
    """
    if len(grads) != len(attentions):
        raise ValueError(f"{len(grads)} gradients for {len(attentions)} layers of attention")

    def step(result: torch.Tensor, attn: torch.Tensor, layer: int) -> torch.Tensor:
        cam = (grads[layer] * attn).clamp(min=0).mean(dim=1)
        return result + cam @ result

    return _compose(attentions, merges, step)


def final_sizes(attentions: Sequence[torch.Tensor], merges: Sequence[LayerMerge] | None) -> torch.Tensor | None:
    """The tokens' sizes after the last merge [B, T_L, 1] (None: nothing merged): the last merging layer's sizes
    before it (1 each before any merge), summed over its groups as `merge_wavg` sums them.

    attentions: the encoder's L tensors [B, heads, T_l, T_l] (for the shape of the first merge's ones)."""
    for attn, merge in reversed(list(zip(attentions, merges or (), strict=False))):
        if merge.matching is not None:
            size = merge.size if merge.size is not None else torch.ones_like(attn[:, 0, :, :1])
            return merge.matching.merge(size, mode="sum")
    return None


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
                   pool: str = "token", probe: torch.Tensor | None = None, size: torch.Tensor | None = None
                   ) -> Heatmap:
    """[B, N, N] rollout -> Heatmap [B, gh, gw] over the patch tokens (prefix tokens: in the graph, not the map).

    Token-pooled models read the [class] token's row (DeiT too: its [dist] token and any registers are rows and
    columns of the graph, cut from the map); GAP models (whose output is the mean of the patch tokens) average the
    patch rows; MAP models (SigLIP) read `probe` [B, N] (`probe_query`) times the rollout: probe -> tokens -> ...
    -> patches. The Heatmap says which.

    After token merges, result is [B, T_L, N_0] (rows: the final tokens; columns: the input tokens), probe
    [B, T_L], and `size` [B, T_L, 1] the final tokens' sizes: GAP models then weight the patch rows by size, the
    mean over the original patches, as their pool does.
    """
    p = num_prefix_tokens
    if pool == "token":
        row = result[:, 0, p:]
    elif pool == "map":
        if probe is None:
            raise ValueError("a MAP model's map needs the pool's probe attention")
        row = (probe[:, None, :] @ result)[:, 0, p:]
    elif size is not None:
        w = size[:, p:].to(result.dtype)
        row = (result[:, p:, p:] * w).sum(dim=1) / w.sum(dim=1)
    else:
        row = result[:, p:, p:].mean(dim=1)
    return Heatmap(row.reshape(result.shape[0], grid[0], grid[1]), QUERIES.get(pool, "patch-mean"))


def rollout(attentions: Sequence[torch.Tensor], grid: tuple[int, int], num_prefix_tokens: int = 1,
            pool: str = "token", head_fusion: str = "mean", discard_ratio: float = 0.0,
            merges: Sequence[LayerMerge] | None = None) -> Heatmap:
    """Attention rollout of one forward pass as a map over the (possibly non-square) patch grid.

    attentions: as `VisionTransformer.forward(x, return_attention=True)` gives them: L tensors [B, heads, N, N],
    and for pool == "map" the probe [B, heads, 1, N] last. N counts every token (num_prefix_tokens = [class] +
    [dist] + registers, first); the map [B, gh, gw] covers the patches only. With token merging: the merges of
    the same pass (`VisionTransformer.forward_explain`), layer l's attention [B, heads, T_l, T_l], the probe
    [B, heads, 1, T_L] (`rollout_matrix` follows the tokens back to the input patches)."""
    encoder, probe = split_probe(attentions, pool)
    result = rollout_matrix(encoder, head_fusion, discard_ratio, keep_first=num_prefix_tokens > 0, merges=merges)
    query = probe_query(probe, head_fusion) if probe is not None else None
    return rollout_to_map(result, grid, num_prefix_tokens, pool, query, final_sizes(encoder, merges))


@dataclass(frozen=True)
class Explanation:
    """One forward pass and its rollout (`explain_forward`): logits [B, K], the Heatmap, and what it came from:
    the attentions (float32; a MAP model's probe last) and the token merges (one `LayerMerge` per layer; [])."""

    logits: torch.Tensor
    heatmap: Heatmap
    attentions: list[torch.Tensor]
    merges: list[LayerMerge]


def explain_forward(model: VisionTransformer, x: torch.Tensor, head_fusion: str = DEFAULT_HEAD_FUSION,
                    discard_ratio: float = DEFAULT_DISCARD_RATIO) -> Explanation:
    """Run `model` on images x [B, C, H, W] with attention, and roll it out (through its token merges, if any)
    into a map over the [B, H/P, W/P] patch grid: `VisionTransformer.forward_explain`, then `rollout` in float32.

    Every explain path (the exported explain graph, the torch backend, `vit-serve inspect`, the export parity
    check) calls this, so the map is computed one way. Traceable by torch.export: shapes stay symbolic and
    nothing is written to the model."""
    logits, attentions, merges = model.forward_explain(x)
    attentions = [a.float() for a in attentions]
    p = model.cfg.patch_size
    grid = (x.shape[-2] // p, x.shape[-1] // p)
    heat = rollout(attentions, grid, model.num_prefix_tokens, model.cfg.pool, head_fusion, discard_ratio, merges)
    return Explanation(logits, heat, attentions, merges)


def explain_patches(model: VisionTransformer, patches: torch.Tensor, spatial_shapes: torch.Tensor,
                    head_fusion: str = DEFAULT_HEAD_FUSION, discard_ratio: float = DEFAULT_DISCARD_RATIO
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """NaFlex inputs (`vit_serve.naflex.unpack`: patches [B, M, P * P * C], spatial_shapes [B, 2]) -> (logits [B, K],
    maps [B, M]: each image's rollout over its own h x w grid, row-major in its first h * w entries, zeros after).

    Each image alone: its real patches put back together as the [1, C, hP, wP] image they were cut from
    (`naflex.image_to_patches` inverted) and explained by `explain_forward`. A NaFlex model's plain forward on that
    image resamples its position grid as `forward_patches` does (resample_mode "naflex"), so this is the same
    pass without padding: the map covers the real patches only, and no image's map depends on the others."""
    p, c = model.cfg.patch_size, model.cfg.in_chans
    logits, maps = [], patches.new_zeros(patches.shape[:2], dtype=torch.float32)
    for i, (h, w) in enumerate(spatial_shapes.tolist()):
        rows = patches[i, :h * w].reshape(h, w, p, p, c)
        image = rows.permute(4, 0, 2, 1, 3).reshape(1, c, h * p, w * p)
        e = explain_forward(model, image, head_fusion, discard_ratio)
        logits.append(e.logits)
        maps[i, :h * w] = e.heatmap.map.flatten().float()
    return torch.cat(logits), maps


def grad_rollout(model: torch.nn.Module, x: torch.Tensor, target: int | torch.Tensor | None = None) -> Heatmap:
    """Gradient-weighted rollout of `model` on images x [B, C, H, W] for class `target` (default: top-1).

    Every family: the prefix tokens are in the graph, the map covers the patches. MAP models (SigLIP): the probe's
    gradient-weighted attention mean_h((dy_c/dP ⊙ P)^+) [B, N] (P the probe [B, heads, 1, N]; Chefer et al.'s
    rule for a query that attends into the tokens) times the encoder's relevance R. With token merging, R follows
    the merges as `rollout_matrix` does (`grad_rollout_matrix`)."""
    with torch.enable_grad():
        x = x.detach()
        logits, attentions, merges = model.forward_explain(x)
        if target is None:
            target = logits.argmax(dim=-1)
        target = torch.as_tensor(target, device=logits.device).reshape(-1).expand(logits.shape[0])
        score = logits.gather(1, target[:, None]).sum()
        grads = torch.autograd.grad(score, attentions)
    pool = model.cfg.pool
    encoder, probe = split_probe([a.detach() for a in attentions], pool)
    enc_grads, probe_grad = split_probe(grads, pool)
    result = grad_rollout_matrix(encoder, enc_grads, merges)
    query = None
    if probe is not None:
        query = (probe_grad * probe).clamp(min=0).mean(dim=1)[:, 0]
    grid = (x.shape[-2] // model.cfg.patch_size, x.shape[-1] // model.cfg.patch_size)
    return rollout_to_map(result, grid, model.num_prefix_tokens, pool, query, final_sizes(encoder, merges))


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
