"""A serialized TensorRT engine run on torch CUDA buffers (TensorRT 10 and 11: named I/O tensors, `execute_async_v3`).

Used by the tensorrt serving backend and by `vit-export`'s engine parity check. `tensorrt` and CUDA torch are
imported when an engine is loaded, never at import time.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from vit_serve.manifest import PIXEL_VALUES

# `trt.DataType` member names -> torch dtype names. By hand: `trt.nptype` has no bfloat16 (numpy has none).
TORCH_DTYPES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT8": "int8", "UINT8": "uint8",
                "INT32": "int32", "INT64": "int64", "BOOL": "bool"}


def torch_dtype(trt_dtype: Any) -> Any:
    """The torch dtype of an engine I/O tensor's `trt.DataType` (or its member name, "BF16"); ValueError in one
    line for a type the engine's buffers cannot hold (FP8, INT4, FP4)."""
    import torch

    name = str(getattr(trt_dtype, "name", trt_dtype)).rsplit(".", 1)[-1]
    if name not in TORCH_DTYPES:
        raise ValueError(f"engine I/O of TensorRT type {name} is not supported (expected one of "
                         f"{', '.join(TORCH_DTYPES)})")
    return getattr(torch, TORCH_DTYPES[name])


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", version)[:4])


def version_refusal(file: str, built_with: str | None, installed: str) -> str | None:
    """Why the engine `file`, built with TensorRT `built_with` (its manifest's; None: not recorded), cannot load
    in the installed TensorRT `installed`, or None. A plan never loads in an older TensorRT than built it."""
    if not built_with or _version_key(built_with) <= _version_key(installed):
        return None
    return (f"{file} was built with TensorRT {built_with}, newer than the installed TensorRT {installed}: install "
            f"tensorrt=={built_with} or rebuild the engine with this one (vit-export --format tensorrt)")


class TensorRTEngine:
    """One deserialized engine with its execution context and CUDA stream: `run(x)` with x [B, 3, H, W] float32
    numpy -> {output name: float32 numpy}; batches over the optimisation profile's maximum run in chunks."""

    def __init__(self, path: str | Path, runtime: Any = None, built_with: str | None = None) -> None:
        """built_with: the TensorRT version the engine's manifest records, checked before deserializing."""
        import tensorrt as trt
        import torch

        path = Path(path)
        installed = str(trt.__version__)
        refusal = version_refusal(path.name, built_with, installed)
        if refusal:
            raise ValueError(refusal)
        self.torch = torch
        runtime = runtime or trt.Runtime(trt.Logger(trt.Logger.WARNING))
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            built = f"built with TensorRT {built_with}" if built_with else "built with another TensorRT version"
            raise ValueError(f"TensorRT {installed} cannot deserialize {path.name} ({built}, or on another GPU? "
                             "rebuild it on this machine)")
        self.engine = engine
        self.context = engine.create_execution_context()
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        if PIXEL_VALUES not in names:
            raise ValueError(f"{path.name} has no input named {PIXEL_VALUES!r} (inputs: {names})")
        self.dtypes = {n: torch_dtype(engine.get_tensor_dtype(n)) for n in names}
        shape = engine.get_tensor_shape(PIXEL_VALUES)
        self.max_batch = shape[0] if shape[0] > 0 else engine.get_tensor_profile_shape(PIXEL_VALUES, 0)[2][0]
        self.stream = torch.cuda.Stream()

    def run(self, x: np.ndarray) -> dict[str, np.ndarray]:
        parts = [self._run(x[i:i + self.max_batch]) for i in range(0, x.shape[0], self.max_batch)]
        return {k: np.concatenate([p[k] for p in parts]) for k in self.outputs}

    def _run(self, x: np.ndarray) -> dict[str, np.ndarray]:
        torch = self.torch
        with torch.cuda.stream(self.stream):
            xin = torch.from_numpy(x).to("cuda", non_blocking=True).to(self.dtypes[PIXEL_VALUES])
            self.context.set_input_shape(PIXEL_VALUES, tuple(xin.shape))
            self.context.set_tensor_address(PIXEL_VALUES, xin.data_ptr())
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
