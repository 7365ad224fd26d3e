"""What loading one model needs (`LoadSpec`), and which backend a spec means (`resolve_backend`, `check`).

`vit_serve.runtime.load(spec)` (`runtime.backends.load`) builds the backend. `--backend auto` means, for a path:
`.onnx` -> onnxruntime, `.xml` (an OpenVINO IR) -> openvino, `.engine` / `.plan` / `.trt` -> tensorrt, anything
else -> torch (a checkpoint file, folder or hub id); `--backend openvino` also serves NAME.onnx. A model on a
Triton server needs backend "triton" (the path is then its name there, "" for all of them). With engine "ray" the
backend is a handle on the Ray Serve deployment that loads the model with the backend above
(`vit_serve.deploy.ray`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from vit_serve.runtime.discovery import CHECKPOINT_SUFFIXES, ENGINE_SUFFIXES
from vit_serve.runtime.settings import RunnerLimits, TritonClientSettings
from vit_serve.tome_schedule import TomeR, parse_tome

BackendChoice = Literal["auto", "torch", "onnxruntime", "openvino", "tensorrt", "triton"]
PrecisionChoice = Literal["auto", "f32", "bf16", "f16", "int8"]


@dataclass(frozen=True)
class LoadSpec:
    """One model to load.

    path: a checkpoint (file, folder or hub id), NAME.onnx (NAME.json beside it), a TensorRT engine, or a Triton
    model name. backend: which runtime serves it ("auto": from the path's suffix). name: the name shown to
    clients (None: the path's stem). device / threads: torch's and onnxruntime's device ("auto", "cpu", "cuda")
    and intra-op threads (None: the runtime's own). decode: the upload decoding path ("fast", "exact"; None: the
    contract's). triton: how the Triton backend reaches its server; limits: the queue the backend is driven with
    (the Triton backend sizes its connection pool by `max_queue`, Ray waits `request_timeout_s`). trace: pass
    the trace context on to Triton (OpenTelemetry). engine: "local" (in this process) or "ray" (a handle on
    the model's Ray Serve deployment, from inside the gateway's Ray Serve ingress). tome: token merging set on
    checkpoints the torch backend loads (`VisionTransformer.set_token_merging`'s r: an int, a list per layer or
    (r, inflection)); exports run the merging they were exported with (`vit-export --tome`). compile: run the
    checkpoint's classify / embed forward through `torch.compile` (inductor; the torch backend only), compiled
    and checked against eager at load (`runtime.backends.torch.compile_forward`); torchscript: through a
    TorchScript trace instead, which runs without Python's GIL (`runtime.backends.torch.torchscript_forward`;
    not both). compile_precision: "fp32", "bf16" (CPU autocast, refused below the bf16 accuracy bounds) or
    "auto" (bf16 where the CPU has it and it passes; `compile_forward`). spinning: onnxruntime's
    intra-op threads spin between parallel sections (`runtime.backends.onnxruntime.session_options`).
    runtime: what runs an ONNX export (onnxruntime or openvino; None: by the file, `resolve_backend`).
    OpenVINO (`runtime.backends.openvino.OpenVINOOptions`): precision ("auto": the plugin's native), performance
    hint, streams, cache_dir (its compiled-model cache; None: the default folder, "": none) and force_precision (serve
    a precision that missed its accuracy bounds).
    choose_runtime: time the runtimes installed for this model at load (within
    `choice_budget_s`, at batch 1 and `limits.max_batch`) and serve the fastest that meets its accuracy bounds
    (`runtime.runtime_choice`); pin_runtime ("runtime" or "runtime:precision", e.g. "onnxruntime", "eager"):
    serve that one, unmeasured.
    """

    path: str
    backend: BackendChoice = "auto"
    name: str | None = None
    device: str = "auto"
    threads: int | None = None
    decode: str | None = None
    triton: TritonClientSettings = field(default_factory=TritonClientSettings)
    limits: RunnerLimits = field(default_factory=RunnerLimits)
    trace: bool = False
    engine: Literal["local", "ray"] = "local"
    tome: TomeR | None = None
    compile: bool = False
    torchscript: bool = False
    spinning: bool = False
    runtime: Literal["onnxruntime", "openvino"] | None = None
    precision: PrecisionChoice = "auto"
    performance_hint: Literal["latency", "throughput"] = "latency"
    streams: int | None = None
    cache_dir: str | None = None
    force_precision: bool = False
    compile_precision: str = "fp32"
    choose_runtime: bool = False
    choice_budget_s: float = 10.0
    pin_runtime: str | None = None

    @classmethod
    def of(cls, settings: SettingsLike, **changes: object) -> LoadSpec:
        """The spec of a gateway's settings (`vit_serve.serve.settings.ServeSettings`: its model, backend, name,
        device, threads, decode, triton and limits groups, otel, engine, tome, compile, compile_precision,
        torchscript, intra_op_spinning, runtime, precision, performance_hint, streams, openvino_cache_dir,
        force_precision, choose_runtime, choose_runtime_budget_s, pin_runtime), with `changes`."""
        spec = cls(path=str(settings.model), backend=settings.backend, name=settings.model_name,
                   device=settings.device, threads=settings.threads, decode=settings.decode,
                   triton=settings.triton, limits=settings.limits, trace=settings.otel, engine=settings.engine,
                   tome=None if settings.tome is None else parse_tome(settings.tome), compile=settings.compile,
                   compile_precision=settings.compile_precision,
                   torchscript=settings.torchscript, spinning=settings.intra_op_spinning,
                   runtime=settings.runtime, precision=settings.precision,
                   performance_hint=settings.performance_hint,
                   streams=settings.streams, cache_dir=settings.openvino_cache_dir,
                   force_precision=settings.force_precision,
                   choose_runtime=settings.choose_runtime, choice_budget_s=settings.choose_runtime_budget_s,
                   pin_runtime=settings.pin_runtime)
        return dataclasses.replace(spec, **changes) if changes else spec

    def replace(self, **changes: object) -> LoadSpec:
        """A copy with `changes` (dataclasses.replace)."""
        return dataclasses.replace(self, **changes)


class SettingsLike(Protocol):
    """What `LoadSpec.of` reads (a `ServeSettings` has it)."""

    model: str
    backend: str
    engine: str
    model_name: str | None
    device: str
    threads: int | None
    decode: str | None
    triton: TritonClientSettings
    limits: RunnerLimits
    otel: bool
    intra_op_spinning: bool
    tome: str | None
    compile: bool
    compile_precision: str
    torchscript: bool
    runtime: str | None
    precision: str
    performance_hint: str
    streams: int | None
    openvino_cache_dir: str | None
    force_precision: bool
    choose_runtime: bool
    choose_runtime_budget_s: float
    pin_runtime: str | None


_COMPILE_REFUSAL = ("--compile runs checkpoints through torch.compile (the torch backend), not {what} ({backend}): "
                    "serve it without --compile")
_TORCHSCRIPT_REFUSAL = ("--torchscript traces checkpoints (the torch backend), not {what} ({backend}): serve it "
                        "without --torchscript")
BOTH_FORWARDS = "--compile and --torchscript both replace the eager forward: choose one"


def resolve_backend(spec: LoadSpec) -> str:
    """The backend `spec.backend` means for its path ("auto": by the suffix); an ONNX export's is `spec.runtime`
    when one is set."""
    suffix = Path(spec.path).suffix.lower()
    if spec.runtime is not None and spec.backend in ("auto", "onnxruntime", "openvino") and suffix == ".onnx":
        return spec.runtime
    if spec.backend != "auto":
        return spec.backend
    if suffix == ".onnx":
        return "onnxruntime"
    if suffix == ".xml":
        return "openvino"
    if suffix in ENGINE_SUFFIXES:
        return "tensorrt"
    return "torch"


def check(spec: LoadSpec) -> str:
    """Cheap checks before anything loads (so that a command can fail with one line); returns the backend name.
    ValueError for no model or the wrong kind of file, FileNotFoundError, OSError without TensorRT."""
    if not spec.path:
        if spec.backend == "triton":
            if spec.compile:
                raise ValueError(_COMPILE_REFUSAL.format(what="the Triton server's models", backend="triton"))
            if spec.torchscript:
                raise ValueError(_TORCHSCRIPT_REFUSAL.format(what="the Triton server's models", backend="triton"))
            return "triton"  # every ViT model of the Triton server
        raise ValueError("no model given: pass REPO (a folder of models) or MODEL (a checkpoint, NAME.onnx, an "
                         "engine; with --backend triton a model name there, or none for all) or set "
                         "VIT_SERVE_MODEL")
    backend = resolve_backend(spec)
    path = Path(spec.path)
    is_file = backend in ("onnxruntime", "openvino", "tensorrt") or path.suffix.lower() in CHECKPOINT_SUFFIXES
    if backend != "triton" and not path.exists():
        from vit_serve.checkpoints.hub import missing_path, parse_hub_id  # lazy: the checkpoint readers are heavy

        if is_file:
            raise FileNotFoundError(f"no such file: {path}")
        if parse_hub_id(str(spec.path)) is None:  # a mistyped path is never a hub download
            raise FileNotFoundError(missing_path(str(spec.path)))
    if spec.tome is not None and (backend != "torch" or path.suffix.lower() in (".onnx", *ENGINE_SUFFIXES)):
        what = path.name or "a Triton model"
        raise ValueError(f"--tome sets token merging on checkpoints (the torch backend); {what} runs the merging "
                         "it was exported with: export it with vit-export --tome R")
    not_checkpoint = backend != "torch" or path.suffix.lower() in (".onnx", ".xml", *ENGINE_SUFFIXES)
    if spec.compile and not_checkpoint:
        raise ValueError(_COMPILE_REFUSAL.format(what=path.name, backend=backend))
    if spec.torchscript and not_checkpoint:
        raise ValueError(_TORCHSCRIPT_REFUSAL.format(what=path.name, backend=backend))
    if spec.compile and spec.torchscript:
        raise ValueError(BOTH_FORWARDS)
    if backend == "onnxruntime" and path.suffix.lower() != ".onnx":
        raise ValueError(f"--backend onnxruntime serves an exported NAME.onnx (with NAME.json), not {path.name}")
    if backend == "openvino":
        if path.suffix.lower() not in (".onnx", ".xml"):
            raise ValueError(f"--backend openvino serves an exported NAME.onnx or an OpenVINO IR NAME.xml (with "
                             f"NAME.json), not {path.name}")
        from vit_serve.runtime.backends.openvino import require_openvino

        require_openvino()
    if backend == "tensorrt":
        from vit_serve.runtime.backends.tensorrt import require_tensorrt

        require_tensorrt()
    return backend
