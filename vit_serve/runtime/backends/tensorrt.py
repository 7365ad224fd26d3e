"""The TensorRT backend: a serialized engine (`<name>.engine` / `.plan`) with its sidecar `<name>.json` (same keys
as the ONNX sidecar: resolution, preprocess, labels, architecture, io), and optionally `<name>_explain.engine`
with `<name>_explain.json` (logits + rollout, rollout settings fixed at build time); without one, the explain ONNX
graph the engine's export came with (named by its sidecar's `source_onnx`) runs in onnxruntime.

Needs a CUDA GPU, the `tensorrt` package (10.x or 11.x: named I/O tensors, `execute_async_v3`) and PyTorch with CUDA
(device buffers are torch tensors). Both are imported lazily; without them the server refuses to start with a
one-line reason. Batches larger than the engine's optimisation profile allows are run in chunks. An engine whose
manifest records a newer TensorRT than the installed one is refused in one line naming both (a plan never loads in
an older TensorRT).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from vit_serve.manifest import LOGITS, PIXEL_VALUES, ROLLOUT, RolloutSettings, manifest_path, read_manifest
from vit_serve.runtime.backends.base import LocalBackend
from vit_serve.runtime.backends.onnxruntime import session_providers
from vit_serve.runtime.backends.sidecar import check_bytes, read_export
from vit_serve.tensorrt_engine import TensorRTEngine


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


def built_with(engine: Path) -> str | None:
    """The TensorRT version the engine's manifest records (`TensorRTBuild.version`), None without one."""
    if not manifest_path(engine).is_file():
        return None
    build = read_manifest(engine).tensorrt
    return None if build is None else build.version


class _OnnxExplain:
    """The export's explain ONNX graph run by onnxruntime (CUDA provider when present), for engines built without
    one: `run(x)` -> {"logits", "rollout"} like an engine."""

    def __init__(self, path: Path) -> None:
        import onnxruntime as ort

        self.session = ort.InferenceSession(str(path), providers=session_providers("auto"))
        self.input_dtype = np.float16 if "float16" in self.session.get_inputs()[0].type else np.float32

    def run(self, x: np.ndarray) -> dict[str, np.ndarray]:
        logits, heat = self.session.run([LOGITS, ROLLOUT], {PIXEL_VALUES: x.astype(self.input_dtype, copy=False)})
        return {LOGITS: logits, ROLLOUT: heat}


class TensorRTBackend(LocalBackend):
    name = "tensorrt"
    concurrent = False  # one execution context: one batch at a time

    def __init__(self, engine_path: str | Path, model_name: str | None = None) -> None:
        path = Path(engine_path)
        self.info, explain = read_export(path, model_name, self.name, "engine")
        check_bytes(path, explain)
        trt = require_tensorrt()
        self._logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(self._logger)
        self.engine = TensorRTEngine(path, runtime, built_with(path))
        self.explain_engine: TensorRTEngine | _OnnxExplain | None = None
        if explain is not None:
            self.explain_engine = (_OnnxExplain(explain) if explain.suffix == ".onnx"
                                   else TensorRTEngine(explain, runtime, built_with(explain)))

    def classify(self, x: np.ndarray) -> np.ndarray:
        return self.engine.run(x)[LOGITS]

    def explain(self, x: np.ndarray, rollout: RolloutSettings | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The explain graph, whose rollout settings are its own."""
        if self.explain_engine is None:
            raise NotImplementedError(f"no explain engine beside {Path(self.info.source).name}")
        out = self.explain_engine.run(x)
        return out[LOGITS], out[ROLLOUT]
