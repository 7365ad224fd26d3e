"""Serving backends, one module each, behind `base.Backend`.

`load(spec)` (`vit_serve.runtime.load`) picks and builds one for a `LoadSpec` (`runtime.spec`: which backend a
path means, and the checks made before loading). Each backend's module is imported only when it is loaded.

- `base`: what every backend provides (`Backend`, `LocalBackend`, `RemoteBackend`, `ModelInfo`).
- `torch`: a checkpoint in PyTorch (eager, `torch.compile` or a TorchScript trace); the only one with gradient
  rollout.
- `onnxruntime`: an ONNX export and its explain graph.
- `openvino`: an ONNX export or an OpenVINO IR on OpenVINO's CPU plugin (bf16 where the CPU has it, int8 graphs),
  behind the accuracy gate (`runtime.accuracy_gate`).
- `tensorrt`: a serialized TensorRT engine.
- `triton`: a model on a Triton Inference Server (tritonclient, asyncio).
- `ray`: a model version in its own Ray Serve deployment.
- `sidecar`: the manifest beside an export -> `ModelInfo`.
- `choice`: which backend serves a file that several can, chosen by measurement at load.
"""

from __future__ import annotations

import dataclasses

from vit_serve.runtime.backends import choice
from vit_serve.runtime.backends.base import Backend, ModelInfo
from vit_serve.runtime.errors import BackendUnavailableError
from vit_serve.runtime.spec import LoadSpec, check

__all__ = ["Backend", "BackendUnavailableError", "LoadSpec", "ModelInfo", "check", "load"]


def load(spec: LoadSpec) -> Backend:
    """Load the model behind its backend (not yet warmed up); `spec.decode` overrides the contract's decode path
    (what the gateway decodes with, and what /v2 metadata shows)."""
    backend = _load_backend(spec)
    if spec.decode is not None and backend.info.preprocess.decode != spec.decode:
        pre = backend.info.preprocess.with_decode(spec.decode)
        backend.info = dataclasses.replace(backend.info, preprocess=pre)
    return backend


def _build(spec: LoadSpec, backend: str, precision: str) -> Backend:
    """One contender of `backends.choice`: `spec` on `backend` (its `precision`: what a backend with several runs
    at), no choice of its own."""
    if backend == "openvino":
        spec = spec.replace(precision=choice.openvino_precision(precision))
    return _load_backend(spec.replace(backend=backend, choose_runtime=False, pin_runtime=None))


def _load_backend(spec: LoadSpec) -> Backend:
    if spec.engine == "ray":  # the model runs in its own Ray Serve deployment (vit_serve.deploy.ray)
        from vit_serve.runtime.backends.ray import RayModelBackend

        return RayModelBackend(spec)
    backend = check(spec)
    if choice.wanted(spec):  # several runtimes serve this file: the fastest that passes (`backends.choice`)
        return choice.choose_backend(spec, _build)
    if backend == "torch":
        from vit_serve.runtime.backends.torch import TorchBackend

        return TorchBackend(spec.path, spec.name, spec.device, spec.threads, spec.tome, compile=spec.compile,
                            torchscript=spec.torchscript, compile_precision=spec.compile_precision,
                            force_precision=spec.force_precision,
                            choose=spec.choose_runtime and spec.backend == "auto", pin=spec.pin_runtime,
                            choice_budget_s=spec.choice_budget_s, max_batch=spec.limits.max_batch,
                            spinning=spec.spinning)
    if backend == "onnxruntime":
        from vit_serve.runtime.backends.onnxruntime import OnnxRuntimeBackend

        return OnnxRuntimeBackend(spec.path, spec.name, spec.device, spec.threads, spec.spinning)
    if backend == "openvino":
        from vit_serve.runtime.backends.openvino import OpenVINOBackend, OpenVINOOptions

        options = OpenVINOOptions(spec.precision, spec.performance_hint, spec.streams, spec.threads, spec.cache_dir,
                                  spec.force_precision)
        return OpenVINOBackend(spec.path, spec.name, options)
    if backend == "tensorrt":
        from vit_serve.runtime.backends.tensorrt import TensorRTBackend

        return TensorRTBackend(spec.path, spec.name)
    from vit_serve.runtime.backends.triton import TritonBackend

    return TritonBackend(spec.path, spec.triton, max_queue=spec.limits.max_queue, trace=spec.trace)
