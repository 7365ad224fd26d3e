"""The manifest written beside every export (`<name>.onnx` -> `<name>.json`): what it is and how it was checked.

The manifest itself (its fields, JSON layout, versions, reading and writing) is `vit_serve.manifest`; this module
builds one from the exported graph, the source model and the checks, for a graph and for an engine built from it.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vit_export.graph_info import GraphInfo, load_proto
from vit_export.onnx_export import io_spec

from vit_serve.config import ViTConfig
from vit_serve.manifest import (
    Architecture,
    ExportManifest,
    Int8Quantization,
    IOSpec,
    Parity,
    RolloutSettings,
    SourceCheckpoint,
    TensorRTBuild,
    embedding_of,
    embedding_space_of,
    file_sha256,
)
from vit_serve.model import VisionTransformer
from vit_serve.preprocess import PreprocessConfig
from vit_serve.reference_sketch import Reference


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


def build_sidecar(
    model: VisionTransformer,
    export_path: str | os.PathLike,
    checkpoint: str | os.PathLike | None,
    parity: dict[str, Any] | None = None,
    int8: Int8Quantization | None = None,
    *,
    info: GraphInfo | None = None,
    io: IOSpec | None = None,
    reference: Reference | None = None,
    trained: ViTConfig | None = None,
    weights: str | None = None,
) -> ExportManifest:
    """The manifest of an ONNX file exported from `model` (the source model, before resampling).

    parity: `vit_export.parity.ParityReport.to_dict()`; int8: set for a quantized graph (its precision is int8).
    info, io: the graph's `GraphInfo` and inputs/outputs when the caller has them (`export_graph`'s), else read
    from the file. reference: what OOD scores and drift compare with (the logits graph's, `vit_export.pipeline`).
    trained: the checkpoint's config when the export resized the model (`--patch-size`): its resolution and patch
    size are the manifest's trained ones. weights: `vit_serve.fingerprint.weights_digest` of the source model's
    tensors as loaded (before the export resized them): given, a logits graph's manifest states its embedding space
    (`embedding_space`, the fingerprint its vectors carry).
    """
    path = Path(export_path)
    source = f"{path.name} (exported graph)"
    if info is None or io is None:
        proto = load_proto(path)
        info = info or GraphInfo.read(proto) or GraphInfo()
        io = io or IOSpec.from_dict(io_spec(proto), source)
    res = info.resolution
    if res is None or info.batch is None or info.opset is None or info.exporter is None or info.checker is None:
        raise ValueError(f"{path}: not a graph written by vit-export (its 'vit_export' metadata is incomplete)")
    pre = model.preprocess_cfg or PreprocessConfig(input_size=model.cfg.img_size)
    if res != "dynamic":
        pre = pre.with_size(*res)
    cfg = model.cfg
    trained = trained or cfg
    precision = f"int8-{int8.scheme}" if int8 is not None else info.precision
    space = None if weights is None or info.explain else embedding_space_of(
        weights, cfg, pre, precision, info.token_merging, trained, info.resample_mode)
    return ExportManifest(
        file=path.name,
        file_sha256=file_sha256(path),
        format="onnx",
        source_checkpoint=None if checkpoint is None else SourceCheckpoint(str(checkpoint), file_sha256(checkpoint)),
        architecture=Architecture(cfg.patch_size, cfg.embed_dim, cfg.depth, cfg.num_heads,
                                  cfg.resnet_layers is not None, cfg.pool,
                                  (trained.img_size[0], trained.img_size[1]), trained.patch_size),
        resolution=res,
        resample_mode=info.resample_mode or cfg.resample_mode,
        batch=info.batch,
        opset=info.opset,
        precision="int8" if int8 is not None else info.precision,
        explain=info.explain,
        exporter=info.exporter,
        checker=info.checker,
        preprocess=pre,
        labels=None if model.labels is None else tuple(model.labels),
        io=io,
        rollout=_rollout(info),
        parity=None if parity is None else Parity.from_dict(parity, source),
        versions=versions(),
        int8=int8,
        embedding=embedding_of(cfg),
        scores=cfg.scores,
        token_merging=info.token_merging,
        reference=reference,
        embedding_space=space,
    )


def engine_sidecar(onnx_manifest: ExportManifest, engine: TensorRTBuild | Mapping[str, Any],
                   built_from: str | None = None) -> ExportManifest:
    """The manifest of a TensorRT engine built from the graph `onnx_manifest` describes (the contract is the
    graph's), from `vit_export.tensorrt_build.build_engine`'s result `engine` (a `TensorRTBuild`, or a mapping of
    its JSON keys); built_from: the typed graph TensorRT built from, when it is not that graph (relative to the
    output folder)."""
    if isinstance(engine, TensorRTBuild):
        build = engine if built_from is None else dataclasses.replace(engine, built_from=built_from)
    else:
        build = dataclasses.replace(_build_of(engine), built_from=built_from)
    space = onnx_manifest.embedding_space
    return dataclasses.replace(onnx_manifest, format="tensorrt", file=build.file, file_sha256=file_sha256(build.path),
                               precision=build.precision, source_onnx=onnx_manifest.file, tensorrt=build,
                               embedding_space=None if space is None else space.with_precision(build.precision))


def _build_of(engine: Mapping[str, Any]) -> TensorRTBuild:
    """A build result given as a mapping of `TensorRTBuild.to_dict`'s keys (path may be a Path)."""
    plan = Path(engine["path"])
    return TensorRTBuild(
        path=str(plan),
        file=str(engine["file"]),
        compute_capability=str(engine["compute_capability"]),
        version=str(engine["tensorrt"]),
        precision=str(engine["precision"]),
        graph_precision=str(engine["graph_precision"]),
        strongly_typed=bool(engine["strongly_typed"]),
        batch=tuple(int(b) for b in engine["batch"]),  # type: ignore[arg-type]
        build_s=float(engine["build_s"]),
        timing_cache=engine.get("timing_cache"),
        parity=None if engine.get("parity") is None else Parity.from_dict(engine["parity"], f"{plan.name} check"),
    )


def _rollout(info: GraphInfo) -> RolloutSettings | None:
    """The explain graph's rollout settings as a manifest states them (the discard ratio a float)."""
    r = info.rollout
    if not info.explain or r is None:
        return None
    return RolloutSettings(r.head_fusion, float(r.discard_ratio), r.pool, r.num_prefix_tokens)
