"""ONNX export of the NaFlex path (SigLIP 2's variable resolution at native aspect ratio): one graph for every
image shape and patch budget.

    <name>_naflex.onnx   patches [B, M, P*P*C] float32, spatial_shapes [B, 2] int64 (grid h, w), mask [B, M]
                         int64 (1: a real patch) -> logits [B, K] float32, embedding [B, E] float32

B and M are symbolic. The inputs are what `vit_serve.naflex.batch_images` makes (transformers'
Siglip2ImageProcessor's pixel_values, spatial_shapes, pixel_attention_mask). The per-image antialiased bilinear
resampling of the position-embedding grid is not ONNX `Resize` (one size per call, not per image, and runtimes
read its antialias differently): the graph computes each image's [M, gh * gw] interpolation matrix from
spatial_shapes with Range, Div/Floor, Mul, Abs, Clip and ReduceSum (`naflex.position_weights`) and applies it
with one MatMul. The mask becomes an additive -inf on padded keys in every attention and in the MAP probe.
The settings are stored as for the other graphs (`GraphInfo`, resample_mode "naflex", resolution "dynamic"),
and the inputs under metadata_props["vit_export_naflex"] (JSON: inputs, patch_size, in_chans, max_patches, and
graph_sha256, the sha256 of the export's logits graph NAME.onnx, which the onnxruntime backend serves it with).
"""

from __future__ import annotations

import io
import json
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import onnx
import torch
import torch.nn as nn
from vit_export.graph_info import GraphInfo
from vit_export.onnx_export import ExportedGraph, check, io_spec
from vit_export.proto_file import save_proto

from vit_serve.checkpoints.io import atomic_write
from vit_serve.manifest import EMBEDDING, LOGITS, IOSpec
from vit_serve.model import VisionTransformer
from vit_serve.naflex import DEFAULT_MAX_PATCHES

PATCHES, SPATIAL_SHAPES, MASK = "patches", "spatial_shapes", "mask"
NAFLEX_INPUTS = (PATCHES, SPATIAL_SHAPES, MASK)
METADATA_KEY = "vit_export_naflex"


class NaFlexGraph(nn.Module):
    """(patches [B, M, K], spatial_shapes [B, 2] int64, mask [B, M] int64) -> (logits [B, K'], embedding [B, E]):
    `VisionTransformer.forward_patches`."""

    def __init__(self, model: VisionTransformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, patches: torch.Tensor, spatial_shapes: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, embedding = self.model.forward_patches(patches, spatial_shapes, mask != 0)
        return logits.float(), embedding.float()


def example_inputs(model: VisionTransformer, batch: int = 2, max_patches: int = 64
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs of the graph's types: images of different grids padded to `max_patches` rows."""
    c, p = model.cfg.in_chans, model.cfg.patch_size
    shapes = torch.tensor([[(3 + 2 * i) % 7 + 1, (5 + 3 * i) % 8 + 1] for i in range(batch)], dtype=torch.int64)
    mask = (torch.arange(max_patches)[None] < shapes.prod(-1)[:, None]).to(torch.int64)
    return torch.randn(batch, max_patches, p * p * c), shapes, mask


def _export(graph: nn.Module, args: tuple[torch.Tensor, ...], opset: int) -> tuple[onnx.ModelProto, str]:
    """Dynamo exporter first, the TorchScript one as a fallback (as `onnx_export._torch_export`)."""
    from torch.export import Dim

    b, m = Dim("batch", min=1, max=4096), Dim("max_patches", min=2, max=16384)
    dyn = {PATCHES: {0: b, 1: m}, SPATIAL_SHAPES: {0: b}, MASK: {0: b, 1: m}}
    names = [LOGITS, EMBEDDING]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prog = torch.onnx.export(graph, args, dynamo=True, opset_version=opset, input_names=list(NAFLEX_INPUTS),
                                     output_names=names, dynamic_shapes=dyn, verbose=False)
        return prog.model_proto, "dynamo"
    except Exception as e:  # the dynamo exporter raises many types; keep its message for the report
        dynamo_error = " ".join(str(e).split())[:300]
    buf = io.BytesIO()
    axes = {PATCHES: {0: "batch", 1: "max_patches"}, SPATIAL_SHAPES: {0: "batch"}, MASK: {0: "batch", 1: "max_patches"},
            LOGITS: {0: "batch"}, EMBEDDING: {0: "batch"}}
    torch.onnx.export(graph, args, buf, dynamo=False, opset_version=opset, input_names=list(NAFLEX_INPUTS),
                      output_names=names, dynamic_axes=axes)
    return onnx.load_from_string(buf.getvalue()), f"torchscript (dynamo failed: {dynamo_error})"


def export_naflex(model: VisionTransformer, path: str | Path, opset: int = 18, overwrite: bool = False,
                  graph_sha256: str | None = None) -> ExportedGraph:
    """Export `model.forward_patches` to ONNX at `path` (atomically; FileExistsError if it exists and not
    `overwrite`): dynamic batch and patch budget, fp32. `graph_sha256`: the logits graph of the same export,
    recorded so that a runtime pairs the two only when they belong together. ValueError for a model without a
    plain patch embedding or with token merging (what `forward_patches` refuses)."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass --force to replace it")
    if opset < 17:
        raise ValueError(f"opset {opset} is too old; LayerNormalization needs opset >= 17")
    model = model.eval()
    args = example_inputs(model)
    with torch.no_grad():
        model.forward_patches(*args)  # refuses here, before the exporter, in one line
        proto, exporter = _export(NaFlexGraph(model).eval(), args, opset)
    cfg = model.cfg
    info = GraphInfo("dynamic", "dynamic", opset, "fp32", False, True, "naflex", cfg.patch_size, exporter, "off")
    info = info.replace(checker=check(proto))
    info.write(proto)
    meta = {"inputs": list(NAFLEX_INPUTS), "patch_size": cfg.patch_size, "in_chans": cfg.in_chans,
            "max_patches": int(cfg.extra.get("max_patches", DEFAULT_MAX_PATCHES)),
            **({"graph_sha256": graph_sha256} if graph_sha256 else {})}
    onnx.helper.set_model_props(proto, {**{p.key: p.value for p in proto.metadata_props},
                                        METADATA_KEY: json.dumps(meta, sort_keys=True)})
    atomic_write(path, partial(save_proto, proto), overwrite=overwrite)
    return ExportedGraph(path, info, IOSpec.from_dict(io_spec(proto), f"{path.name} (exported graph)"))


def naflex_info(proto: onnx.ModelProto) -> dict | None:
    """metadata_props["vit_export_naflex"] of a graph `export_naflex` wrote, None for other graphs."""
    value = next((p.value for p in proto.metadata_props if p.key == METADATA_KEY), None)
    return None if value is None else json.loads(value)


@dataclass(frozen=True)
class WrittenNaFlex:
    """NAME_naflex.onnx and its check: the largest |Δ| of logits and embedding against `forward_patches` in
    onnxruntime (images of several grids, at `PARITY_BUDGETS`), and whether it is within `tol`."""

    path: Path
    graph: ExportedGraph
    max_abs_diff: float
    tol: float

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tol


# budget -> the grids (h, w) of the check's three images: square, wide and tall, filling most of the budget
PARITY_GRIDS = {64: ((8, 8), (4, 13), (11, 5)), 256: ((16, 16), (7, 36), (30, 8))}


def naflex_parity(model: VisionTransformer, path: str | Path) -> float:
    """max |Δ| of (logits, embedding) between the graph in onnxruntime and `model.forward_patches`, on one batch
    per budget of `PARITY_GRIDS` (random patches, fixed seed, padding left random)."""
    from vit_export.parity import session

    sess = session(path)
    g = torch.Generator().manual_seed(0)
    k = model.cfg.patch_size ** 2 * model.cfg.in_chans
    worst = 0.0
    for m, grids in PARITY_GRIDS.items():
        shapes = torch.tensor(grids, dtype=torch.int64)
        mask = (torch.arange(m)[None] < shapes.prod(-1)[:, None]).to(torch.int64)
        patches = torch.randn(len(grids), m, k, generator=g)
        with torch.no_grad():
            want = [t.numpy() for t in model.forward_patches(patches, shapes, mask != 0)]
        got = sess.run(None, {PATCHES: patches.numpy(), SPATIAL_SHAPES: shapes.numpy(), MASK: mask.numpy()})
        worst = max(worst, *(float(abs(a - b).max()) for a, b in zip(got, want, strict=True)))
    return worst


def write_naflex(model: VisionTransformer, path: Path, opset: int, tol: float, overwrite: bool,
                 graph_sha256: str | None = None) -> WrittenNaFlex:
    """`export_naflex`, then `naflex_parity` against the model."""
    graph = export_naflex(model, path, opset, overwrite, graph_sha256)
    return WrittenNaFlex(path, graph, naflex_parity(model, path), tol)
