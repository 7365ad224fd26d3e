"""The sidecar JSON written beside every export (`<name>.onnx` -> `<name>.json`): what it is and how it was checked."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

import onnx
from vit_export.onnx_export import export_info, io_spec

from vit_serve.checkpoints.io import atomic_write
from vit_serve.model import VisionTransformer
from vit_serve.preprocess import PreprocessConfig

SIDECAR_VERSION = 1


def sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file (streamed)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def versions() -> dict[str, str]:
    """Versions of the tools that made and checked the export."""
    import onnx
    import onnxruntime
    import torch

    import vit_serve

    return {
        "vit_serve": vit_serve.__version__,
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "python": platform.python_version(),
    }


def sidecar_path(export_path: str | os.PathLike) -> Path:
    """`dir/name.onnx` -> `dir/name.json`."""
    return Path(export_path).with_suffix(".json")


def build_sidecar(
    model: VisionTransformer,
    export_path: str | os.PathLike,
    checkpoint: str | os.PathLike | None,
    parity: dict | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The sidecar's content for an ONNX file exported from `model` (the source model, before resampling)."""
    proto = onnx.load(str(export_path), load_external_data=False)
    info = export_info(proto)
    res = info.get("resolution")
    pre = model.preprocess_cfg or PreprocessConfig(input_size=model.cfg.img_size)
    if isinstance(res, list):
        pre = pre.with_size(*res)
    data: dict[str, Any] = {
        "sidecar_version": SIDECAR_VERSION,
        "file": Path(export_path).name,
        "file_sha256": sha256(export_path),
        "format": "onnx",
        "source_checkpoint": None if checkpoint is None else {"path": str(checkpoint), "sha256": sha256(checkpoint)},
        "architecture": {
            "patch_size": model.cfg.patch_size,
            "embed_dim": model.cfg.embed_dim,
            "depth": model.cfg.depth,
            "num_heads": model.cfg.num_heads,
            "hybrid": model.cfg.resnet_layers is not None,
            "pool": model.cfg.pool,
            "trained_resolution": list(model.cfg.img_size),
        },
        "resolution": res,
        "resample_mode": info.get("resample_mode", model.cfg.resample_mode),
        "batch": info.get("batch"),
        "opset": info.get("opset"),
        "precision": info.get("precision"),
        "explain": info.get("explain", False),
        "exporter": info.get("exporter"),
        "onnx_checker": info.get("checker"),
        "preprocess": pre.to_dict(),
        "labels": model.labels,
        "io": io_spec(proto),
        "parity": parity,
        "versions": versions(),
    }
    if info.get("explain"):
        data["rollout"] = {k: info.get(k) for k in ("head_fusion", "discard_ratio", "pool", "num_prefix_tokens")}
    data.update(extra or {})
    return data


def write_sidecar(export_path: str | os.PathLike, data: dict[str, Any], overwrite: bool = False) -> Path:
    """Write `data` as JSON beside `export_path`, atomically; FileExistsError if present and not `overwrite`."""
    text = json.dumps(data, indent=2, sort_keys=False) + "\n"
    return atomic_write(sidecar_path(export_path), text.encode(), overwrite=overwrite)
