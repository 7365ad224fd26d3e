"""Token merging (ToMe, "Token Merging: Your ViT But Faster", Bolya et al., ICLR 2023): pure functions.

Between the attention and the MLP of a block, `r` tokens are merged into others by bipartite soft matching:

    a, b = tokens[0::2], tokens[1::2]                 alternate tokens, by the keys averaged over heads
    s_ij = cos(k_a_i, k_b_j)                          each a-token's most similar b-token and its score
    the r a-tokens with the highest scores merge into their b-token: x = sum(size * x) / sum(size)
    sizes add; with proportional attention, attention logits get + log(size) (a merged token counts for
    the patches it holds); the merge "sources" (which input tokens each token holds) compose over layers.

This reproduces the reference implementation (facebookresearch/ToMe: `tome/merge.py`, `tome/patch/timm.py`):
the same split, scores, order of edges and output order, so that a model with ToMe gives the reference's
numbers. One generalisation: the reference protects a class token and a distillation token; here the first
`protected` tokens of any count (class, distillation and register tokens) are never merged and keep their
places at the front.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from vit_serve.tome_schedule import TomeR, fewest_patches, merged_count, parse_r, parse_tome, tokens_after

__all__ = ["TomeR", "fewest_patches", "merged_count", "parse_r", "parse_tome", "tokens_after"]


def protected_split(protected: int) -> tuple[int, int]:
    """How many of the leading `protected` tokens fall among the a-tokens (even indices) and the b-tokens (odd)."""
    return (protected + 1) // 2, protected // 2


@dataclass(frozen=True)
class Matching:
    """One bipartite soft matching of a [B, T, C] token set (`bipartite_soft_matching`): which a-tokens stay
    (unm_idx [B, Ta - r, 1]), which merge (src_idx [B, r, 1]) and into which b-token (dst_idx [B, r, 1]);
    `protected` leading tokens stay first in their order."""

    unm_idx: torch.Tensor
    src_idx: torch.Tensor
    dst_idx: torch.Tensor
    r: int
    protected: int

    def merge(self, x: torch.Tensor, mode: str = "mean") -> torch.Tensor:
        """x [B, T, C] -> [B, T - r, C]: the merged a-tokens reduced into their b-tokens (`mode`: torch's
        scatter_reduce "sum", "mean", "amax"), then [protected tokens in order, other kept a-tokens, b-tokens]."""
        src, dst = x[..., ::2, :], x[..., 1::2, :]
        n, t1, c = src.shape
        unm = src.gather(dim=-2, index=self.unm_idx.expand(n, t1 - self.r, c))
        src = src.gather(dim=-2, index=self.src_idx.expand(n, self.r, c))
        dst = dst.scatter_reduce(-2, self.dst_idx.expand(n, self.r, c), src, reduce=mode)
        pa, pb = protected_split(self.protected)
        front = [t[:, i:i + 1] for i in range(pa) for t in ((unm, dst) if i < pb else (unm,))]
        return torch.cat([*front, unm[:, pa:], dst[:, pb:]], dim=1)


def bipartite_soft_matching(metric: torch.Tensor, r: int, protected: int = 0) -> Matching | None:
    """metric [B, T, C] (the keys, averaged over heads) -> the matching that merges r tokens (None when r
    is 0 after the cap at half the unprotected tokens). The first `protected` tokens are never merged
    and nothing merges into them. Ties break as torch's argsort does, as in the reference."""
    t = metric.shape[1]
    r = merged_count(t, r, protected)
    if r <= 0:
        return None
    with torch.no_grad():
        metric = metric / metric.norm(dim=-1, keepdim=True)
        a, b = metric[..., ::2, :], metric[..., 1::2, :]
        scores = a @ b.transpose(-1, -2)
        pa, pb = protected_split(protected)
        if protected:  # a mask, not an in-place slice assignment: OpenVINO misreads the ScatterND that exports
            rows = torch.arange(scores.shape[-2], device=scores.device)[:, None] < pa
            cols = torch.arange(scores.shape[-1], device=scores.device)[None, :] < pb
            scores = scores.masked_fill(rows | cols, -math.inf)
        node_max, node_idx = scores.max(dim=-1)
        edge_idx = node_max.argsort(dim=-1, descending=True)[..., None]
        unm_idx = edge_idx[..., r:, :]
        src_idx = edge_idx[..., :r, :]
        dst_idx = node_idx[..., None].gather(dim=-2, index=src_idx)
        if protected:  # the protected a-tokens (scores -inf) are last among the kept: sort them to the front
            unm_idx = unm_idx.sort(dim=1)[0]
    return Matching(unm_idx, src_idx, dst_idx, r, protected)


def merge_wavg(m: Matching, x: torch.Tensor, size: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, T, C], size [B, T, 1] (None: ones) -> the size-weighted average of each merged group [B, T - r, C]
    and the groups' sizes [B, T - r, 1] (the reference's merge_wavg)."""
    if size is None:
        size = torch.ones_like(x[..., 0, None])
    x = m.merge(x * size, mode="sum")
    size = m.merge(size, mode="sum")
    return x / size, size


def merge_source(m: Matching, x: torch.Tensor, source: torch.Tensor | None) -> torch.Tensor:
    """Which input tokens each token holds: source [B, T, N0] (None: the identity over x's T tokens) ->
    [B, T - r, N0], 1 where the token holds input token j (the reference's merge_source)."""
    if source is None:
        n, t, _ = x.shape
        source = torch.eye(t, device=x.device, dtype=x.dtype)[None].expand(n, t, t)
    return m.merge(source, mode="amax")


def size_bias(size: torch.Tensor | None) -> torch.Tensor | None:
    """Proportional attention: sizes [B, T, 1] -> the additive attention bias log(size) [B, 1, 1, T]."""
    return None if size is None else size.log()[:, None, None, :, 0]


@dataclass(frozen=True)
class TokenMerging:
    """A model's token-merging setting (`VisionTransformer.set_token_merging`): r per layer, proportional
    attention (the reference's `prop_attn`: on for models trained without ToMe), and whether to keep the merge
    sources of the last forward (`trace_source`, for visualisations)."""

    r: tuple[int, ...]
    prop_attn: bool = True
    trace_source: bool = False

    def start(self, protected: int, record: bool = False) -> MergeState:
        """The state one forward pass carries through the blocks (`record`: keep every layer's `LayerMerge`)."""
        return MergeState(list(self.r), protected, self.prop_attn, self.trace_source, record=record)


@dataclass(frozen=True)
class LayerMerge:
    """One layer's merge as a forward pass recorded it: the matching (None: the layer merged nothing) and the
    tokens' sizes [B, T_l, 1] before it (None: all 1, no merge yet). What attention rollout needs to follow the
    tokens through the merges (`vit_serve.explain.rollout_matrix`)."""

    matching: Matching | None
    size: torch.Tensor | None


@dataclass
class MergeState:
    """What one forward pass with token merging carries from block to block: r per layer still to come, the
    tokens' sizes [B, T, 1] and sources [B, T, N0] (when traced), and with `record` one `LayerMerge` per block
    in `merges`."""

    schedule: list[int]
    protected: int
    prop_attn: bool
    trace_source: bool
    size: torch.Tensor | None = None
    source: torch.Tensor | None = None
    layer: int = 0
    record: bool = False
    merges: list[LayerMerge] = field(default_factory=list)

    def next_r(self) -> int:
        """r of the next block (0 past the schedule)."""
        r = self.schedule[self.layer] if self.layer < len(self.schedule) else 0
        self.layer += 1
        return r

    def merge(self, x: torch.Tensor, keys: torch.Tensor | None, r: int) -> torch.Tensor:
        """x [B, T, D] -> [B, T - r', D], merged by the similarity of `keys` [B, T, C] (r = 0: x itself; keys
        may be None)."""
        m = bipartite_soft_matching(keys, r, self.protected) if r > 0 else None
        if self.record:
            self.merges.append(LayerMerge(m, self.size))
        if m is None:
            return x
        if self.trace_source:
            self.source = merge_source(m, x, self.source)
        x, self.size = merge_wavg(m, x, self.size)
        return x
