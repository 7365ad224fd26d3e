"""Checkpoints: our safetensors format, and one pure converter per source format.

    load(src)   any supported checkpoint (file, folder or hub id) -> ready VisionTransformer
    save(model, path)   our format, atomically
    convert(src, dst, res=..., num_classes=...)   the `vit-serve convert` command

- `io`: reading weight files safely; our own format (`save`, `from_ours`).
- `converted`: what every converter returns, and the one place that builds the model from it (key checks).
- `jax_npz`: vit_jax / AugReg / big_vision `.npz`.
- `timm_state`, `torchvision_state`, `open_clip_state`: timm, torchvision and open_clip state dicts.
- `timm_eva`: timm `Eva` state dicts (DINOv3, PE, EVA-02, RoPE-ViT), dispatched from `timm_state` by architecture.
- `hf_models`, `hf_transformers`, `hf_clip`, `hf_dinov2`, `hf_dinov3`, `hf_siglip`, `hf_siglip2`: Hugging Face
  transformers folders, by `model_type` (ViT, CLIP, DINOv2, DINOv3, SigLIP, SigLIP 2 NaFlex).
- `hub`: `hf-hub:<owner>/<name>` ids -> a local folder.
- `unsupported`: the readable checkpoints we refuse, with why.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

from vit_serve.checkpoints.converted import CheckpointError, Converted, build_model, check_state_dict
from vit_serve.checkpoints.hf_models import convert_hf, load_hf_dir
from vit_serve.checkpoints.hf_transformers import is_hf_layout
from vit_serve.checkpoints.hub import download, parse_hub_id
from vit_serve.checkpoints.io import from_ours, is_ours, read_weights, save
from vit_serve.checkpoints.jax_npz import convert_npz, is_npz_layout
from vit_serve.checkpoints.open_clip_state import convert_open_clip, is_open_clip_arch, is_open_clip_layout
from vit_serve.checkpoints.timm_state import convert_timm, is_timm_layout
from vit_serve.checkpoints.torchvision_state import convert_torchvision, is_torchvision_layout
from vit_serve.model import VisionTransformer

__all__ = ["KNOWN_FORMATS", "CheckpointError", "Converted", "build_model", "check_state_dict", "convert",
           "convert_hf", "convert_npz", "convert_open_clip", "convert_timm",
           "convert_torchvision", "load", "read_checkpoint", "save"]

KNOWN_FORMATS = (
    "vit-serve .safetensors (ours)",
    "vit_jax / big_vision .npz (incl. AugReg and R50 hybrids)",
    "timm state dict (.pth/.bin/.safetensors, or a timm hub folder with config.json)",
    "Hugging Face transformers ViT (folder with config.json and weights)",
    "torchvision vit_* state dict (.pth)",
    "open_clip state dict (.pth/.bin/.safetensors, with --arch open_clip:NAME)",
    "hub ids: hf-hub:<owner>/<name> (bare timm/<name>, google/vit-*: deprecated)",
)


def _unknown(what: str) -> CheckpointError:
    return CheckpointError(f"unknown checkpoint format: {what}; known formats: " + "; ".join(KNOWN_FORMATS))


def _read_dir(path: Path, arch: str | None, overrides: dict[str, Any]) -> Converted:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise _unknown(f"folder {path} has no config.json")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {cfg_file}: {e}") from e
    if "model_type" in cfg:
        return load_hf_dir(path, **overrides)
    if "architecture" in cfg:  # timm hub layout
        for name in ("model.safetensors", "pytorch_model.bin"):
            if (path / name).is_file():
                weights, _ = read_weights(path / name)
                return convert_timm(weights, arch=arch, hub_config=cfg, **overrides)
        raise CheckpointError(f"timm folder {path} has no model.safetensors or pytorch_model.bin")
    raise _unknown(f"{cfg_file} is neither a transformers nor a timm config")


def read_checkpoint(src: str | os.PathLike, arch: str | None = None, **overrides: Any) -> Converted:
    """Detect the format of `src` and convert it to our layout.

    Args:
        src: a file (.safetensors, .npz, .pth, .bin), a folder (transformers or timm hub layout), or a hub id
            (hf-hub:OWNER/NAME); a local path that does not exist is a one-line CheckpointError.
        arch: a preset / timm / torchvision architecture name, for formats that do not record the head count;
            "open_clip:NAME" for open_clip state dicts (NAME as open_clip.list_models()).
        overrides: ViTConfig fields to replace (e.g. layer_norm_eps) — not applied to our own format.
    """
    if isinstance(src, str) and (repo := parse_hub_id(src)):
        src = download(repo)
    path = Path(src)
    if path.is_dir():
        return _read_dir(path, arch, overrides)
    weights, meta = read_weights(path)
    if is_ours(meta):
        return from_ours(weights, meta, str(path))
    if path.suffix.lower() == ".npz" or is_npz_layout(weights):
        return convert_npz(weights, **overrides)
    if is_open_clip_arch(arch) or is_open_clip_layout(weights):
        if not is_open_clip_arch(arch):
            raise CheckpointError(f"{path} is an open_clip state dict: name its model config with --arch "
                                  "open_clip:NAME (e.g. open_clip:ViT-B-32, open_clip:ViT-B-32-quickgelu for "
                                  "OpenAI's weights)")
        return convert_open_clip(weights, arch, **overrides)
    if is_timm_layout(weights):
        hub_cfg = path.parent / "config.json"
        cfg = json.loads(hub_cfg.read_text()) if hub_cfg.is_file() else None
        return convert_timm(weights, arch=arch, hub_config=cfg if cfg and "architecture" in cfg else None,
                            **overrides)
    if is_hf_layout(weights):
        if (path.parent / "config.json").is_file():
            return load_hf_dir(path.parent, **overrides)
        raise CheckpointError(f"{path} holds transformers ViT weights but no config.json lies beside it")
    if is_torchvision_layout(weights):
        return convert_torchvision(weights, arch=arch, **overrides)
    sample = ", ".join(sorted(weights)[:5])
    raise _unknown(f"{path} (first keys: {sample})")


def load(src: str | os.PathLike, arch: str | None = None, **overrides: Any) -> VisionTransformer:
    """A ready, eval-mode model with `.labels` and `.preprocess_cfg` from any supported checkpoint."""
    return build_model(read_checkpoint(src, arch=arch, **overrides))


def convert(src: str | os.PathLike, dst: str | os.PathLike, res: tuple[int, int] | None = None,
            num_classes: int | None = None, arch: str | None = None, resample_mode: str | None = None,
            overwrite: bool = False, zero_shot: list[str] | None = None,
            templates: list[str] | None = None, reference_images: str | os.PathLike | None = None,
            patch_size: int | None = None) -> VisionTransformer:
    """Convert any supported checkpoint to our format, optionally at a new resolution or with a new head.

    A text tower in `src` (open_clip, CLIPModel / SiglipModel, ours) is kept (`text.*`); `zero_shot` labels
    build a zero-shot head with it (vit_serve.zeroshot; `templates` default "a photo of a {}.").
    `reference_images`: a folder the converted model's reference is built from (`vit_serve.reference`); without
    it, the source's reference is kept unless the resolution or the head changed. `patch_size`: FlexiViT's
    resize of the patch embedding (`VisionTransformer.set_patch_size`), at `res` when both are given.
    """
    from vit_serve import text, zeroshot  # they build on this package: imported when used

    if zero_shot is not None:  # bad labels / templates fail before any weights are read
        zero_shot = zeroshot.check_labels(zero_shot)
        templates = zeroshot.check_templates(templates or zeroshot.DEFAULT_TEMPLATES)
    if Path(dst).exists() and not overwrite:  # before the work; the same message as atomic_write's
        raise FileExistsError(f"{dst} exists; pass overwrite=True (CLI: --force) to replace it")
    model = load(src, arch=arch)
    try:
        bundle = text.read_text_tower(src, arch=arch)
    except text.TokenizerError as e:
        if zero_shot is not None:
            raise
        warnings.warn(f"text tower not kept: {e}", stacklevel=2)  # the image model converts without it
        bundle = None
    if zero_shot is not None and bundle is None:
        raise zeroshot.ZeroShotError(f"{src} has no text tower: --zero-shot needs a CLIP or SigLIP checkpoint with "
                                     "its text tower (open_clip state dict, CLIPModel / SiglipModel folder)")
    if resample_mode:
        model.cfg = model.cfg.replace(resample_mode=resample_mode)
    if patch_size is not None:
        model.set_patch_size(patch_size, res)  # one resampling of the position embeddings, to res / patch_size
    elif res:
        model.set_resolution(*res)
    if zero_shot is not None:
        zeroshot.zero_shot_classifier(model, bundle, zero_shot, templates)
    elif num_classes is not None and num_classes != model.cfg.num_classes:
        model.reset_head(num_classes)
    if reference_images is not None:
        from vit_serve.reference import reference_from_folder

        model.reference = reference_from_folder(model, reference_images)
    tensors, meta = text.text_payload(bundle) if bundle is not None else (None, None)
    save(model, dst, overwrite=overwrite, extra_metadata=meta, extra_tensors=tensors)
    return model
