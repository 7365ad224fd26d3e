"""Reading what `vit-export` wrote: the sidecar JSON beside an exported graph or engine -> `ModelInfo`.

`<name>.onnx` (or `<name>.engine`) has `<name>.json` beside it, and the explain graph `<name>_explain.onnx` has
`<name>_explain.json`; an engine's explain twin may also be the explain ONNX graph its export came with. Only the
JSON is read here; the gateway never imports the exporter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vit_serve.preprocess import PreprocessConfig
from vit_serve.serve.backends.base import ModelInfo

EXPLAIN_SUFFIX = "_explain"


def sidecar_of(path: Path) -> Path:
    return path.with_suffix(".json")


def explain_path_of(path: Path) -> Path:
    """`dir/name.onnx` -> `dir/name_explain.onnx`."""
    return path.with_name(f"{path.stem}{EXPLAIN_SUFFIX}{path.suffix}")


def read_export(path: Path, name: str | None, backend: str, kind: str) -> tuple[ModelInfo, Path | None]:
    """The ModelInfo of an exported logits file (`kind`: "graph" or "engine", for messages) from its sidecar, and the
    path of its explain twin (None when there is none). ValueError when `path` is itself the explain file."""
    if path.stem.endswith(EXPLAIN_SUFFIX):
        base = path.with_name(path.stem[: -len(EXPLAIN_SUFFIX)] + path.suffix)
        raise ValueError(f"serve the logits {kind} {base.name}; its explain {kind} {path.name} is found beside it")
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    side = read_sidecar(path)
    explain = explain_path_of(path)
    if kind == "engine" and not explain.is_file():
        explain = explain_onnx_of_engine(path, side) or explain
    explain_side = read_sidecar(explain) if explain.is_file() else None
    return model_info(path, side, name, explain_side, backend), explain if explain_side is not None else None


def explain_onnx_of_engine(path: Path, side: dict[str, Any]) -> Path | None:
    """The explain ONNX graph a TensorRT engine's export came with, or None.

    `vit-export --format tensorrt` writes `<out>/<name>.onnx`, `<out>/<name>_explain.onnx` and the engine in
    `<out>/<name>_tensorrt/`, whose sidecar names its `source_onnx`. The explain graph itself is not built into an
    engine (TensorRT's TopK caps k at 3840, below what rollout's threshold needs), so the tensorrt backend runs it
    with onnxruntime.
    """
    source = side.get("source_onnx")
    if not isinstance(source, str):
        return None
    for folder in (path.parent, path.parent.parent):
        candidate = explain_path_of(folder / Path(source).name)
        if candidate.is_file() and sidecar_of(candidate).is_file():
            return candidate
    return None


def read_sidecar(path: Path) -> dict[str, Any]:
    """The sidecar dict of an exported file; FileNotFoundError / ValueError with a message for the user."""
    side = sidecar_of(path)
    if not side.is_file():
        raise FileNotFoundError(f"{path} has no sidecar {side.name} beside it (vit-export writes one; it holds the "
                                f"resolution, preprocessing and labels)")
    try:
        data = json.loads(side.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{side} is not valid JSON ({e})") from e
    missing = [k for k in ("resolution", "preprocess", "architecture") if k not in data]
    if not isinstance(data, dict) or missing:
        raise ValueError(f"{side} is not a vit-export sidecar (missing {', '.join(missing) or 'everything'})")
    return data


def num_classes_of(side: dict[str, Any]) -> int:
    for out in side.get("io", {}).get("outputs", []):
        if out.get("name") == "logits" and isinstance(out.get("shape", [None])[-1], int):
            return int(out["shape"][-1])
    if side.get("labels"):
        return len(side["labels"])
    raise ValueError("the sidecar states neither the logits shape nor the labels: cannot tell the class count")


def model_info(path: Path, side: dict[str, Any], name: str | None, explain_side: dict[str, Any] | None,
               backend: str) -> ModelInfo:
    """ModelInfo of an export: resolution (the static one, or the trained one for `--res dynamic`), patch size,
    labels, preprocessing, and the explain graph's fixed rollout settings."""
    try:
        pre = PreprocessConfig.from_dict(side["preprocess"])
        res = side["resolution"]
        resolution = tuple(int(v) for v in res) if isinstance(res, list) else pre.input_size
        arch = side["architecture"]
        rollout = None
        if explain_side is not None:
            r = explain_side.get("rollout") or {}
            rollout = {"head_fusion": r.get("head_fusion", "mean"), "discard_ratio": float(r.get("discard_ratio", 0.9))}
        return ModelInfo(
            name=name or path.stem,
            resolution=(resolution[0], resolution[1]),
            patch_size=int(arch["patch_size"]),
            num_classes=num_classes_of(side),
            labels=side.get("labels"),
            preprocess=pre.with_size(*resolution),
            explain=explain_side is not None,
            rollout=rollout,
            source=str(path),
            extra={"backend": backend, "pool": arch.get("pool", "token"),
                   "precision": side.get("precision", "fp32"), "dynamic_resolution": res == "dynamic"},
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{sidecar_of(path)}: unreadable sidecar ({e})") from e
