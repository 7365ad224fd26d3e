"""ONNX export of a vit-serve model: static resolution (position embeddings baked in) or dynamic H x W.

Two graphs per checkpoint:

    <name>.onnx           pixel_values [B, 3, H, W] float32 -> logits [B, K] float32 (and with `embedding`,
                          embedding [B, D]: the pre-logits representation, `forward_head(pre_logits=True)`)
    <name>_explain.onnx   pixel_values [B, 3, H, W] float32 -> logits [B, K], rollout [B, H/P, W/P] float32

The explain graph computes attention rollout (`vit_serve.explain.rollout`, Abnar & Zuidema 2020) inside the
graph from the explicit attention path, so raw [B, heads, N, N] attention tensors never leave it.
Exports use `torch.onnx.export(dynamo=True)` (torch.export + onnxscript, whose optimizer folds constants);
if that exporter fails, the TorchScript exporter (`dynamo=False`) is tried and the fallback is reported.

A dynamic-resolution graph resamples the position embeddings with `vit_serve.pos_embed`'s portable form (two
interpolation matrices built from the symbolic grid with Range / arithmetic / Where and applied with MatMul),
never ONNX `Resize`, whose cubic, antialias and exclude_outside attributes runtimes read differently: the same
graph gives the same numbers in onnxruntime and OpenVINO (tests/export/test_openvino.py).
"""

from __future__ import annotations

import copy
import io
import math
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

import onnx
import torch
import torch.nn as nn
from vit_export.graph_info import GraphInfo, load_proto
from vit_export.memory import on_young_heap, release_memory
from vit_export.proto_file import save_proto
from vit_export.simplify import simplify as simplify_graph

from vit_serve.checkpoints.io import atomic_write
from vit_serve.explain import DEFAULT_DISCARD_RATIO, DEFAULT_HEAD_FUSION, HEAD_FUSIONS, explain_forward, fuse_heads
from vit_serve.manifest import EMBEDDING, LOGITS, PIXEL_VALUES, ROLLOUT, IOSpec, RolloutSettings, TokenMergingRecord
from vit_serve.model import VisionTransformer
from vit_serve.tome import fewest_patches

PRECISIONS = ("fp32", "fp16")
Res = tuple[int, int] | Literal["dynamic"] | None


class LogitsGraph(nn.Module):
    """pixel_values [B, 3, H, W] float32 -> logits [B, K] float32 (fp16 models: cast in, compute, cast out);
    with `embedding`, (logits, embedding [B, D]), the embedding being what the head reads
    (`forward_head(pre_logits=True)`, timm's image embedding)."""

    def __init__(self, model: VisionTransformer, embedding: bool = False) -> None:
        super().__init__()
        self.model = model
        self.dtype = next(model.parameters()).dtype
        self.embedding = embedding

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not self.embedding:
            return self.model(pixel_values.to(self.dtype)).float()
        logits, embedding = self.model.forward_embedding(pixel_values.to(self.dtype))
        return logits.float(), embedding.float()


class ExplainGraph(nn.Module):
    """pixel_values [B, 3, H, W] -> (logits [B, K], rollout [B, H/P, W/P]): `vit_serve.explain.explain_forward`
    in-graph (with token merging set on the model, the rollout follows the merges)."""

    def __init__(self, model: VisionTransformer, head_fusion: str = DEFAULT_HEAD_FUSION,
                 discard_ratio: float = DEFAULT_DISCARD_RATIO) -> None:
        super().__init__()
        if head_fusion not in HEAD_FUSIONS:
            raise ValueError(f"unknown head_fusion {head_fusion!r}; expected one of {', '.join(HEAD_FUSIONS)}")
        if not 0.0 <= discard_ratio < 1.0:
            raise ValueError(f"discard_ratio must be in [0, 1), got {discard_ratio}")
        self.model = model
        self.dtype = next(model.parameters()).dtype
        self.head_fusion = head_fusion
        self.discard_ratio = discard_ratio

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with heads_fused(self.model, self.head_fusion):
            e = explain_forward(self.model, pixel_values.to(self.dtype), self.head_fusion, self.discard_ratio)
        return e.logits.float(), e.heatmap.map


@contextmanager
def heads_fused(model: VisionTransformer, head_fusion: str = DEFAULT_HEAD_FUSION) -> Iterator[VisionTransformer]:
    """While open, each encoder block of `model` returns its attention probabilities with the heads already fused,
    [B, 1, N, N] (`fuse_heads` of the float32 probabilities, as `rollout` fuses them), so that a forward pass for
    the rollout holds one [B, N, N] map per layer instead of [B, heads, N, N] (in PyTorch, and in an exported
    graph, where each layer's full attention is then free as soon as the next op has read it). The rollout of the
    fused maps is that of the full attentions, bit for bit: fusing one head is the identity."""

    def hook(module: nn.Module, args: Any, output: tuple[torch.Tensor, torch.Tensor | None]) -> Any:
        x, attn = output
        return output if attn is None else (x, fuse_heads(attn.float(), head_fusion)[:, None])

    handles = [blk.register_forward_hook(hook) for blk in model.blocks]
    try:
        yield model
    finally:
        for h in handles:
            h.remove()


class _FP32LayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 inside an fp16 model (its variance overflows / loses precision in fp16)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(
            x.float(), self.normalized_shape, self.weight.float(), self.bias.float(), self.eps
        ).to(x.dtype)


def to_fp16(model: VisionTransformer) -> VisionTransformer:
    """A copy with fp16 weights and compute, LayerNorm kept in fp32 (the softmax of SDPA/explicit path is fp16)."""
    m = copy.deepcopy(model).half()
    for mod in m.modules():
        if isinstance(mod, nn.LayerNorm):
            mod.__class__ = _FP32LayerNorm
    return m


def prepare(model: VisionTransformer, res: Res) -> VisionTransformer:
    """An eval-mode copy for export (its modules copied, its parameters shared with `model`'s).

    Static (res = (H, W) or None): position embeddings resampled once with the checkpoint's own mode
    (`set_resolution`, exactly the library's numbers) and added as a constant. "dynamic": resampled in the graph.
    """
    # The copy shares the weights: nothing below writes to a parameter (set_resolution replaces pos_embed with a new
    # one, and fp16 is a copy of its own), and a second copy of a ViT-L's weights would cost 1.2 GB.
    m = copy.deepcopy(model, memo={id(p): p for p in model.parameters()}).eval()
    if isinstance(res, tuple):
        m.set_resolution(res[0], res[1], mode=m.cfg.resample_mode)
    m.dynamic_size = res == "dynamic"
    return m


def min_grid(model: VisionTransformer) -> int:
    """The smallest grid side (in patches) of a dynamic-resolution graph: 1, or with token merging the side
    of the smallest square grid on which no layer's merge is capped (`vit_serve.tome.fewest_patches`). Above it
    the graph's token counts are the schedule's at every size, so torch.export needs no guard on them (with
    the cap left symbolic it takes minutes, not seconds)."""
    if model.token_merging is None:
        return 1
    return max(1, math.isqrt(fewest_patches(list(model.token_merging.r)) - 1) + 1)


def _dynamic_shapes(model: VisionTransformer, res: Res, batch: str | int) -> dict[str, dict[int, object]] | None:
    from torch.export import Dim

    axes: dict[int, object] = {}
    if batch == "dynamic":
        axes[0] = Dim("batch", min=1, max=4096)
    if res == "dynamic":
        p, lo = model.cfg.patch_size, min_grid(model)
        axes[2] = p * Dim("grid_h", min=lo, max=1024)
        axes[3] = p * Dim("grid_w", min=lo, max=1024)
    return {PIXEL_VALUES: axes} if axes else None


def token_merging_record(model: VisionTransformer, res: Res) -> TokenMergingRecord | None:
    """What a graph of `model` exported at `res` records of its token merging (None: none)."""
    return TokenMergingRecord.of(model.token_merging, min_grid(model) if res == "dynamic" else None)


def _torch_export(
    graph: nn.Module, x: torch.Tensor, output_names: list[str], dyn, opset: int
) -> tuple[onnx.ModelProto, str]:
    """Dynamo exporter first; the TorchScript exporter as a fallback. Returns (proto, exporter used)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prog = torch.onnx.export(
                graph,
                (x,),
                dynamo=True,
                opset_version=opset,
                input_names=[PIXEL_VALUES],
                output_names=output_names,
                dynamic_shapes=dyn,
                verbose=False,
            )
        return prog.model_proto, "dynamo"
    except Exception as e:  # the dynamo exporter raises many types; keep its message for the report
        dynamo_error = " ".join(str(e).split())[:300]
    buf = io.BytesIO()
    axes = {}
    if dyn:
        names = {0: "batch", 2: "height", 3: "width"}
        axes = {PIXEL_VALUES: {i: names[i] for i in dyn[PIXEL_VALUES]}}
        for o in output_names:
            axes[o] = {0: "batch"} if 0 in dyn[PIXEL_VALUES] else {}
    torch.onnx.export(
        graph,
        (x,),
        buf,
        dynamo=False,
        opset_version=opset,
        input_names=[PIXEL_VALUES],
        output_names=output_names,
        dynamic_axes=axes or None,
    )
    return onnx.load_from_string(buf.getvalue()), f"torchscript (dynamo failed: {dynamo_error})"


def check(proto: onnx.ModelProto) -> str:
    """onnx.checker with full_check (shape inference) where it passes; returns which check passed. The checker
    reads the model from a file (`save_proto`): handing it the proto serializes it whole in Python, which for a
    ViT-L peaked 5 GB above the proto."""
    with tempfile.TemporaryDirectory(prefix="vit-export-check-") as tmp:
        path = str(Path(tmp) / "model.onnx")
        save_proto(proto, path)
        try:
            onnx.checker.check_model(path, full_check=True)
            return "full_check"
        except onnx.checker.ValidationError:
            raise
        except Exception:  # shape inference cannot always handle symbolic dims; the structural check still must pass
            onnx.checker.check_model(path)
            return "check_model"


@dataclass(frozen=True)
class ExportedGraph:
    """A graph `export_graph` wrote: its file, the settings stored in it, and its inputs and outputs."""

    path: Path
    info: GraphInfo
    io: IOSpec


@on_young_heap
def export_graph(
    model: VisionTransformer,
    path: str | Path,
    res: Res = None,
    batch: Literal["dynamic"] | int = "dynamic",
    opset: int = 18,
    explain: bool = False,
    head_fusion: str = DEFAULT_HEAD_FUSION,
    discard_ratio: float = DEFAULT_DISCARD_RATIO,
    precision: str = "fp32",
    overwrite: bool = False,
    simplify: bool = True,
    embedding: bool = False,
) -> ExportedGraph:
    """Export `model` to ONNX at `path` (atomically; FileExistsError if it exists and not `overwrite`).

    res: (H, W) -> position embeddings resampled with `model.cfg.resample_mode` and baked in (static H, W);
        None -> the model's own resolution, static; "dynamic" -> resampling in the graph, H and W symbolic
        multiples of the patch size. batch: "dynamic" (default) or a fixed N.
    explain: the explain graph (outputs "logits" [B, K] and "rollout" [B, gh, gw]).
    Token merging set on the model (`set_token_merging`) runs in the graph and is recorded; a dynamic graph of
    such a model takes sides of at least `min_grid(model)` patches.
    embedding: a second output "embedding" [B, D] of the logits graph (`LogitsGraph`); not with `explain`.
    precision: "fp32", or "fp16" (fp16 weights and compute, LayerNorm in fp32, float32 inputs and outputs).
    simplify: run onnxslim, kept only when onnxruntime's outputs are unchanged (`vit_export.simplify`).
    The export settings are stored in the ONNX metadata_props (`GraphInfo`, "vit_export" key, JSON) and returned
    with the file's path and its inputs and outputs.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass --force to replace it")
    _check_options(opset, precision, explain, embedding, batch)
    if res is not None and res != "dynamic":
        res = (int(res[0]), int(res[1]))
        model.check_size(*res)
    m = prepare(model, res)
    if precision == "fp16":
        m = to_fp16(m)
    h, w = m.cfg.img_size
    if res == "dynamic":  # the example input must lie in the exported range
        lo = min_grid(m) * m.cfg.patch_size
        h, w = max(h, lo), max(w, lo)
    graph = ExplainGraph(m, head_fusion, discard_ratio) if explain else LogitsGraph(m, embedding)
    outputs = [LOGITS, ROLLOUT] if explain else [LOGITS, EMBEDDING] if embedding else [LOGITS]
    # An example batch of 2 keeps a dynamic batch axis from being specialised to 1.
    x = torch.randn(batch if isinstance(batch, int) else 2, 3, h, w)
    with torch.no_grad():
        proto, exporter = _torch_export(graph.eval(), x, outputs, _dynamic_shapes(m, res, batch), opset)
    release_memory()  # the exporter's program and its copies of the weights
    simplified = "off"
    if simplify:
        proto, simplified = simplify_graph(proto, tuple(x.shape))
        release_memory()  # the graph simplify did not keep
    rollout = RolloutSettings(head_fusion, discard_ratio, m.cfg.pool, m.num_prefix_tokens) if explain else None
    info = GraphInfo("dynamic" if res == "dynamic" else (h, w), batch, opset, precision, explain, embedding,
                     m.cfg.resample_mode, m.cfg.patch_size, exporter, simplified, rollout,
                     token_merging=token_merging_record(m, res))
    info = info.replace(checker=check(proto))
    info.write(proto)
    atomic_write(path, partial(save_proto, proto), overwrite=overwrite)
    return ExportedGraph(path, info, IOSpec.from_dict(io_spec(proto), f"{path.name} (exported graph)"))


def export_onnx(model: VisionTransformer, path: str | Path, *args: Any, **kwargs: Any) -> Path:
    """`export_graph` with the same arguments, returning the written file's path."""
    return export_graph(model, path, *args, **kwargs).path


def _check_options(opset: int, precision: str, explain: bool, embedding: bool, batch: object) -> None:
    if opset < 17:
        raise ValueError(f"opset {opset} is too old; LayerNormalization needs opset >= 17")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r} for ONNX export; expected one of {', '.join(PRECISIONS)}")
    if explain and embedding:
        raise ValueError("the embedding output belongs to the logits graph, not to the explain graph")
    if not (batch == "dynamic" or (isinstance(batch, int) and batch > 0)):
        raise ValueError(f"batch must be 'dynamic' or a positive integer, got {batch!r}")


def export_info(onnx_path: str | Path | onnx.ModelProto) -> dict:
    """The export settings stored by `export_graph` in the model's metadata_props as a JSON object ({} if absent):
    `GraphInfo.read(...).to_dict()`.

    Takes a path or an already loaded proto (a ViT-B graph is 350 MB: load it once for several questions)."""
    info = GraphInfo.read(onnx_path)
    return {} if info is None else info.to_dict()


def io_spec(onnx_path: str | Path | onnx.ModelProto) -> dict[str, list[dict]]:
    """Input and output names, element types and shapes (symbolic dims as strings) of an ONNX file or proto."""
    proto = load_proto(onnx_path)

    def spec(v: onnx.ValueInfoProto) -> dict:
        t = v.type.tensor_type
        dims = [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]
        return {"name": v.name, "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name, "shape": dims}

    return {"inputs": [spec(v) for v in proto.graph.input], "outputs": [spec(v) for v in proto.graph.output]}
