"""The manifest written beside every export (`<name>.onnx` -> `<name>.json`): what it is and how it was checked.

The manifest itself (its fields, JSON layout, versions, reading and writing) is `vit_serve.manifest`; this module
builds one from the exported graph, the source model and the checks, for a graph and for an engine built from it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
from pathlib import Path
from typing import Any

import onnx
from vit_export.onnx_export import export_info, io_spec

from vit_serve.manifest import (
    Architecture,
    ExportManifest,
    Int8Quantization,
    IOSpec,
    Parity,
    RolloutSettings,
    SourceCheckpoint,
    TensorRTBuild,
)
from vit_serve.model import VisionTransformer
from vit_serve.preprocess import PreprocessConfig


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


def build_sidecar(
    model: VisionTransformer,
    export_path: str | os.PathLike,
    checkpoint: str | os.PathLike | None,
    parity: dict[str, Any] | None = None,
    int8: Int8Quantization | None = None,
) -> ExportManifest:
    """The manifest of an ONNX file exported from `model` (the source model, before resampling).

    parity: `vit_export.parity.ParityReport.to_dict()`; int8: set for a quantized graph (its precision is int8).
    """
    path = Path(export_path)
    proto = onnx.load(str(path), load_external_data=False)
    info = export_info(proto)
    res = info["resolution"]
    pre = model.preprocess_cfg or PreprocessConfig(input_size=model.cfg.img_size)
    if isinstance(res, list):
        pre = pre.with_size(*res)
    source = f"{path.name} (exported graph)"
    rollout = None
    if info.get("explain"):
        rollout = RolloutSettings(info["head_fusion"], float(info["discard_ratio"]), info["pool"],
                                  int(info["num_prefix_tokens"]))
    cfg = model.cfg
    return ExportManifest(
        file=path.name,
        file_sha256=sha256(path),
        format="onnx",
        source_checkpoint=None if checkpoint is None else SourceCheckpoint(str(checkpoint), sha256(checkpoint)),
        architecture=Architecture(cfg.patch_size, cfg.embed_dim, cfg.depth, cfg.num_heads,
                                  cfg.resnet_layers is not None, cfg.pool, (cfg.img_size[0], cfg.img_size[1])),
        resolution="dynamic" if res == "dynamic" else (int(res[0]), int(res[1])),
        resample_mode=info.get("resample_mode", cfg.resample_mode),
        batch=info["batch"],
        opset=info["opset"],
        precision="int8" if int8 is not None else info["precision"],
        explain=bool(info.get("explain", False)),
        exporter=info["exporter"],
        checker=info["checker"],
        preprocess=pre,
        labels=None if model.labels is None else tuple(model.labels),
        io=IOSpec.from_dict(io_spec(proto), source),
        rollout=rollout,
        parity=None if parity is None else Parity.from_dict(parity, source),
        versions=versions(),
        int8=int8,
    )


def engine_sidecar(onnx_manifest: ExportManifest, engine: dict[str, Any], built_from: str | None = None
                   ) -> ExportManifest:
    """The manifest of a TensorRT engine built from the graph `onnx_manifest` describes (the contract is the
    graph's), from `vit_export.tensorrt_build.build_engine`'s result `engine`; built_from: the typed graph TensorRT
    built from, when it is not that graph (relative to the output folder)."""
    plan = Path(engine["path"])
    build = TensorRTBuild(
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
        built_from=built_from,
    )
    return dataclasses.replace(onnx_manifest, format="tensorrt", file=build.file, file_sha256=sha256(plan),
                               precision=build.precision, source_onnx=onnx_manifest.file, tensorrt=build)
