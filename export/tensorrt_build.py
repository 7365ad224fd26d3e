"""TensorRT engines from the exported ONNX graphs (the `tensorrt` extra; needs a CUDA GPU).

    onnx [B, 3, H, W] -> engine `model_sm<major><minor>.plan` (one per GPU architecture: Triton picks it with
    `cc_model_filenames`), optimisation profile over the batch axis (min / opt / max), a timing cache reused
    across builds, and a parity check against onnxruntime (CPU) on the same inputs.

Precision. ViT's LayerNorm overflows in fp16 (the residual stream's sum of squares passes 65504), so
- an fp16 ONNX graph (`vit-export --precision fp16`: fp16 matmuls, LayerNorm already cast to fp32 in the graph)
  is built as a *strongly typed* network: TensorRT keeps every tensor's type exactly as the graph says;
- an fp32 graph built for fp16 / bf16 is a weakly typed network with the FP16 / BF16 flag and every
  normalisation layer pinned to fp32 (OBEY_PRECISION_CONSTRAINTS).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from vit_serve.checkpoints.io import atomic_write
from vit_serve.tensorrt_engine import TensorRTEngine

PRECISIONS = ("fp32", "fp16", "bf16")
INPUT_NAME = "pixel_values"
TOP1_MIN = 1.0  # fp16/bf16: top-1 must agree with onnxruntime on every check input
COSINE_MIN = {"fp32": 0.99999, "fp16": 0.9999, "bf16": 0.999}
FP32_MAX_ABS = 1e-3  # TF32 matmuls on Ampere+: looser than the 1e-4 of onnxruntime on the CPU


def unavailable_reason() -> str | None:
    """None when TensorRT imports and a CUDA GPU is visible, else a one-line reason."""
    try:
        import tensorrt  # noqa: F401
    except ImportError as e:
        return f"the tensorrt package is not installed (pip install -e '.[tensorrt]'): {e}"
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a core dependency
        return "torch is needed to drive the CUDA buffers of the parity check"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (TensorRT builds need one)"
    return None


def compute_capability(device: int = 0) -> str:
    """'9.0' for an H100/H200 — the key Triton's `cc_model_filenames` uses."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}.{minor}"


def engine_filename(cc: str, suffix: str = "") -> str:
    """'9.0' -> 'model_sm90.plan' ('model_sm90_explain.plan' with suffix "_explain")."""
    return f"model_sm{cc.replace('.', '')}{suffix}.plan"


def _progress_monitor(trt, say: Callable[[str], None]):
    """A TensorRT IProgressMonitor that prints each build phase once, with elapsed seconds."""

    class Monitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.t0 = time.perf_counter()
            self.last: dict[str, int] = {}

        def phase_start(self, phase_name, parent_phase, num_steps):
            say(f"  [{time.perf_counter() - self.t0:6.1f}s] {phase_name} ({num_steps} steps)")

        def step_complete(self, phase_name, step):
            return True  # never cancel

        def phase_finish(self, phase_name):
            pass

    return Monitor()


def _is_fp16_graph(onnx_path: Path) -> bool:
    import onnx

    proto = onnx.load(str(onnx_path), load_external_data=False)
    return any(init.data_type == onnx.TensorProto.FLOAT16 for init in proto.graph.initializer)


def build_engine(
    onnx_path: str | Path,
    out_dir: str | Path,
    precision: str = "fp16",
    batch: tuple[int, int, int] = (1, 8, 16),
    timing_cache: str | Path | None = None,
    progress: Callable[[str], None] = print,
    check_onnx: str | Path | None = None,
    overwrite: bool = False,
    suffix: str = "",
) -> dict:
    """Build `out_dir/model_sm<cc>.plan` from `onnx_path` and check it against onnxruntime.

    batch: the optimisation profile's (min, opt, max) batch for input "pixel_values" [B, 3, H, W] (static H, W).
    timing_cache: file read before and written after the build (kernel timings, per GPU and TensorRT version).
    check_onnx: the fp32 graph to compare against (default `onnx_path`). suffix: "_explain" for the explain graph
    (`model_sm90_explain.plan`, found beside the logits engine by `vit-serve serve`).
    Returns {"path", "file", "compute_capability", "precision", "strongly_typed", "batch", "build_s", "parity"};
    raises RuntimeError with TensorRT's messages when parsing or building fails.
    """
    reason = unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    import tensorrt as trt

    if precision not in PRECISIONS:
        raise ValueError(f"unknown TensorRT precision {precision!r}; expected one of {', '.join(PRECISIONS)}")
    lo, opt, hi = batch
    if not 1 <= lo <= opt <= hi:
        raise ValueError(f"batch profile must satisfy 1 <= min <= opt <= max, got {batch}")
    onnx_path, out_dir = Path(onnx_path), Path(out_dir)
    cc = compute_capability()
    plan_path = out_dir / engine_filename(cc, suffix)
    if plan_path.exists() and not overwrite:
        raise FileExistsError(f"{plan_path} exists; pass --force to replace it")

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    strongly_typed = _is_fp16_graph(onnx_path)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strongly_typed else 0
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path.name}: {errors}")

    config = builder.create_builder_config()
    inp = network.get_input(0)
    _, c, h, w = inp.shape
    profile = builder.create_optimization_profile()
    profile.set_shape(inp.name, (lo, c, h, w), (opt, c, h, w), (hi, c, h, w))
    config.add_optimization_profile(profile)
    if not strongly_typed and precision != "fp32":
        config.set_flag(trt.BuilderFlag.FP16 if precision == "fp16" else trt.BuilderFlag.BF16)
        config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
        for i in range(network.num_layers):
            layer = network.get_layer(i)
            if layer.type == trt.LayerType.NORMALIZATION:
                layer.precision = trt.float32
                for j in range(layer.num_outputs):
                    layer.set_output_type(j, trt.float32)

    cache_bytes = Path(timing_cache).read_bytes() if timing_cache and Path(timing_cache).exists() else b""
    cache = config.create_timing_cache(cache_bytes)
    config.set_timing_cache(cache, ignore_mismatch=False)
    config.progress_monitor = _progress_monitor(trt, progress)

    progress(f"building TensorRT engine ({precision}, sm{cc.replace('.', '')}, batch {lo}/{opt}/{hi}) ...")
    t0 = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    build_s = time.perf_counter() - t0
    if plan is None:
        raise RuntimeError("TensorRT failed to build the engine (see the messages above)")
    atomic_write(plan_path, bytes(plan), overwrite=overwrite)
    if timing_cache:
        atomic_write(timing_cache, bytes(config.get_timing_cache().serialize()), overwrite=True)
    progress(f"  built in {build_s:.1f}s -> {plan_path}")

    parity = check_engine(plan_path, Path(check_onnx or onnx_path), precision, (lo, hi))
    return {
        "path": plan_path,
        "file": plan_path.name,
        "compute_capability": cc,
        "precision": precision,
        "strongly_typed": strongly_typed,
        "batch": [lo, opt, hi],
        "build_s": round(build_s, 2),
        "parity": parity,
    }


def check_engine(plan_path: Path, onnx_path: Path, precision: str, batch_range: tuple[int, int]) -> dict:
    """Engine vs onnxruntime (CPU) on the same N(0, 1) inputs at the profile's min and max batch.

    Criteria: fp32 max |Δ logit| ≤ 1e-3 (TF32); fp16/bf16 top-1 agreement 100% and cosine ≥ 0.9999 / 0.999.
    """
    import onnxruntime as ort

    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    shape = sess.get_inputs()[0].shape
    h, w = int(shape[2]), int(shape[3])
    engine = TensorRTEngine(plan_path)
    rng = np.random.default_rng(0)
    rows, ok = [], True
    for b in sorted({batch_range[0], min(batch_range[1], 8)}):
        x = rng.standard_normal((b, 3, h, w)).astype(np.float32)
        ref = sess.run(["logits"], {INPUT_NAME: x})[0]
        got = engine.run(x)["logits"]
        cos = float(
            np.min(np.sum(ref * got, 1) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(got, axis=1) + 1e-12))
        )
        max_abs = float(np.abs(ref - got).max())
        top1 = float(np.mean(ref.argmax(1) == got.argmax(1)))
        row_ok = cos >= COSINE_MIN[precision] and (
            max_abs <= FP32_MAX_ABS if precision == "fp32" else top1 >= TOP1_MIN
        )
        ok &= row_ok
        rows.append({"batch": b, "max_abs": max_abs, "cosine": cos, "top1": top1, "ok": row_ok})
    return {"reference": "onnxruntime CPU", "ok": ok, "rows": rows}
