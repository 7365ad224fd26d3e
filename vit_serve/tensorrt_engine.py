"""A serialized TensorRT engine run on torch CUDA buffers (TensorRT 10 and 11: named I/O tensors, `execute_async_v3`).

Used by the tensorrt serving backend and by `vit-export`'s engine parity check. `tensorrt` and CUDA torch are
imported when an engine is loaded, never at import time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

INPUT = "pixel_values"


class TensorRTEngine:
    """One deserialized engine with its execution context and CUDA stream: `run(x)` with x [B, 3, H, W] float32
    numpy -> {output name: float32 numpy}; batches over the optimisation profile's maximum run in chunks."""

    def __init__(self, path: str | Path, runtime: Any = None) -> None:
        import tensorrt as trt
        import torch

        path = Path(path)
        self.torch = torch
        runtime = runtime or trt.Runtime(trt.Logger(trt.Logger.WARNING))
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
