"""Triton `config.pbtxt` files built from Triton's own schema (`model_config.proto`, shipped by tritonclient).

Every config is a `ModelConfig` message printed with protobuf's text format, so a field Triton does not know
cannot be written, and `parse` reads a config back with the same schema.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf import text_format

INSTANCE_KINDS = ("cpu", "gpu")


def schema() -> Any:
    """The `model_config_pb2` module (Triton's ModelConfig protobuf), or ImportError saying what to install."""
    try:
        from tritonclient.grpc import model_config_pb2
    except ImportError as e:
        raise ImportError(
            f"writing a Triton model repository needs tritonclient[grpc] ({e}); pip install 'vit-serve[triton]'"
        ) from e
    return model_config_pb2


@dataclass(frozen=True)
class Tensor:
    """One input or output: name, Triton data type ("TYPE_FP32", "TYPE_STRING"), dims WITHOUT the batch axis."""

    name: str
    data_type: str
    dims: tuple[int, ...]
    label_filename: str | None = None


@dataclass(frozen=True)
class Batching:
    """Dynamic batching: up to `max_batch` per execution, waiting at most `queue_delay_us` to fill a preferred
    size; at most `max_queue` requests wait (more are rejected at once: a bounded queue, not a growing one)."""

    max_batch: int = 16
    queue_delay_us: int = 1000
    max_queue: int = 128

    def __post_init__(self) -> None:
        for key in ("max_batch", "max_queue"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.queue_delay_us < 0:
            raise ValueError(f"queue_delay_us must be >= 0, got {self.queue_delay_us}")

    @property
    def preferred(self) -> list[int]:
        """Half the maximum and the maximum (one size when they coincide)."""
        return sorted({max(1, self.max_batch // 2), self.max_batch})


def _tensor(msg: Any, t: Tensor) -> None:
    pb = schema()
    msg.name = t.name
    msg.data_type = pb.DataType.Value(t.data_type)
    msg.dims.extend(t.dims)
    if t.label_filename:
        msg.label_filename = t.label_filename


def model_config(
    name: str,
    inputs: list[Tensor],
    outputs: list[Tensor],
    batching: Batching,
    *,
    platform: str | None = None,
    backend: str | None = None,
    instances: int = 1,
    kind: str = "cpu",
    warmup: list[dict[str, Any]] | None = None,
    parameters: dict[str, str] | None = None,
    cc_model_filenames: dict[str, str] | None = None,
) -> Any:
    """A ModelConfig for a model Triton executes itself (not an ensemble).

    warmup: dicts {"name", "batch_size", "inputs": {input name: {"zero_data"|"random_data": True |
    "input_data_file": file in <model>/warmup/}}}; each input's type and dims are filled in from `inputs`.
    """
    pb = schema()
    if kind not in INSTANCE_KINDS:
        raise ValueError(f"unknown instance kind {kind!r}; expected one of {', '.join(INSTANCE_KINDS)}")
    if instances < 1:
        raise ValueError(f"instances must be >= 1, got {instances}")
    cfg = pb.ModelConfig(name=name, max_batch_size=batching.max_batch)
    if platform:
        cfg.platform = platform
    if backend:
        cfg.backend = backend
    cfg.version_policy.latest.num_versions = 1
    for t in inputs:
        _tensor(cfg.input.add(), t)
    for t in outputs:
        _tensor(cfg.output.add(), t)
    db = cfg.dynamic_batching
    db.preferred_batch_size.extend(batching.preferred)
    db.max_queue_delay_microseconds = batching.queue_delay_us
    db.default_queue_policy.max_queue_size = batching.max_queue
    db.default_queue_policy.timeout_action = pb.ModelQueuePolicy.REJECT
    db.default_queue_policy.allow_timeout_override = True
    group = cfg.instance_group.add(count=instances)
    group.kind = pb.ModelInstanceGroup.KIND_GPU if kind == "gpu" else pb.ModelInstanceGroup.KIND_CPU
    by_name = {t.name: t for t in inputs}
    for w in warmup or []:
        sample = cfg.model_warmup.add(name=w["name"], batch_size=w["batch_size"])
        for input_name, source in w["inputs"].items():
            t = by_name[input_name]
            wi = sample.inputs[input_name]
            wi.data_type = pb.DataType.Value(t.data_type)
            wi.dims.extend(t.dims)
            if source.get("zero_data"):
                wi.zero_data = True
            elif source.get("random_data"):
                wi.random_data = True
            else:
                wi.input_data_file = source["input_data_file"]
    for key, value in (parameters or {}).items():
        cfg.parameters[key].string_value = value
    for cc, file in (cc_model_filenames or {}).items():
        cfg.cc_model_filenames[cc] = file
    return cfg


def ensemble_config(
    name: str,
    inputs: list[Tensor],
    outputs: list[Tensor],
    max_batch: int,
    steps: list[tuple[str, dict[str, str], dict[str, str]]],
    parameters: dict[str, str] | None = None,
) -> Any:
    """An ensemble: steps are (model name, {model input: ensemble tensor}, {model output: ensemble tensor})."""
    pb = schema()
    cfg = pb.ModelConfig(name=name, platform="ensemble", max_batch_size=max_batch)
    for t in inputs:
        _tensor(cfg.input.add(), t)
    for t in outputs:
        _tensor(cfg.output.add(), t)
    for model, input_map, output_map in steps:
        step = cfg.ensemble_scheduling.step.add(model_name=model, model_version=-1)
        step.input_map.update(input_map)
        step.output_map.update(output_map)
    for key, value in (parameters or {}).items():
        cfg.parameters[key].string_value = value
    return cfg


def to_text(cfg: Any) -> str:
    """The config.pbtxt text of a ModelConfig."""
    return text_format.MessageToString(cfg)


def parse(text: str) -> Any:
    """A config.pbtxt text -> ModelConfig (google.protobuf.text_format.ParseError if Triton would reject it)."""
    return text_format.Parse(text, schema().ModelConfig())


def io_signature(cfg: Any) -> dict[str, list[tuple[str, str, tuple[int, ...]]]]:
    """What a client sees of a model: inputs and outputs as (name, data type, dims), batch support aside."""
    pb = schema()

    def sig(ts: Any) -> list[tuple[str, str, tuple[int, ...]]]:
        return [(t.name, pb.DataType.Name(t.data_type), tuple(t.dims)) for t in ts]

    return {"inputs": sig(cfg.input), "outputs": sig(cfg.output)}
