"""Graph simplification with onnxslim, kept only when onnxruntime gives the same outputs as before.

onnxslim folds constants, removes dead and duplicate nodes and fuses shape arithmetic; on a ViT export it mostly
drops the leftovers of position-embedding resampling and dynamic-shape bookkeeping. A simplified graph is kept
only if, on one random batch, every output matches the original's within `tol` (onnxruntime, CPU).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
from vit_export.memory import on_young_heap, release_memory
from vit_export.proto_file import save_proto

from vit_serve.manifest import PIXEL_VALUES


def _run(path: Path, x: np.ndarray) -> list[np.ndarray]:
    """One run of the graph in `path` (onnxruntime, CPU). From a file: a session made from the serialized bytes
    holds about twice the memory (the bytes, their parse, the weights) of one that reads the file."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.enable_cpu_mem_arena = False  # one run: an arena would only be kept until the session goes
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {PIXEL_VALUES: x})


@on_young_heap
def simplify(proto: onnx.ModelProto, example_shape: tuple[int, int, int, int], tol: float = 1e-6
             ) -> tuple[onnx.ModelProto, str]:
    """proto -> (simplified or original proto, what happened: "onnxslim", "skipped: <why>").

    example_shape: [B, 3, H, W] of the check input (any size the graph accepts).
    """
    try:
        import onnxslim
    except ImportError:
        return proto, "skipped: onnxslim is not installed"
    # One graph in onnxruntime at a time, read from a file, each session gone (and its memory handed back) before
    # the next step: the proto, onnxslim's copy and a session each hold the weights (a ViT-L's are 1.2 GB).
    x = np.random.default_rng(0).standard_normal(example_shape).astype(np.float32)
    with tempfile.TemporaryDirectory(prefix="vit-export-simplify-") as tmp:
        original, simplified = Path(tmp) / "original.onnx", Path(tmp) / "simplified.onnx"
        save_proto(proto, original)
        release_memory()
        before = _run(original, x)
        release_memory()
        try:
            # Without onnxslim's shape inference (onnx's, on the whole serialized model): it cost a ViT-L 5 GB and
            # left the same nodes on every graph we export (logits and explain, static and dynamic: compared).
            slim = onnxslim.slim(proto, no_shape_infer=True)
        except Exception as e:  # onnxslim raises many types; the unsimplified graph is still valid
            return proto, f"skipped: onnxslim failed ({' '.join(str(e).split())[:120]})"
        finally:
            _forget_matches()
            release_memory()
        if slim is None:
            return proto, "skipped: onnxslim returned nothing"
        save_proto(slim, simplified)
        release_memory()
        after = _run(simplified, x)
        release_memory()
    worst = max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in zip(before, after, strict=True))
    if worst > tol:
        return proto, f"skipped: onnxslim changed the outputs by {worst:.2e} > {tol:.0e}"
    del slim.metadata_props[:]
    slim.metadata_props.extend(proto.metadata_props)
    return slim, f"onnxslim ({len(proto.graph.node)} -> {len(slim.graph.node)} nodes, max |Δ| {worst:.1e})"


def _forget_matches() -> None:
    """Drop the nodes onnxslim's fusion matchers keep from their last match (as attributes named after their
    pattern's nodes, on matchers that live in a module-level registry): such a node reaches a weight's TensorProto,
    and through it the whole parsed model it came from (one protobuf arena: 330 MB for a ViT-B, kept until the next
    simplification)."""
    try:
        from onnxslim.core.pattern.registry import DEFAULT_FUSION_PATTERNS
    except ImportError:  # another onnxslim layout: nothing to forget that we know of
        return
    for matchers in DEFAULT_FUSION_PATTERNS.values():
        for matcher in matchers if isinstance(matchers, list) else [matchers]:
            for name in getattr(matcher, "pattern_dict", {}):
                matcher.__dict__.pop(name, None)
