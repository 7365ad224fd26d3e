"""The CLIP-style text transformer (architecture only): CLIP's causal one and SigLIP's bidirectional one.

    x = token_embedding(ids) + positional_embedding                       [K, L, W]
    x = blocks(x)   pre-LN blocks, causal mask (CLIP) or none (SigLIP)
    t = ln_final(x) pooled at the end-of-text token (CLIP: argmax of the ids, open_clip; first eos id, HF)
        or the last position (SigLIP)                                     [K, W]
    e = proj(t)     text_projection, with a bias for SigLIP               [K, E]

References: open_clip.transformer.TextTransformer / CLIP.encode_text, transformers CLIPTextModel +
CLIPModel.text_projection, SiglipTextModel (its `head`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from vit_serve.config import GELUS, check_fields
from vit_serve.model import LayerScale, Mlp

POOLINGS = ("argmax", "eos", "last")


@dataclass(frozen=True)
class TextConfig:
    """Architecture of a text tower. `pool`: "argmax" (open_clip CLIP: the highest id is end-of-text),
    "eos" (the first `eos_id`, HF CLIP), "last" (SigLIP). `proj_dim` None: no projection."""

    vocab_size: int = 49408
    context_length: int = 77
    width: int = 512
    heads: int = 8
    layers: int = 12
    mlp_dim: int = 2048
    proj_dim: int | None = 512
    proj_bias: bool = False
    causal: bool = True
    pool: str = "argmax"
    eos_id: int | None = None
    gelu: str = "exact"
    layer_norm_eps: float = 1e-5
    init_values: float | None = None

    def __post_init__(self) -> None:
        if self.pool not in POOLINGS:
            raise ValueError(f"text pool={self.pool!r}; expected one of {', '.join(POOLINGS)}")
        if self.gelu not in GELUS:
            raise ValueError(f"text gelu={self.gelu!r}; expected one of {', '.join(GELUS)}")
        if self.pool == "eos" and self.eos_id is None:
            raise ValueError("text pool='eos' needs eos_id")
        if self.width % self.heads:
            raise ValueError(f"text width {self.width} is not divisible by heads {self.heads}")

    @property
    def embed_dim(self) -> int:
        return self.proj_dim or self.width

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TextConfig:
        check_fields(cls, d, "TextConfig fields")
        return cls(**d)


class TextAttention(nn.Module):
    """Multi-head self-attention with an optional additive mask (open_clip's nn.MultiheadAttention layout)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """[K, L, W] (mask [L, L] additive, or None) -> [K, L, W]."""
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, N, C))


class TextBlock(nn.Module):
    """Pre-LN block: x + ls1(attn(norm1(x))), then x + ls2(mlp(norm2(x)))."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        d = cfg.width
        self.norm1 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.attn = TextAttention(d, cfg.heads)
        self.norm2 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.mlp = Mlp(d, cfg.mlp_dim, cfg.gelu)
        self.ls1 = LayerScale(d, cfg.init_values) if cfg.init_values is not None else nn.Identity()
        self.ls2 = LayerScale(d, cfg.init_values) if cfg.init_values is not None else nn.Identity()

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.ls1(self.attn(self.norm1(x), mask))
        return x + self.ls2(self.mlp(self.norm2(x)))


class TextTransformer(nn.Module):
    """Token ids [K, L] (L = context_length) -> unnormalised text embeddings [K, E]."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.width)
        self.positional_embedding = nn.Parameter(torch.zeros(cfg.context_length, cfg.width))
        self.blocks = nn.ModuleList([TextBlock(cfg) for _ in range(cfg.layers)])
        self.ln_final = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)
        self.proj = nn.Linear(cfg.width, cfg.proj_dim, bias=cfg.proj_bias) if cfg.proj_dim else None
        mask = torch.full((cfg.context_length, cfg.context_length), float("-inf")).triu_(1)
        self.register_buffer("attn_mask", mask if cfg.causal else None, persistent=False)

    def pool(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Tokens [K, L, W] -> [K, W] at the end-of-text position (per `cfg.pool`)."""
        if self.cfg.pool == "last":
            return x[:, -1]
        eos = ids == self.cfg.eos_id if self.cfg.pool == "eos" else None
        idx = ids.argmax(dim=-1) if eos is None else eos.int().argmax(dim=-1)
        return x[torch.arange(x.shape[0], device=x.device), idx]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [K, L] int64 -> embeddings [K, E] (not L2-normalised)."""
        n = ids.shape[1]
        x = self.token_embedding(ids) + self.positional_embedding[:n]
        mask = self.attn_mask[:n, :n] if self.attn_mask is not None else None
        for blk in self.blocks:
            x = blk(x, mask)
        x = self.pool(self.ln_final(x), ids)
        return self.proj(x) if self.proj is not None else x
