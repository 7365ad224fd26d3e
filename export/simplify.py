"""Graph simplification with onnxslim, kept only when onnxruntime gives the same outputs as before.

onnxslim folds constants, removes dead and duplicate nodes and fuses shape arithmetic; on a ViT export it mostly
drops the leftovers of position-embedding resampling and dynamic-shape bookkeeping. A simplified graph is kept
only if, on one random batch, every output matches the original's within `tol` (onnxruntime, CPU).
"""

from __future__ import annotations

import numpy as np
import onnx

from vit_serve.manifest import PIXEL_VALUES


def _run(proto: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {PIXEL_VALUES: x})


def simplify(proto: onnx.ModelProto, example_shape: tuple[int, int, int, int], tol: float = 1e-6
             ) -> tuple[onnx.ModelProto, str]:
    """proto -> (simplified or original proto, what happened: "onnxslim", "skipped: <why>").

    example_shape: [B, 3, H, W] of the check input (any size the graph accepts).
    """
    try:
        import onnxslim
    except ImportError:
        return proto, "skipped: onnxslim is not installed"
    try:
        slim = onnxslim.slim(proto)
    except Exception as e:  # onnxslim raises many types; the unsimplified graph is still valid
        return proto, f"skipped: onnxslim failed ({' '.join(str(e).split())[:120]})"
    if slim is None:
        return proto, "skipped: onnxslim returned nothing"
    x = np.random.default_rng(0).standard_normal(example_shape).astype(np.float32)
    before, after = _run(proto, x), _run(slim, x)
    worst = max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in zip(before, after, strict=True))
    if worst > tol:
        return proto, f"skipped: onnxslim changed the outputs by {worst:.2e} > {tol:.0e}"
    del slim.metadata_props[:]
    slim.metadata_props.extend(proto.metadata_props)
    return slim, f"onnxslim ({len(proto.graph.node)} -> {len(slim.graph.node)} nodes, max |Δ| {worst:.1e})"
