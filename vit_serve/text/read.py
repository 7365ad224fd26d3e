"""Find the text tower of any supported checkpoint: our file, an open_clip state dict, a transformers
CLIP / SigLIP folder. Image-only checkpoints give None."""

from __future__ import annotations

import os
from pathlib import Path

from vit_serve.checkpoints.converted import CheckpointError
from vit_serve.checkpoints.hub import download, parse_hub_id
from vit_serve.checkpoints.io import is_ours, read_weights
from vit_serve.checkpoints.open_clip_state import is_open_clip_arch, is_open_clip_layout
from vit_serve.text.bundle import TextBundle, bundle_from_checkpoint
from vit_serve.text.hf_text import is_hf_text_folder, read_hf_text
from vit_serve.text.open_clip_text import convert_open_clip_text


def read_text_tower(src: str | os.PathLike, arch: str | None = None) -> TextBundle | None:
    """The text tower (with tokenizer, logit scale / bias) of `src`, or None when it has none.

    Args:
        src: our .safetensors, an open_clip state dict file (with arch "open_clip:NAME"; a tokenizer.json
            beside it for configs with a Hugging Face tokenizer), a transformers CLIPModel / SiglipModel folder
            (its tokenizer.json inside), or a hub id.
        arch: "open_clip:NAME" for open_clip state dicts.
    Raises CheckpointError / TokenizerError (one line) for unreadable towers and tokenizers that are not local.
    """
    if isinstance(src, str) and (repo := parse_hub_id(src)):
        src = download(repo)
    path = Path(src)
    if path.is_dir():
        return read_hf_text(path) if is_hf_text_folder(path) else None
    weights, meta = read_weights(path)
    if is_ours(meta):
        return bundle_from_checkpoint(weights, meta, str(path))
    if is_open_clip_arch(arch) or is_open_clip_layout(weights):
        if not is_open_clip_arch(arch):
            raise CheckpointError(f"{path} is an open_clip state dict: name its model config with --arch "
                                  "open_clip:NAME")
        return convert_open_clip_text(weights, arch, folder=path.parent)
    if any(k.startswith("text_model.") for k in weights) and is_hf_text_folder(path.parent):
        return read_hf_text(path.parent)
    return None


def load_text_tower(path: str | os.PathLike) -> TextBundle | None:
    """The text tower stored in one of our checkpoints (None when it has none)."""
    weights, meta = read_weights(path)
    if not is_ours(meta):
        raise CheckpointError(f"{path} is not a vit-serve checkpoint (convert it first: vit-serve convert)")
    return bundle_from_checkpoint(weights, meta, str(path))
