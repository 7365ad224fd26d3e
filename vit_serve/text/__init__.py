"""Text towers and tokenizers for zero-shot heads (CLIP, SigLIP); nothing is downloaded.

    bundle = read_text_tower("open_clip.pth", arch="open_clip:ViT-B-32")   # or a CLIPModel / SiglipModel folder
    bundle = load_text_tower("model.safetensors")                           # our checkpoint (None: no tower)
    ids = bundle.tokenize(["a photo of a cat."])    # LongTensor [K, L]
    emb = bundle.encode(["a photo of a cat."])      # [K, E], unnormalised (open_clip encode_text)
    bundle.tower(ids)                               # the nn.Module: ids [K, L] int64 -> [K, E] (exportable)
    bundle.logit_scale, bundle.logit_bias           # the log scale (logits use exp), SigLIP's bias or None

Our checkpoint carries the tower as `text.*` tensors and `text_*` metadata (text_payload), which the
image-model loader ignores.

- `tower`: the text transformer (CLIP's causal one, SigLIP's bidirectional one).
- `tokenizer`: open_clip's and Hugging Face's tokenizers.
- `tokenizer_config`: what transformers makes of a local tokenizer folder (SigLIP 2's Gemma tokenizer).
- `bundle`: `TextBundle` (tower, tokenizer, logit scale and bias) and how our checkpoint carries it.
- `read`: the text tower of any supported checkpoint.
- `open_clip_text`, `hf_text`: open_clip and transformers text towers -> ours.
- `manifest`: the exported text tower's manifest.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The names below load their module on first use (PEP 562), so that reading an exported text tower's manifest
# (`vit_serve.text.manifest`, which the gateway's settings and `--help` reach) does not import torch.
_HOMES = {"TextBundle": "bundle", "bundle_from_checkpoint": "bundle", "text_payload": "bundle",
          "load_text_tower": "read", "read_text_tower": "read", "HFTokenizer": "tokenizer",
          "OpenClipTokenizer": "tokenizer", "Tokenizer": "tokenizer", "TokenizerError": "tokenizer",
          "tokenizer_from_spec": "tokenizer", "TextConfig": "tower", "TextTransformer": "tower"}

if TYPE_CHECKING:
    from vit_serve.text.bundle import TextBundle, bundle_from_checkpoint, text_payload
    from vit_serve.text.read import load_text_tower, read_text_tower
    from vit_serve.text.tokenizer import (
        HFTokenizer,
        OpenClipTokenizer,
        Tokenizer,
        TokenizerError,
        tokenizer_from_spec,
    )
    from vit_serve.text.tower import TextConfig, TextTransformer

__all__ = ["HFTokenizer", "OpenClipTokenizer", "TextBundle", "TextConfig", "TextTransformer", "Tokenizer",
           "TokenizerError", "bundle_from_checkpoint", "load_text_tower", "read_text_tower", "text_payload",
           "tokenizer_from_spec"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'vit_serve.text' has no attribute {name!r}")
    return getattr(importlib.import_module(f"vit_serve.text.{_HOMES[name]}"), name)
