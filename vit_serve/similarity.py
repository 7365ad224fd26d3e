"""Why did this match: an image embedding's cosine similarity to a query, split over the image's patches; and the
patch tokens of any block (dense features).

Shapes: x [B, C, H, W]; query [E] or [B, E] (a text embedding, another image's embedding, a zero-shot head's
label row: any vector of the joint space, normalised here); the map [B, gh, gw]; cosine and rest [B], with
map.sum((1, 2)) + rest == cosine, the cosine of the image's embedding e (`forward_embedding`) and the query.

The method: e = proj(pool(tokens)) is split into per-token contributions c_j with e = sum_j c_j + r, where the
pooling is linear, and each patch's share of the cosine is s_j = <proj(c_j), q / |q|> / |e|.

- GAP (mean pooling): exact. tokens t_j after the final norm, c_j = t_j / N over the N patches; an fc_norm
  LayerNorm on the pooled vector is linear once its scale 1 / sigma(pooled) is fixed (its mean is linear), so the
  split stays exact; r holds the biases (projection, fc_norm's beta).
- [class] token (CLIP, DeiT: the mean of [class] and [dist]): the last block's attention-weighted value
  contributions to the pooled row (the direct path of the last attention, as in Gandelsman et al. 2024,
  "Interpreting CLIP's image representation via text-based decomposition"): c_j = ls1(W_o (+)_h A_h[0, j] v_h[j]),
  carried through the final LayerNorm linearised at the pooled row's own sigma (its centring is linear) and the
  projection without its bias. r holds the rest: the residual stream before the last attention, the last MLP, the
  prefix tokens' own values and the biases.
- Attention pool (MAP, SigLIP): the probe's value contributions c_j = W_o (+)_h P_h[j] v_h[j] over the tokens
  after the final norm; r holds the pool's MLP branch and the biases.

Models whose pooled path is not linear in these contributions are refused (ValueError): a tanh pre-logits layer,
a LayerNorm on the heads' output (EVA-CLIP's attn_norm), token merging. Only torch is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from vit_serve.model import VisionTransformer


@dataclass(frozen=True)
class SimilarityMap:
    """Per-patch shares of the cosine: `map` [B, gh, gw], `cosine` [B] and the share of everything else `rest`
    [B] (map.sum((1, 2)) + rest == cosine), and what was decomposed (`method`)."""

    map: torch.Tensor
    cosine: torch.Tensor
    rest: torch.Tensor
    method: str


METHODS = {"gap": "mean-pool (exact)", "token": "last-attention values to [class]", "map": "attention-pool values"}


def _linear_norm(norm: nn.Module, c: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """A norm applied to `ref` [B, D], as the linear map it is on `ref`'s summands c [B, ..., D]: the centring and
    gamma, at ref's own sigma (no beta: it is a constant, in the rest)."""
    if isinstance(norm, nn.Identity):
        return c
    if not isinstance(norm, nn.LayerNorm):
        raise ValueError(f"a similarity map needs a LayerNorm or no norm on the pooled path, not {type(norm).__name__}")
    sigma = (ref.var(dim=-1, unbiased=False) + norm.eps).sqrt()
    shape = (sigma.shape[0],) + (1,) * (c.dim() - 2) + (1,)
    c = (c - c.mean(dim=-1, keepdim=True)) / sigma.reshape(shape)
    return c * norm.weight if norm.weight is not None else c


def _through_embed(model: VisionTransformer, c: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
    """Contributions c [B, N, D] to the pooled vector `pooled` [B, D] -> their part of the embedding [B, N, E]
    (fc_norm linearised at `pooled`, the projection without its bias)."""
    if not isinstance(model.pre_logits, nn.Identity):
        raise ValueError("a similarity map needs a linear path from the pooled tokens to the embedding; this model "
                         "has a tanh pre-logits layer")
    c = _linear_norm(model.fc_norm, c, pooled)
    return c if model.proj is None else c @ model.proj.weight.T


def _values(attn: nn.Module, n: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """One attention's value contributions to its query rows: n [B, N, D] (its input), probs [B, heads, Q, N] ->
    [B, Q, N, D]: W_o (+)_h probs_h[q, j] v_h[j] (without the output bias)."""
    if hasattr(attn, "_qkv") and not isinstance(attn.norm, nn.Identity):
        raise ValueError("a similarity map needs a linear path from the attention's values to its output; this "
                         "model has a LayerNorm on the heads' output")
    b, t, d = n.shape
    heads = probs.shape[1]
    if hasattr(attn, "_qkv"):
        v = attn._qkv(n).reshape(b, t, 3, heads, d // heads)[:, :, 2]
    else:  # the attention pool: keys and values from one layer
        v = attn.kv(n).reshape(b, t, 2, heads, d // heads)[:, :, 1]
    per = torch.einsum("bhqj,bjhc->bqjhc", probs, v).reshape(b, probs.shape[2], t, d)
    return per @ attn.proj.weight.T


def _last_block(model: VisionTransformer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward pass, keeping the last block's input: (its norm1 output n [B, T, D], its attention [B, heads,
    T, T], its output [B, T, D], before the final norm)."""
    ropes = model.rope_tables(x)
    h = model.forward_stem(x)
    for blk, rope in zip(model.blocks[:-1], ropes[:-1], strict=True):
        h = blk(h, False, None, rope)[0]
    last = model.blocks[-1]
    n = last.norm1(h)
    y, probs, _ = last.attn(n, True, None, rope=ropes[-1])
    h = h + last.ls1(y)
    return n, probs, h + last.ls2(last.mlp(last.norm2(h)))


def _contributions(model: VisionTransformer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each patch token's part of the embedding [B, Np, E], the embedding [B, E])."""
    if model.token_merging is not None:
        raise ValueError("a similarity map follows each patch to the embedding; serve the model without --tome")
    p, pool = model.num_prefix_tokens, model.cfg.pool
    n, probs, out = _last_block(model, x)
    tokens = model.norm(out)
    if pool == "gap":
        pooled = tokens[:, p:].mean(dim=1)
        c = tokens[:, p:] / (tokens.shape[1] - p)
    elif pool == "map":
        ap = model.attn_pool
        pooled, probe = ap(tokens, True)
        c = _values(ap, tokens, probe)[:, 0, p:]
    else:
        rows = [0, 1] if model.cfg.dist_token else [0]
        last = model.blocks[-1]
        per = last.ls1(_values(last.attn, n, probs[:, :, rows]))[:, :, p:]  # [B, rows, Np, D]
        c = sum(_linear_norm(model.norm, per[:, i], out[:, r]) for i, r in enumerate(rows)) / len(rows)
        pooled = tokens[:, rows].mean(dim=1)
    return _through_embed(model, c, pooled), model.embed(pooled)


def similarity_map(model: VisionTransformer, x: torch.Tensor, query: torch.Tensor) -> SimilarityMap:
    """The cosine of each image's embedding with `query` [E] or [B, E], split over its patches (module doc)."""
    p = model.cfg.patch_size
    grid = (x.shape[-2] // p, x.shape[-1] // p)
    parts, e = _contributions(model, x)
    parts, e = parts.float(), e.float()
    q = F.normalize(query.to(e).reshape(-1, e.shape[-1]), dim=-1).expand_as(e)
    norm = e.norm(dim=-1, keepdim=True).clamp(min=1e-12)
    shares = (parts @ q[:, :, None])[..., 0] / norm
    cosine = (e * q).sum(dim=-1) / norm[:, 0]
    return SimilarityMap(shares.reshape(x.shape[0], *grid), cosine, cosine - shares.sum(dim=-1),
                         METHODS.get(model.cfg.pool, METHODS["gap"]))


def patch_tokens(model: VisionTransformer, x: torch.Tensor, layer: int = -1) -> torch.Tensor:
    """The patch tokens [B, gh * gw, D] that block `layer` outputs (0-based; negative from the end, -1: the last),
    before the final norm: timm's `forward_intermediates(x, indices=[layer], norm=False)`, prefix tokens cut."""
    depth = len(model.blocks)
    if not -depth <= layer < depth:
        raise ValueError(f"layer must be from {-depth} to {depth - 1} (the model has {depth} blocks), got {layer}")
    if model.token_merging is not None:
        raise ValueError("patch tokens: token merging leaves fewer tokens than patches; serve the model without "
                         "--tome")
    stop = layer % depth
    ropes = model.rope_tables(x)
    h = model.forward_stem(x)
    for blk, rope in zip(model.blocks[:stop + 1], ropes[:stop + 1], strict=True):
        h = blk(h, False, None, rope)[0]
    return h[:, model.num_prefix_tokens:]
