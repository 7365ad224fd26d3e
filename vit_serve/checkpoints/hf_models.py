"""Hugging Face transformers folders: each config.json `model_type` to its converter (hf_transformers: vit;
hf_dinov2: dinov2, dinov2_with_registers; hf_dinov3: dinov3_vit; hf_clip: clip, clip_vision_model; hf_siglip:
siglip, siglip_vision_model; hf_siglip2: siglip2, siglip2_vision_model); the rest refused in one line naming what
they need."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from vit_serve.checkpoints.converted import CheckpointError, Converted
from vit_serve.checkpoints.hf_clip import convert_clip
from vit_serve.checkpoints.hf_dinov2 import convert_dinov2
from vit_serve.checkpoints.hf_dinov3 import check_dinov3, convert_dinov3
from vit_serve.checkpoints.hf_siglip import convert_siglip
from vit_serve.checkpoints.hf_siglip2 import convert_siglip2
from vit_serve.checkpoints.hf_transformers import UNSUPPORTED, convert_hf_vit, read_hf_weights, read_json
from vit_serve.checkpoints.unsupported import UnsupportedCheckpoint


def _family_converter(model_type: str) -> Callable[..., Converted]:
    """The converter for a model_type; UnsupportedCheckpoint (one line) for the rest."""
    families = {"vit": convert_hf_vit, "dinov2": convert_dinov2, "dinov2_with_registers": convert_dinov2,
                "dinov3_vit": convert_dinov3,
                "clip": convert_clip, "clip_vision_model": convert_clip,
                "siglip": convert_siglip, "siglip_vision_model": convert_siglip,
                "siglip2": convert_siglip2, "siglip2_vision_model": convert_siglip2}
    if model_type in families:
        return families[model_type]
    known = ", ".join(families)
    if model_type in UNSUPPORTED:
        raise UnsupportedCheckpoint(f"config.json model_type={model_type!r} is not supported: it needs "
                              f"{UNSUPPORTED[model_type]}, which vit-serve does not implement; supported: {known}")
    raise UnsupportedCheckpoint(f"config.json model_type={model_type!r} is not supported; supported transformers "
                          f"vision models: {known}")


def convert_hf(config: Mapping[str, Any], weights: Mapping[str, torch.Tensor],
               preprocessor: Mapping[str, Any] | None = None, *, source: str | None = None,
               **overrides: Any) -> Converted:
    """Convert a transformers checkpoint (config.json as a dict, its state dict, preprocessor_config.json) with
    its model_type's converter (see `hf_transformers.convert_hf_vit` for the arguments); pure."""
    converter = _family_converter(config.get("model_type", "vit"))
    return converter(config, weights, preprocessor, source=source, **overrides)


def load_hf_dir(path: str | os.PathLike, **overrides: Any) -> Converted:
    """Read a transformers model folder (e.g. what `save_pretrained` writes) and convert it.

    The folder holds config.json, the weights (model.safetensors, else pytorch_model.bin read with
    `torch.load(weights_only=True)`, or a sharded `*.index.json`) and optionally preprocessor_config.json.
    Unreadable or truncated files raise CheckpointError with a one-line message.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"no such transformers model folder: {folder}")
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder} has no config.json")
    config = read_json(folder / "config.json")
    _family_converter(config.get("model_type", "vit"))  # refused by its architecture before any weights are read
    if config.get("model_type") == "dinov3_vit":
        check_dinov3(config)
    pre_file = folder / "preprocessor_config.json"
    preprocessor = read_json(pre_file) if pre_file.is_file() else None
    weights = read_hf_weights(folder)
    return convert_hf(config, weights, preprocessor, source=f"transformers folder {folder}", **overrides)
