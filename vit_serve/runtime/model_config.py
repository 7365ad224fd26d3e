"""A model's own configuration (`ModelConfig`): its batching and queue limits, instances, compute, decoding and
monitoring, read from `REPO/NAME/config.toml` and from a Triton `config.pbtxt` (`discovery.read_triton_config`).

Every field is None unless the model sets it: None takes the server's value (`vit-serve serve`'s "model defaults"
flags, or their VIT_SERVE_* variables). Where a model has both files, they are merged key by key and
config.toml wins. A config.toml holds these field names at its top level, e.g.

    max_batch = 8
    max_delay_ms = 2.0
    instances = 2
    threads = 1
    runtime = "openvino"  # what runs its ONNX exports: onnxruntime (NAME.onnx's default) or openvino
    precision = "auto"    # openvino: auto, f32, bf16, f16, int8 (behind the accuracy gate)
    decode = "exact"
    monitoring = false
    replicas = 2          # on Ray Serve (--engine ray): this model's deployment
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol, TypeVar

from pydantic import Field, TypeAdapter, ValidationError

from vit_serve.tome_schedule import parse_tome


class _Limits(Protocol):
    """What `over` needs of the server's `runtime.settings.RunnerLimits` (a pydantic model)."""

    def model_copy(self: L, *, update: dict[str, Any] | None = None) -> L: ...


class _Spec(Protocol):
    """What `spec` needs of a `runtime.spec.LoadSpec`."""

    def replace(self: S, **changes: Any) -> S: ...


L = TypeVar("L", bound=_Limits)
S = TypeVar("S", bound=_Spec)
MODEL_CONFIG = "config.toml"  # REPO/NAME/config.toml

# The fields `over` applies to the server's `RunnerLimits` (a 0 of the first three is none, as in config.pbtxt).
_LIMITS = ("max_batch", "max_delay_ms", "max_queue", "instances", "request_timeout_s", "retry_after_s",
           "max_images_per_request", "batch_curve", "batch_curve_budget_s")
_ZERO_IS_NONE = ("max_batch", "max_queue", "instances")


@dataclass(frozen=True)
class ModelConfig:
    """A model's own settings (None: the server's). Limits and batching: max_batch, max_delay_ms, max_queue,
    request_timeout_s, retry_after_s, max_images_per_request, batch_curve, batch_curve_budget_s; instances;
    compute: threads, intra_op_spinning, device, compile, compile_precision, torchscript, tome, choose_runtime,
    choose_runtime_budget_s, pin_runtime; the runtime of its exports (onnxruntime or openvino) and OpenVINO's
    precision, performance_hint, streams and force_precision (also --compile's bf16); decode ("fast", "exact" or
    "contract"); monitoring (OOD scores and drift on or off) and drift_window; version_policy (which versions are
    served); on Ray Serve, its deployment's replicas, max_replicas (autoscaling), replica_cpus and replica_gpus
    (`deployment`). Each means what the server setting of the same name means."""

    max_batch: Annotated[int, Field(ge=0)] | None = None
    max_delay_ms: Annotated[float, Field(ge=0)] | None = None
    max_queue: Annotated[int, Field(ge=0)] | None = None
    instances: Annotated[int, Field(ge=0)] | None = None
    request_timeout_s: Annotated[float, Field(gt=0)] | None = None
    retry_after_s: Annotated[int, Field(ge=1)] | None = None
    max_images_per_request: Annotated[int, Field(ge=0)] | None = None
    batch_curve: bool | None = None
    batch_curve_budget_s: Annotated[float, Field(gt=0)] | None = None
    threads: Annotated[int, Field(ge=1)] | None = None
    intra_op_spinning: bool | None = None
    device: Literal["auto", "cpu", "cuda"] | None = None
    compile: bool | None = None
    compile_precision: Literal["fp32", "bf16", "auto"] | None = None
    torchscript: bool | None = None
    choose_runtime: bool | None = None
    choose_runtime_budget_s: Annotated[float, Field(gt=0)] | None = None
    pin_runtime: str | None = None
    tome: str | None = None
    runtime: Literal["onnxruntime", "openvino"] | None = None
    precision: Literal["auto", "f32", "bf16", "f16", "int8"] | None = None
    performance_hint: Literal["latency", "throughput"] | None = None
    streams: Annotated[int, Field(ge=1)] | None = None
    force_precision: bool | None = None
    decode: Literal["fast", "exact", "contract"] | None = None
    monitoring: bool | None = None
    drift_window: Annotated[int, Field(ge=1)] | None = None
    version_policy: str | None = None  # `discovery.VersionPolicy.parse`'s forms, as config.pbtxt's version_policy
    # Ray Serve (--engine ray): the model's deployment, as Ray Serve keeps them per deployment.
    replicas: Annotated[int, Field(ge=1)] | None = None
    max_replicas: Annotated[int, Field(ge=1)] | None = None
    replica_cpus: Annotated[float, Field(ge=0)] | None = None
    replica_gpus: Annotated[float, Field(ge=0)] | None = None

    def __post_init__(self) -> None:
        if self.tome is not None:
            parse_tome(self.tome)  # ValueError: the accepted forms

    def given(self) -> dict[str, Any]:
        """The fields this model sets (not None)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def merged_over(self, base: ModelConfig) -> ModelConfig:
        """`base` (a config.pbtxt's) with this one's fields in their place (config.toml wins)."""
        return dataclasses.replace(base, **self.given())

    def over(self, limits: L) -> L:
        """`limits` (the server's `runtime.settings.RunnerLimits`) with this model's own values in their place (a
        max_batch, max_queue or instances of 0 is none)."""
        own = {k: getattr(self, k) for k in _LIMITS}
        own.update({k: own[k] or None for k in _ZERO_IS_NONE})
        return limits.model_copy(update={k: v for k, v in own.items() if v is not None})

    def spec(self, spec: S) -> S:
        """`spec` (the server's, for this model) with this model's compute and decoding in their place."""
        compute = ("threads", "compile", "compile_precision", "torchscript", "device", "runtime", "precision",
                   "performance_hint", "streams", "force_precision", "choose_runtime", "pin_runtime")
        changes: dict[str, Any] = {k: getattr(self, k) for k in compute if getattr(self, k) is not None}
        if self.choose_runtime_budget_s is not None:
            changes["choice_budget_s"] = self.choose_runtime_budget_s
        if self.intra_op_spinning is not None:
            changes["spinning"] = self.intra_op_spinning
        if self.tome is not None:
            changes["tome"] = parse_tome(self.tome)
        if self.decode is not None:
            changes["decode"] = None if self.decode == "contract" else self.decode
        return spec.replace(**changes) if changes else spec

    def deployment(self, replicas: int, max_replicas: int | None, cpus: float, gpus: float
                   ) -> tuple[int, int | None, float, float]:
        """(replicas, max_replicas, replica_cpus, replica_gpus) of this model's Ray Serve deployment: its own
        values, else the given (the server's)."""
        own = (self.replicas, self.max_replicas, self.replica_cpus, self.replica_gpus)
        return tuple(v if o is None else o for o, v in zip(own, (replicas, max_replicas, cpus, gpus), strict=True))

    def monitoring_changes(self) -> dict[str, Any]:
        """The server's monitoring settings this model changes (`monitoring`, `drift_window`)."""
        return {k: getattr(self, k) for k in ("monitoring", "drift_window") if getattr(self, k) is not None}


_ADAPTER = TypeAdapter(ModelConfig)
KEYS = tuple(f.name for f in dataclasses.fields(ModelConfig))


def model_config_of(values: dict[str, Any], where: str) -> ModelConfig:
    """A `ModelConfig` of `values` (a config.toml's table); ValueError naming `where` and the key at fault."""
    unknown = sorted(set(values) - set(KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key {', '.join(map(repr, unknown))} (a model's config.toml sets "
                         f"{', '.join(KEYS)})")
    try:
        return _ADAPTER.validate_python(values)
    except ValidationError as e:
        first = e.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        msg = first["msg"].removeprefix("Value error, ")
        raise ValueError(f"{where}: {key}: {msg}" if key else f"{where}: {msg}") from None


def read_model_config(path: Path) -> ModelConfig:
    """The `ModelConfig` of a config.toml; ValueError naming the file when it is unreadable or holds a wrong
    value."""
    try:
        values = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{path}: not a readable TOML file ({' '.join(str(e).split())})") from e
    return model_config_of(values, str(path))
