"""TensorRT engines from the exported ONNX graphs (the `tensorrt` extra, TensorRT 10.x or 11.x; needs a CUDA GPU).

    onnx [B, 3, H, W] -> engine `model_sm<major><minor>.plan` (one per GPU architecture: Triton picks it with
    `cc_model_filenames`), optimisation profile over the batch axis (min / opt / max), a timing cache per GPU
    architecture and TensorRT version, and a parity check against onnxruntime (CPU) on the same inputs.

Precision. ViT's LayerNorm overflows in fp16 (the residual stream's sum of squares passes 65504), so it stays
fp32 in every engine. How that is done depends on the TensorRT version (`vit_export.tensorrt_compat.plan_build`):
- TensorRT 10, fp32 graph -> fp16 / bf16 engine: weakly typed network, FP16 / BF16 flag, normalisation layers
  pinned to fp32 (OBEY_PRECISION_CONSTRAINTS);
- a graph typed fp16 / bf16 (LayerNorm cast to fp32 inside it; `vit_export.typed_graph`): strongly typed network,
  every tensor's type exactly as the graph says. TensorRT 11 builds only this way.
Every failure inside TensorRT is raised as `TensorRTError` (a RuntimeError) with a one-line message.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from vit_export.parity import judge_logits
from vit_export.tensorrt_compat import BuildPlan, plan_build, profile_shapes, timing_cache_name
from vit_export.typed_graph import graph_precision

from vit_serve.checkpoints.io import atomic_write
from vit_serve.manifest import LOGITS, PIXEL_VALUES, Parity, TensorRTBuild
from vit_serve.tensorrt_engine import TensorRTEngine

PRECISIONS = ("fp32", "fp16", "bf16")
TOP1_MIN = 1.0  # fp16/bf16: top-1 must agree with onnxruntime on every check input
COSINE_MIN = {"fp32": 0.99999, "fp16": 0.9999, "bf16": 0.999}
# fp32 engines are built with TF32 cleared (`BuildPlan.cleared_flags`): full fp32 matmuls, whose other summation
# order than onnxruntime's CPU kernels is what this bound (looser than the CPU graph's 1e-4) leaves room for.
FP32_MAX_ABS = 1e-3


class TensorRTError(RuntimeError):
    """A TensorRT call failed; the message is one line naming the TensorRT version and the step."""


def unavailable_reason() -> str | None:
    """None when TensorRT imports and a CUDA GPU is visible, else a one-line reason."""
    try:
        import tensorrt  # noqa: F401
    except Exception as e:  # ImportError, or OSError when its libraries are missing: both mean "not here"
        return f"the tensorrt package cannot be imported (pip install -e '.[tensorrt]'): {' '.join(str(e).split())}"
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a core dependency
        return "torch is needed to drive the CUDA buffers of the parity check"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (TensorRT builds need one)"
    return None


def tensorrt_version() -> str:
    """The installed TensorRT's version string ('10.16.1.11')."""
    import tensorrt as trt

    return str(trt.__version__)


def compute_capability(device: int = 0) -> str:
    """'9.0' for an H100/H200 — the key Triton's `cc_model_filenames` uses."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}.{minor}"


def engine_filename(cc: str, suffix: str = "") -> str:
    """'9.0' -> 'model_sm90.plan' ('model_sm90_explain.plan' with suffix "_explain")."""
    return f"model_sm{cc.replace('.', '')}{suffix}.plan"


@contextlib.contextmanager
def _step(version: str, what: str) -> Iterator[None]:
    """Any exception from TensorRT inside becomes TensorRTError: 'TensorRT 11.4.0 <what>: <type>: <message>'."""
    try:
        yield
    except (TensorRTError, FileExistsError):
        raise
    except Exception as e:  # pybind raises AttributeError, TypeError, RuntimeError...: the user needs one line
        msg = " ".join(str(e).split())[:400]
        raise TensorRTError(f"TensorRT {version} failed {what}: {type(e).__name__}: {msg}") from e


def _progress_monitor(trt, say: Callable[[str], None]):
    """A TensorRT IProgressMonitor that prints each build phase once, with elapsed seconds."""

    class Monitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.t0 = time.perf_counter()

        def phase_start(self, phase_name, parent_phase, num_steps):
            say(f"  [{time.perf_counter() - self.t0:6.1f}s] {phase_name} ({num_steps} steps)")

        def step_complete(self, phase_name, step):
            return True  # never cancel

        def phase_finish(self, phase_name):
            pass

    return Monitor()


def _attach_timing_cache(config, path: Path | None, say: Callable[[str], None]) -> dict:
    """Load `path` (if any) into `config` with strict checking; a cache that does not fit starts afresh."""
    data = path.read_bytes() if path is not None and path.is_file() else b""
    cache = None
    if data:
        try:
            cache = config.create_timing_cache(data)
        except Exception:  # a truncated or foreign file: TensorRT raises rather than returning None
            cache = None
    if cache is not None and config.set_timing_cache(cache, ignore_mismatch=False):
        return {"path": str(path), "loaded": True}
    if data:
        say(f"  timing cache {path.name} does not fit this GPU and TensorRT; starting a fresh one")
    fresh = config.create_timing_cache(b"")
    if fresh is None or not config.set_timing_cache(fresh, ignore_mismatch=False):
        raise TensorRTError("TensorRT refused a fresh timing cache (set_timing_cache returned False)")
    return {"path": None if path is None else str(path), "loaded": False}


def _configure(trt, network, config, plan: BuildPlan) -> None:
    for name in plan.builder_flags:
        config.set_flag(getattr(trt.BuilderFlag, name))
    for name in plan.cleared_flags:
        config.clear_flag(getattr(trt.BuilderFlag, name))
    if plan.pin_norm_fp32:
        for i in range(network.num_layers):
            layer = network.get_layer(i)
            if layer.type == trt.LayerType.NORMALIZATION:
                layer.precision = trt.float32
                for j in range(layer.num_outputs):
                    layer.set_output_type(j, trt.float32)


def build_engine(
    onnx_path: str | Path,
    out_dir: str | Path,
    precision: str = "fp16",
    batch: tuple[int, int, int] = (1, 8, 16),
    cache_dir: str | Path | None = None,
    progress: Callable[[str], None] = print,
    check_onnx: str | Path | None = None,
    overwrite: bool = False,
    suffix: str = "",
) -> TensorRTBuild:
    """Build `out_dir/model_sm<cc>.plan` from `onnx_path` and check it against onnxruntime.

    batch: the optimisation profile's (min, opt, max) batch for input "pixel_values" [B, 3, H, W] (static H, W).
    cache_dir: folder of the timing caches, one per GPU architecture and TensorRT version
    (`tensorrt_compat.timing_cache_name`), read before and written after the build.
    check_onnx: the fp32 graph to compare against (default `onnx_path`). suffix: "_explain" for the explain graph.
    The graph must already have the precision the build needs (`plan_build(...).graph_precision`: under
    TensorRT 11 an fp16 / bf16 engine needs an fp16 / bf16 graph, `vit_export.typed_graph.export_typed`).
    Returns the `TensorRTBuild` (its parity: `compare_runtimes`' check); raises TensorRTError (one line) when
    TensorRT fails.
    """
    reason = unavailable_reason()
    if reason:
        raise TensorRTError(reason)
    import tensorrt as trt

    version = str(trt.__version__)
    onnx_path, out_dir = Path(onnx_path), Path(out_dir)
    graph = graph_precision(onnx_path)
    plan = plan_build(version, precision, graph)
    if plan.graph_precision != graph:
        raise ValueError(
            f"TensorRT {version} builds a {precision} engine from a {plan.graph_precision}-typed graph only, and "
            f"{onnx_path.name} is {graph} (vit_export.typed_graph.export_typed writes one)"
        )
    cc = compute_capability()
    plan_path = out_dir / engine_filename(cc, suffix)
    if plan_path.exists() and not overwrite:
        raise FileExistsError(f"{plan_path} exists; pass --force to replace it")
    cache_path = Path(cache_dir) / timing_cache_name(cc, version) if cache_dir is not None else None

    with _step(version, f"to parse {onnx_path.name}"):
        logger = trt.Logger(trt.Logger.WARNING)
        builder = trt.Builder(logger)
        flags = 0
        for name in plan.creation_flags:
            flags |= 1 << int(getattr(trt.NetworkDefinitionCreationFlag, name))
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(onnx_path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise TensorRTError(f"TensorRT {version} could not parse {onnx_path.name}: {' '.join(errors.split())}")
        inp = network.get_input(0)
        input_shape = tuple(int(d) for d in inp.shape)
    lo_shape, opt_shape, hi_shape = profile_shapes(input_shape, batch)  # ValueError for a dynamic H x W
    with _step(version, "to configure the build"):
        config = builder.create_builder_config()
        profile = builder.create_optimization_profile()
        profile.set_shape(inp.name, lo_shape, opt_shape, hi_shape)
        config.add_optimization_profile(profile)
        _configure(trt, network, config, plan)
        cache_info = _attach_timing_cache(config, cache_path, progress)
        config.progress_monitor = _progress_monitor(trt, progress)

    lo, opt, hi = batch
    progress(
        f"building TensorRT {version} engine ({precision} from a {graph} graph, "
        f"{'strongly' if plan.strongly_typed else 'weakly'} typed, sm{cc.replace('.', '')}, batch {lo}/{opt}/{hi}) ..."
    )
    t0 = time.perf_counter()
    with _step(version, "to build the engine"):
        serialized = builder.build_serialized_network(network, config)
    build_s = time.perf_counter() - t0
    if serialized is None:
        raise TensorRTError(f"TensorRT {version} failed to build the engine (its messages are above)")
    atomic_write(plan_path, bytes(serialized), overwrite=overwrite)
    if cache_path is not None:
        with _step(version, "to save the timing cache"):
            atomic_write(cache_path, bytes(config.get_timing_cache().serialize()), overwrite=True)
    progress(f"  built in {build_s:.1f}s -> {plan_path}")

    with _step(version, "to run the engine for the parity check"):
        parity = check_engine(plan_path, Path(check_onnx or onnx_path), precision, (lo, hi))
    return TensorRTBuild(str(plan_path), plan_path.name, cc, version, precision, graph, plan.strongly_typed,
                         (lo, opt, hi), round(build_s, 2), cache_info,
                         Parity.from_dict(parity, f"{plan_path.name} check"))


def check_engine(plan_path: Path, onnx_path: Path, precision: str, batch_range: tuple[int, int]) -> dict:
    """The engine at `plan_path` vs onnxruntime (CPU) on `onnx_path`: `compare_runtimes` with the engine."""
    engine = TensorRTEngine(plan_path)
    return compare_runtimes(onnx_path, lambda x: engine.run(x)[LOGITS], precision, batch_range, "TensorRT")


def compare_runtimes(
    onnx_path: str | Path,
    run: Callable[[np.ndarray], np.ndarray],
    precision: str,
    batch_range: tuple[int, int],
    candidate: str = "engine",
) -> dict:
    """`run(x) -> logits` vs onnxruntime (CPU) on `onnx_path`, same N(0, 1) inputs, the profile's min and max batch
    (max capped at 8).

    Criteria: fp32 max |Δ logit| <= 1e-3 (TF32 cleared) and cosine >= 0.99999; fp16 / bf16 top-1 agreement 100%
    and cosine >= 0.9999 / 0.999; a row whose reference logits are all zero (a reset head) by max |Δ| <= 1e-3
    alone (`vit_export.parity.judge_logits`). Rows carry `vit_export.parity.ParityRow`'s fields.
    """
    import onnxruntime as ort

    if precision not in PRECISIONS:
        raise ValueError(f"unknown TensorRT precision {precision!r}; expected one of {', '.join(PRECISIONS)}")
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    shape = sess.get_inputs()[0].shape
    h, w = int(shape[2]), int(shape[3])
    rng = np.random.default_rng(0)
    rows, ok = [], True
    for b in sorted({batch_range[0], min(batch_range[1], 8)}):
        x = rng.standard_normal((b, 3, h, w)).astype(np.float32)
        ref = sess.run([LOGITS], {PIXEL_VALUES: x})[0].astype(np.float64)
        got = np.asarray(run(x), dtype=np.float64)
        den = np.linalg.norm(ref, axis=1) * np.linalg.norm(got, axis=1)
        cos = float(np.min(np.sum(ref * got, 1) / np.maximum(den, 1e-300)))
        max_abs = float(np.abs(ref - got).max())
        top1 = float(np.mean(ref.argmax(1) == got.argmax(1)))
        fp32 = precision == "fp32"
        row_ok = judge_logits(ref, got, zero_max_abs=FP32_MAX_ABS, max_abs=FP32_MAX_ABS if fp32 else None,
                              cosine_min=COSINE_MIN[precision], top1_min=None if fp32 else TOP1_MIN)
        ok &= row_ok
        rows.append({"inputs": "random", "res": f"{h}x{w}", "batch": b, "max_abs": max_abs, "cosine": cos,
                     "top1": top1, "rollout_max_abs": None, "ok": row_ok})
    if precision == "fp32":
        criteria = f"max |Δ logit| <= {FP32_MAX_ABS:g}, cosine >= {COSINE_MIN['fp32']}"
    else:
        criteria = f"top-1 = {TOP1_MIN:.0%}, cosine >= {COSINE_MIN[precision]}"
    return {"reference": "onnxruntime CPU", "candidate": candidate, "precision": precision, "criteria": criteria,
            "ok": bool(ok), "rows": rows}
