"""The TensorRT backend: a serialized engine (`<name>.engine` / `.plan`) with its sidecar `<name>.json` (same keys
as the ONNX sidecar: resolution, preprocess, labels, architecture, io), and optionally `<name>_explain.engine`
with `<name>_explain.json` (logits + rollout, rollout settings fixed at build time); without one, the explain ONNX
graph the engine's export came with (named by its sidecar's `source_onnx`) runs in onnxruntime.

Needs a CUDA GPU, the `tensorrt` package (10.x API: named I/O tensors, `execute_async_v3`) and PyTorch with CUDA
(device buffers are torch tensors). Both are imported lazily; without them the server refuses to start with a
one-line reason. Batches larger than the engine's optimisation profile allows are run in chunks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from vit_serve.serve.backends.base import Backend
from vit_serve.serve.backends.sidecar import read_export

INPUT = "pixel_values"


def require_tensorrt() -> Any:
    """The tensorrt module, or OSError saying what is missing (package, CUDA)."""
    try:
        import tensorrt as trt
    except ImportError as e:
        raise OSError(f"the tensorrt backend needs NVIDIA TensorRT (pip install tensorrt) and a CUDA GPU: {e}") from e
    import torch

    if not torch.cuda.is_available():
        raise OSError("the tensorrt backend needs a CUDA GPU; PyTorch sees none (serve the .onnx export with "
                      "--backend onnxruntime instead)")
    return trt


class _Engine:
    """One deserialized engine with its execution context and CUDA stream."""

    def __init__(self, trt: Any, runtime: Any, path: Path) -> None:
        import torch

        self.torch = torch
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise ValueError(f"TensorRT cannot deserialize {path.name} (built with another TensorRT version or "
                             f"GPU? rebuild it on this machine)")
        self.engine = engine
        self.context = engine.create_execution_context()
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        if INPUT not in names:
            raise ValueError(f"{path.name} has no input named {INPUT!r} (inputs: {names})")
        self.dtypes = {n: getattr(torch, np.dtype(trt.nptype(engine.get_tensor_dtype(n))).name) for n in names}
        shape = engine.get_tensor_shape(INPUT)
        self.max_batch = shape[0] if shape[0] > 0 else engine.get_tensor_profile_shape(INPUT, 0)[2][0]
        self.stream = torch.cuda.Stream()

    def run(self, x: np.ndarray) -> dict[str, np.ndarray]:
        parts = [self._run(x[i:i + self.max_batch]) for i in range(0, x.shape[0], self.max_batch)]
        return {k: np.concatenate([p[k] for p in parts]) for k in self.outputs}

    def _run(self, x: np.ndarray) -> dict[str, np.ndarray]:
        torch = self.torch
        with torch.cuda.stream(self.stream):
            xin = torch.from_numpy(x).to("cuda", non_blocking=True).to(self.dtypes[INPUT])
            self.context.set_input_shape(INPUT, tuple(xin.shape))
            self.context.set_tensor_address(INPUT, xin.data_ptr())
            outs = {}
            for name in self.outputs:
                shape = tuple(self.context.get_tensor_shape(name))
                outs[name] = torch.empty(shape, dtype=self.dtypes[name], device="cuda")
                self.context.set_tensor_address(name, outs[name].data_ptr())
            if not self.context.execute_async_v3(self.stream.cuda_stream):
                raise RuntimeError("TensorRT execution failed")
            result = {k: v.float().cpu().numpy() for k, v in outs.items()}
        self.stream.synchronize()
        return result


class _OnnxExplain:
    """The export's explain ONNX graph run by onnxruntime (CUDA provider when present), for engines built without
    one: `run(x)` -> {"logits", "rollout"} like an engine."""

    def __init__(self, path: Path) -> None:
        import onnxruntime as ort

        available = ort.get_available_providers()
        providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
        self.session = ort.InferenceSession(str(path), providers=providers)
        self.input_dtype = np.float16 if "float16" in self.session.get_inputs()[0].type else np.float32

    def run(self, x: np.ndarray) -> dict[str, np.ndarray]:
        logits, heat = self.session.run(["logits", "rollout"], {INPUT: x.astype(self.input_dtype, copy=False)})
        return {"logits": logits, "rollout": heat}


class TensorRTBackend(Backend):
    name = "tensorrt"

    def __init__(self, engine_path: str | Path, model_name: str | None = None) -> None:
        path = Path(engine_path)
        self.info, explain = read_export(path, model_name, self.name, "engine")
        trt = require_tensorrt()
        self._logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(self._logger)
        self.engine = _Engine(trt, runtime, path)
        self.explain_engine: _Engine | _OnnxExplain | None = None
        if explain is not None:
            self.explain_engine = _OnnxExplain(explain) if explain.suffix == ".onnx" else _Engine(trt, runtime, explain)

    def classify(self, x: np.ndarray) -> np.ndarray:
        return self.engine.run(x)["logits"]

    def explain(self, x: np.ndarray, head_fusion: str | None = None, discard_ratio: float | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
        if self.explain_engine is None:
            raise NotImplementedError(f"no explain engine beside {Path(self.info.source).name}")
        why = self.info.rollout_mismatch(head_fusion, discard_ratio)
        if why:
            raise ValueError(why)
        out = self.explain_engine.run(x)
        return out["logits"], out["rollout"]
