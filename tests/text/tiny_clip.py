"""Tiny open_clip models with random weights for the text-tower, open_clip and zero-shot tests.

Configs (registered with open_clip.add_model_config, nothing downloaded):
  tiny-clip            CLIP: QuickGELU, LayerScale, causal text tower pooled at the EOT argmax, CLIP's tokenizer.
  tiny-sl-like         SigLIP's text side (no causal mask, last-token pooling, projection with bias, eps 1e-6,
                       GELU-tanh, a logit bias) on open_clip's own ViT, with the CLIP tokenizer (a SigLIP-like
                       config: open_clip's real SigLIP configs name a Hugging Face tokenizer that is not local;
                       no 'siglip' in its name, or open_clip.get_tokenizer would pick its SigLIP tokenizer).
  tiny-siglip-hf-tok   the same, naming a Hugging Face tokenizer (timm/ViT-B-16-SigLIP): refused unless local.
Vision width 64, 2 layers, 4 heads, 32 px, patch 8; text width 64, 2 layers, 4 heads, context 16.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

VISION = {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 16}
TEXT = {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 4, "layers": 2}
SIGLIP_TEXT = {**TEXT, "no_causal_mask": True, "proj_bias": True, "pool_type": "last", "norm_kwargs": {"eps": 1e-6},
               "act_kwargs": {"approximate": "tanh"}}
CONFIGS = {
    "tiny-clip": {"embed_dim": 32, "quick_gelu": True, "vision_cfg": {**VISION, "ls_init_value": 0.5},
                  "text_cfg": TEXT},
    "tiny-sl-like": {"embed_dim": 32, "init_logit_bias": -10, "custom_text": True,
                         "vision_cfg": {**VISION, "act_kwargs": {"approximate": "tanh"}, "norm_kwargs": {"eps": 1e-6}},
                         "text_cfg": SIGLIP_TEXT},
    "tiny-siglip-hf-tok": {"embed_dim": 32, "init_logit_bias": -10, "custom_text": True, "vision_cfg": VISION,
                           "text_cfg": {**SIGLIP_TEXT, "hf_tokenizer_name": "timm/ViT-B-16-SigLIP",
                                        "tokenizer_kwargs": {"clean": "canonicalize"}}},
}


def register(folder: Path) -> None:
    """Write the configs as open_clip model-config files and register them."""
    import open_clip

    for name, cfg in CONFIGS.items():
        (folder / f"{name}.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(folder)


@torch.no_grad()
def randomized(name: str, seed: int = 0, **kwargs) -> torch.nn.Module:
    """open_clip.create_model(name, pretrained=None) with non-trivial random weights (eval mode)."""
    import open_clip

    model = open_clip.create_model(name, pretrained=None, **kwargs).eval()
    g = torch.Generator().manual_seed(seed)
    for pname, p in model.named_parameters():
        if pname in ("logit_scale", "logit_bias"):
            continue  # keep open_clip's init: log(1/0.07) and -10
        if pname.endswith(("positional_embedding", "class_embedding")):
            p.copy_(torch.randn(p.shape, generator=g))
        elif p.ndim >= 2:
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p[0].numel()))
        elif pname.endswith("bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
    if hasattr(model, "logit_bias") and model.logit_bias is not None:
        model.logit_bias.fill_(-2.5)
    return model


def state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached, contiguous copy of the state dict (for torch.save / safetensors)."""
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
