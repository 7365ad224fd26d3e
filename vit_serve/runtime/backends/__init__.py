"""Serving backends, one module each (torch, onnxruntime, tensorrt, triton), behind `base.Backend`.

`create_backend(settings)` picks and builds one; `resolve_backend` says which `--backend auto` means for a MODEL:
`.onnx` -> onnxruntime, `.engine` / `.plan` / `.trt` -> tensorrt, anything else -> torch (a checkpoint file,
folder or hub id). A model on a Triton server needs `--backend triton` (MODEL is then its name there). With
`engine="ray"` (the gateway as a Ray Serve ingress, `vit_serve.deploy.ray`) every model is a `ray.RayModelBackend`:
a handle on the Ray Serve deployment that loads it with the backend above.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from vit_serve.runtime.backends.base import Backend, BackendUnavailableError, ModelInfo
from vit_serve.runtime.discovery import CHECKPOINT_SUFFIXES, ENGINE_SUFFIXES
from vit_serve.serve.settings import ServeSettings

__all__ = ["Backend", "BackendUnavailableError", "ModelInfo", "check_model", "create_backend", "resolve_backend"]



def resolve_backend(settings: ServeSettings) -> str:
    if settings.backend != "auto":
        return settings.backend
    suffix = Path(settings.model).suffix.lower()
    if suffix == ".onnx":
        return "onnxruntime"
    if suffix in ENGINE_SUFFIXES:
        return "tensorrt"
    return "torch"


def check_model(settings: ServeSettings) -> str:
    """Cheap checks before the server starts (so that the CLI can fail with one line); returns the backend name."""
    if not settings.model:
        if settings.backend == "triton":
            return "triton"  # every ViT model of the Triton server
        raise ValueError("no model given: pass REPO (a folder of models) or MODEL (a checkpoint, NAME.onnx, an "
                         "engine; with --backend triton a model name there, or none for all) or set "
                         "VIT_SERVE_MODEL")
    backend = resolve_backend(settings)
    path = Path(settings.model)
    is_file = backend in ("onnxruntime", "tensorrt") or path.suffix.lower() in CHECKPOINT_SUFFIXES
    if backend != "triton" and is_file and not path.exists():
        raise FileNotFoundError(f"no such file: {path}")
    if backend == "onnxruntime" and path.suffix.lower() != ".onnx":
        raise ValueError(f"--backend onnxruntime serves an exported NAME.onnx (with NAME.json), not {path.name}")
    if backend == "tensorrt":
        from vit_serve.runtime.backends.tensorrt import require_tensorrt

        require_tensorrt()
    return backend


def create_backend(settings: ServeSettings) -> Backend:
    """Load the model behind the configured backend (not yet warmed up); `settings.decode` overrides the
    contract's decode path (what the gateway decodes with, and what /v2 metadata shows)."""
    backend = _load_backend(settings)
    if settings.decode is not None and backend.info.preprocess.decode != settings.decode:
        pre = backend.info.preprocess.with_decode(settings.decode)
        backend.info = dataclasses.replace(backend.info, preprocess=pre)
    return backend


def _load_backend(settings: ServeSettings) -> Backend:
    if settings.engine == "ray":  # the model runs in its own Ray Serve deployment (vit_serve.deploy.ray)
        from vit_serve.runtime.backends.ray import RayModelBackend

        return RayModelBackend(settings)
    backend = check_model(settings)
    if backend == "torch":
        from vit_serve.runtime.backends.torch import TorchBackend

        return TorchBackend(settings.model, settings.model_name, settings.device, settings.threads)
    if backend == "onnxruntime":
        from vit_serve.runtime.backends.onnxruntime import OnnxRuntimeBackend

        return OnnxRuntimeBackend(settings.model, settings.model_name, settings.device, settings.threads)
    if backend == "tensorrt":
        from vit_serve.runtime.backends.tensorrt import TensorRTBackend

        return TensorRTBackend(settings.model, settings.model_name)
    from vit_serve.runtime.backends.triton import TritonBackend

    return TritonBackend(settings.model, settings.triton_url, settings)
