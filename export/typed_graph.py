"""ONNX graphs typed fp16 or bf16 for strongly typed TensorRT builds (TensorRT 11 has no other kind).

    fp16: `vit_export.onnx_export.export_onnx(precision="fp16")` (fp16 weights and compute, LayerNorm in fp32).
    bf16: the same construction in bfloat16: the model's weights rounded once from fp32 to bf16, LayerNorm
          computed in fp32, float32 inputs and outputs. onnxruntime's CPU provider has no bf16 Conv or MatMul,
          so this graph is not simplified (onnxslim's result is kept only after an onnxruntime check) and is
          checked with onnx's reference evaluator or OpenVINO instead.

The graph's `vit_export` metadata records its precision ("bf16"), which the TensorRT build reads.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Literal

import onnx
import torch
from vit_export.graph_info import GraphInfo, load_proto
from vit_export.onnx_export import export_graph, prepare, to_fp16
from vit_export.proto_file import save_proto

from vit_serve.checkpoints.io import atomic_write
from vit_serve.model import VisionTransformer

TYPED_PRECISIONS = ("fp16", "bf16")
_ELEM = {"fp32": onnx.TensorProto.FLOAT, "fp16": onnx.TensorProto.FLOAT16, "bf16": onnx.TensorProto.BFLOAT16}


def to_bf16(model: VisionTransformer) -> VisionTransformer:
    """A copy with bf16 weights and compute, LayerNorm computed in fp32 (as `to_fp16` does for fp16).

    Weights are rounded directly from fp32 to bf16 (not through fp16, which would flush tiny values to zero).
    """
    m = to_fp16(model).to(torch.bfloat16)  # the structure: LayerNorm modules that compute in fp32
    m.load_state_dict(model.state_dict())  # copy_ rounds each fp32 tensor straight to bf16
    return m


def export_typed(
    model: VisionTransformer,
    path: str | Path,
    precision: Literal["fp16", "bf16"],
    res: tuple[int, int] | Literal["dynamic"] | None = None,
    batch: Literal["dynamic"] | int = "dynamic",
    opset: int = 18,
    overwrite: bool = False,
) -> Path:
    """The logits graph of `model` typed `precision` (float32 in and out, LayerNorm in fp32), written to `path`."""
    if precision not in TYPED_PRECISIONS:
        raise ValueError(f"unknown typed-graph precision {precision!r}; expected one of {', '.join(TYPED_PRECISIONS)}")
    path = Path(path)
    if precision == "fp16":
        return export_graph(model, path, res=res, batch=batch, opset=opset, precision="fp16", overwrite=overwrite).path
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass --force to replace it")
    # Resample the position embeddings in fp32, then round: a static graph gets the library's own numbers.
    m = to_bf16(prepare(model, res))
    graph = export_graph(m, path, res="dynamic" if res == "dynamic" else None, batch=batch, opset=opset,
                         precision="fp32", overwrite=True, simplify=False)
    proto = onnx.load(str(path), load_external_data=False)
    info = graph.info.replace(precision="bf16",
                              simplified="off: onnxruntime (CPU) cannot run a bf16 graph to check it")
    info.write(proto)
    atomic_write(path, partial(save_proto, proto), overwrite=True)
    return graph.path


def graph_precision(onnx_path: str | Path | onnx.ModelProto) -> str:
    """"fp32", "fp16" or "bf16": the graph's recorded precision, else the type of its floating-point weights."""
    proto = load_proto(onnx_path)
    info = GraphInfo.read(proto)
    if info is not None and info.precision in _ELEM:
        return info.precision
    types = {init.data_type for init in proto.graph.initializer}
    for name in ("bf16", "fp16"):
        if _ELEM[name] in types:
            return name
    return "fp32"


def norm_input_types(onnx_path: str | Path | onnx.ModelProto) -> dict[str, str]:
    """{LayerNormalization node name: element type of its input} after onnx shape inference."""
    proto = onnx_path if isinstance(onnx_path, onnx.ModelProto) else onnx.load(str(onnx_path))
    inferred = onnx.shape_inference.infer_shapes(proto)
    types = {v.name: v.type.tensor_type.elem_type for v in (*inferred.graph.value_info, *inferred.graph.input)}
    types.update({i.name: i.data_type for i in inferred.graph.initializer})
    return {
        n.name: onnx.TensorProto.DataType.Name(types.get(n.input[0], onnx.TensorProto.UNDEFINED))
        for n in inferred.graph.node
        if n.op_type == "LayerNormalization"
    }
