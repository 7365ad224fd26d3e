"""A tiny SigLIP 2 NaFlex vision tower built from transformers' own `Siglip2VisionModel` with random weights (the
reference of the NaFlex tests in tests/export, tests/predict, tests/runtime and tests/serve), and the photos they
send: three aspect ratios cut from scikit-image's samples."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def siglip2_tower(folder: Path, seed: int, num_patches: int = 64) -> torch.nn.Module:
    """A 2-layer `Siglip2VisionModel` (width 64, 4 heads, patch 16, a stored position grid of `num_patches`),
    every weight perturbed (position embeddings by N(0, 1), the rest by 0.05 N(0, 1): nothing trivially zero),
    saved with `save_pretrained(folder)` (the folder `vit-serve convert` reads); returns the model in eval mode."""
    import transformers

    cfg = transformers.Siglip2VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_patches=num_patches, patch_size=16)
    ref = transformers.Siglip2VisionModel(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * (1.0 if "position_embedding" in name else 0.05))
    ref.save_pretrained(folder)
    return ref


def aspect_photos() -> dict[str, np.ndarray]:
    """uint8 RGB [H, W, 3]: portrait 512x300 (astronaut), wide 400x600 (coffee), square 300x300 (chelsea)."""
    from skimage import data

    return {"portrait": data.astronaut()[:, 100:400], "wide": data.coffee(), "square": data.chelsea()[:, 75:375]}
