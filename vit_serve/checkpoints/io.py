"""Reading weight files safely, and our own checkpoint format.

Our format is one `.safetensors` file; its string metadata holds the ViTConfig, the class labels and the
preprocessing contract as JSON, so a file is a complete, ready-to-serve model. Nothing here unpickles
arbitrary objects: `.pth`/`.bin` go through `torch.load(weights_only=True)`, `.npz` through
`numpy.load(allow_pickle=False)`.
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from vit_serve.checkpoints.converted import CheckpointError, Converted, one_line
from vit_serve.checkpoints.unsupported import UnsupportedCheckpoint
from vit_serve.config import ViTConfig
from vit_serve.preprocess import PreprocessConfig
from vit_serve.reference_sketch import Reference

FORMAT_NAME = "vit-serve"
FORMAT_VERSION = "1"
# Tensors under this prefix (and metadata keys starting "text_") belong to the text tower (vit_serve.text);
# the image-model loader leaves them out.
TEXT_PREFIX = "text."
REFERENCE_KEY = "reference"  # metadata: the model's `vit_serve.reference_sketch.Reference` (to_dict, as JSON)


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and string metadata of a .safetensors file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            return {k: f.get_tensor(k) for k in f.keys()}, meta  # noqa: SIM118 (safe_open is not iterable)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"cannot read {path}: truncated or corrupt safetensors file ({one_line(e)})") from e


def read_npz(path: Path) -> dict[str, np.ndarray]:
    """Arrays of an .npz file (vit_jax / big_vision), loaded eagerly so corruption shows here."""
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, KeyError) as e:
        raise CheckpointError(f"cannot read {path}: truncated or corrupt .npz file ({one_line(e)})") from e


def is_torchscript_archive(path: Path) -> bool:
    """A TorchScript archive (torch.jit.save: a zip with `constants.pkl` and `code/`), e.g. OpenAI's CLIP release."""
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError):
        return False
    return any(n.endswith("/constants.pkl") or n == "constants.pkl" for n in names) and any(
        "/code/" in n or n.startswith("code/") for n in names)


TORCHSCRIPT_HINT = ("a TorchScript archive (OpenAI's original CLIP release) is not read, it would run its code; "
                    "convert it with open_clip first: model = open_clip.openai.load_openai_model(PATH); "
                    "torch.save(model.state_dict(), 'weights.pth'); then `vit-serve convert weights.pth DST "
                    "--arch open_clip:ViT-B-32-quickgelu` (the matching -quickgelu config)")


def read_torch(path: Path) -> dict[str, torch.Tensor]:
    """A PyTorch state dict (.pth/.pt/.bin) with weights_only=True; unwraps {"state_dict"|"model": ...}.

    TorchScript archives are refused before anything is unpickled."""
    if is_torchscript_archive(path):
        raise UnsupportedCheckpoint(f"cannot read {path}: {TORCHSCRIPT_HINT}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for bad pickles, zips and disallowed globals
        raise CheckpointError(f"cannot read {path}: not a readable PyTorch weights file ({one_line(e)})") from e
    for key in ("state_dict", "model", "model_state"):
        if isinstance(obj, Mapping) and isinstance(obj.get(key), Mapping):
            obj = obj[key]
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"cannot read {path}: expected a mapping of parameter names to tensors")
    return dict(obj)


def read_weights(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, str]]:
    """Any supported weight file -> (name -> array/tensor, metadata)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no such file: {path}")
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        return read_safetensors(path)
    if suffix == ".npz":
        return read_npz(path), {}
    if suffix in (".pth", ".pt", ".bin", ".ckpt"):
        return read_torch(path), {}
    raise CheckpointError(f"cannot read {path}: unknown file type {suffix!r} "
                          "(expected .safetensors, .npz, .pth, .pt, .bin or .ckpt)")


# -- our format -----------------------------------------------------------------------------------------

def to_metadata(cfg: ViTConfig, labels: list[str] | None, preprocess: PreprocessConfig,
                extra: Mapping[str, Any] | None = None) -> dict[str, str]:
    meta = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "config": cfg.to_json(),
        "labels": json.dumps(labels),
        "preprocess": json.dumps(preprocess.to_dict()),
    }
    for k, v in (extra or {}).items():
        meta[k] = v if isinstance(v, str) else json.dumps(v)
    return meta


def is_ours(metadata: Mapping[str, str]) -> bool:
    return metadata.get("format") == FORMAT_NAME


def from_ours(tensors: dict[str, torch.Tensor], metadata: Mapping[str, str], source: str) -> Converted:
    """Our safetensors payload -> Converted."""
    if metadata.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{source}: vit-serve format version {metadata.get('format_version')!r} "
                              f"is not supported (this release reads version {FORMAT_VERSION})")
    try:
        cfg = ViTConfig.from_dict(json.loads(metadata["config"]))
        labels = json.loads(metadata.get("labels", "null"))
        pre = PreprocessConfig.from_dict(json.loads(metadata["preprocess"]))
        reference = Reference.from_dict(json.loads(metadata[REFERENCE_KEY])) if REFERENCE_KEY in metadata else None
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{source}: bad vit-serve metadata ({one_line(e)})") from e
    image = {k: v for k, v in tensors.items() if not k.startswith(TEXT_PREFIX)}
    return Converted(cfg, image, source=f"vit-serve file {source}", labels=labels, preprocess=pre,
                     reference=reference)


def atomic_write(path: str | os.PathLike, data: bytes | Callable[[str], None], overwrite: bool = False) -> Path:
    """Write to `path` atomically: temp file in the same folder, fsync, rename, fsync the folder.

    `data` is the bytes, or a function that writes the temp file at the path it is given (so that a large
    checkpoint streams to disk instead of being built in memory first).
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True (CLI: --force) to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(tmp)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def save(model: torch.nn.Module, path: str | os.PathLike, overwrite: bool = False,
         extra_metadata: Mapping[str, Any] | None = None,
         extra_tensors: Mapping[str, torch.Tensor] | None = None) -> Path:
    """Save a VisionTransformer (weights, config, labels, preprocessing contract) as one .safetensors file.

    `extra_tensors` (names under `text.`: a text tower, vit_serve.text.text_payload) travel beside the model's.
    """
    pre = getattr(model, "preprocess_cfg", None) or PreprocessConfig(input_size=model.cfg.img_size)
    reference = getattr(model, "reference", None)
    extra = {**({REFERENCE_KEY: reference.to_dict()} if reference is not None else {}), **(extra_metadata or {})}
    meta = to_metadata(model.cfg, getattr(model, "labels", None), pre, extra)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    for k, v in (extra_tensors or {}).items():
        if not k.startswith(TEXT_PREFIX) or k in tensors:
            raise ValueError(f"extra tensor {k!r} must be named {TEXT_PREFIX}* and not clash with the model's")
        tensors[k] = v.detach().to("cpu").contiguous()
    return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta), overwrite=overwrite)
