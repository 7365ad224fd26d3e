"""Reading what `vit-export` wrote: the manifest beside an exported graph or engine -> `ModelInfo`.

`<name>.onnx` (or `<name>.engine`) has `<name>.json` beside it, and the explain graph `<name>_explain.onnx` has
`<name>_explain.json`; an engine's explain twin may also be the explain ONNX graph its export came with. In a
Triton repository written by `vit-export --format triton`, `MODEL/VERSION/model.onnx` has `sidecar.json` beside it
and its explain twin is the explain model its config names (`vit_serve.runtime.discovery.triton_explain_of`). Only the
manifest is read here (`vit_serve.manifest`); the gateway never imports the exporter. A file whose sha256 is not
the one its manifest records (`file_sha256`) is refused when a backend loads it (`check_bytes`).
"""

from __future__ import annotations

from pathlib import Path

from vit_serve.manifest import ExportManifest, check_file_sha256, manifest_path, read_manifest
from vit_serve.runtime.backends.base import ModelInfo
from vit_serve.runtime.discovery import triton_explain_of

EXPLAIN_SUFFIX = "_explain"


def explain_path_of(path: Path) -> Path:
    """`dir/name.onnx` -> `dir/name_explain.onnx`."""
    return path.with_name(f"{path.stem}{EXPLAIN_SUFFIX}{path.suffix}")


def read_export(path: Path, name: str | None, backend: str, kind: str) -> tuple[ModelInfo, Path | None]:
    """The ModelInfo of an exported logits file (`kind`: "graph" or "engine", for messages) from its manifest,
    and the path of its explain twin (None when there is none). ValueError when `path` is itself the explain
    file."""
    if path.stem.endswith(EXPLAIN_SUFFIX):
        base = path.with_name(path.stem[: -len(EXPLAIN_SUFFIX)] + path.suffix)
        raise ValueError(f"serve the logits {kind} {base.name}; its explain {kind} {path.name} is found beside it")
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    side = read_manifest(path)
    if side.explain:
        raise ValueError(f"{path} is an explain graph (its manifest says so); serve its logits {kind}, which finds "
                         f"it")
    explain = explain_path_of(path)
    if kind == "engine" and not explain.is_file():
        explain = explain_onnx_of_engine(path, side) or explain
    triton = None if explain.is_file() else triton_explain_of(path)
    explain = triton or explain
    explain_side = read_manifest(explain) if explain.is_file() else None
    if triton is not None and explain_side is not None and not _same_export(side, explain_side):
        explain_side = None  # the explain model's version of the same number is another export's
    return model_info(path, side, name, explain_side, backend), explain if explain_side is not None else None


def check_bytes(path: Path, explain: Path | None) -> None:
    """ValueError (one line) unless the exported file at `path` and its explain twin are the bytes their manifests
    record: a version half-copied into a polled repository is refused (the loaded one serves on) until its files
    agree. Reads each file once: a backend calls it as it loads, never per request."""
    for f in (path, explain):
        if f is not None:
            check_file_sha256(f, read_manifest(f))


def _same_export(side: ExportManifest, explain: ExportManifest) -> bool:
    """Whether an explain graph's manifest is that of the logits file's export (checkpoint, resolution, labels)."""
    return (explain.explain and explain.source_checkpoint == side.source_checkpoint
            and explain.resolution == side.resolution and explain.labels == side.labels)


def explain_onnx_of_engine(path: Path, side: ExportManifest) -> Path | None:
    """The explain ONNX graph a TensorRT engine's export came with, or None.

    `vit-export --format tensorrt` writes `<out>/<name>.onnx`, `<out>/<name>_explain.onnx` and the engine in
    `<out>/<name>_tensorrt/`, whose manifest names its `source_onnx`. The explain graph itself is not built into an
    engine (TensorRT's TopK caps k at 3840, below what rollout's threshold needs), so the tensorrt backend runs it
    with onnxruntime.
    """
    if side.source_onnx is None:
        return None
    for folder in (path.parent, path.parent.parent):
        candidate = explain_path_of(folder / Path(side.source_onnx).name)
        if candidate.is_file() and manifest_path(candidate).is_file():
            return candidate
    return None


def model_info(path: Path, side: ExportManifest, name: str | None, explain_side: ExportManifest | None,
               backend: str) -> ModelInfo:
    """ModelInfo of an export: resolution (the static one, or the contract's for `--res dynamic`), patch size,
    labels, preprocessing, and the explain graph's fixed rollout settings."""
    resolution = side.serving_resolution
    try:
        num_classes = side.num_classes
    except ValueError as e:
        raise ValueError(f"{manifest_path(path)}: {e}") from e
    return ModelInfo(
        name=name or path.stem,
        resolution=resolution,
        patch_size=side.architecture.patch_size,
        num_classes=num_classes,
        labels=None if side.labels is None else list(side.labels),
        preprocess=side.preprocess.with_size(*resolution),
        explain=explain_side is not None,
        rollout=None if explain_side is None else explain_side.rollout,
        source=str(path),
        backend=backend,
        device="cuda" if backend == "tensorrt" else "cpu",
        pool=side.architecture.pool,
        precision=side.precision,
        dynamic_resolution=side.dynamic_resolution,
        embedding_dim=side.embedding_dim,
        scores=side.score_fn,
        embedding=side.embedding,
        token_merging=side.token_merging,
        embedding_space=side.embedding_space,
        reference=None if side.reference is None or (side.reference.needs_embedding and not side.embedding_dim)
        else side.reference,
    )
