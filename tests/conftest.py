"""Shared fixtures. Reference models are built from their own libraries with random weights, never downloaded."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0, head_std: float = 0.2) -> torch.nn.Module:
    """Non-trivial random weights so that a wrong mapping cannot hide behind zeros and ones.

    Position embeddings get std 1 (they dominate a wrong resampling), LayerNorm scales N(1, 0.2), biases
    N(0, 0.1), the head std `head_std` (logits O(1-10): a 1e-5 absolute tolerance stays meaningful).
    """
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if "pos_embed" in name or "position_embedding" in name or "pos_embedding" in name:
            p.copy_(torch.randn(p.shape, generator=g))
        elif name.startswith(("head", "classifier", "heads")):
            p.copy_(torch.randn(p.shape, generator=g) * head_std)
        elif p.ndim == 1 and leaf in ("weight", "scale"):
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
        elif leaf == "bias" or p.ndim == 1:
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture
def randomize():
    return randomize_
