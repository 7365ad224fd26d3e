"""The runtime's settings groups: `RunnerLimits` (batching, queue, timeouts), `TritonClientSettings` (the Triton
backend's client) and `RepositorySettings` (which models and versions are served, and how they change).

Each group reads its own `VIT_SERVE_<FIELD>` variables (the names are flat: VIT_SERVE_MAX_BATCH; ServeSettings
also reads the deprecated VIT_SERVE_LIMITS__MAX_BATCH, with a warning) and is nested in
`vit_serve.serve.settings.ServeSettings`; a `Flag` marks the fields that `vit-serve serve` has a flag for
(`vit_serve.cli.flags`). Also the default size of a decode pool (`default_decode_workers`), the gateway's and
offline prediction's.
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from vit_serve.flag import Flag
from vit_serve.runtime.discovery import VersionPolicy, parse_shadow, parse_weights

# At most this many decode threads by default: each holds one full-size decode at a time, so this (with
# max_pixels) bounds the gateway's decode memory whatever the core count.
DECODE_WORKERS_CAP = 4
# At least two: a decode thread holds the GIL between libjpeg / resize calls, so a second one fills those gaps.
# Measured on 2 cores (benchmarks/serve_load.py, ViT-Ti/16, unique 12 MP JPEGs, fast path, concurrency 16):
# 22.7 images/s with two decode threads against 14.6 with one, small photos no slower.
DECODE_WORKERS_MIN = 2


def available_cpus() -> int:
    """Cores this process may run on (its CPU affinity, as a container's limit sets it), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS, Windows)
        return max(1, os.cpu_count() or 1)


def default_decode_workers(cpus: int, threads: int | None, device: str) -> int:
    """Decode threads that leave the model its cores: ``max(2, min(4, cpus - model threads))``.

    The model's threads are ``threads`` when set; unset, one on CUDA (the thread feeding the GPU), and on the
    CPU half the cores, rounded up (the runtime's own default would take them all). E.g. 2 cores -> 2 decode
    threads (the floor), 16 cores -> 4, 8 cores with threads=6 -> 2. "auto" counts as the CPU.
    """
    if device == "cuda":
        model = 1 if threads is None else threads
    else:
        model = threads if threads is not None else cpus - cpus // 2
    return max(DECODE_WORKERS_MIN, min(DECODE_WORKERS_CAP, cpus - model))


def env_list(v: object, sep: str = ",") -> object:
    """A list setting from the environment: a JSON list, or entries separated by `sep` (blanks dropped); any
    other value as it is."""
    if isinstance(v, str):
        if v.lstrip().startswith("["):
            return json.loads(v)
        return [p.strip() for p in v.split(sep) if p.strip()]
    return v


# Every group: VIT_SERVE_<FIELD>, no unknown names, fields may start with model_.
GROUP_CONFIG = SettingsConfigDict(env_prefix="VIT_SERVE_", extra="forbid", protected_namespaces=())


class RunnerLimits(BaseSettings):
    """Dynamic batching and back-pressure: coalesce up to max_batch images or max_delay_ms (max_batch 1 or delay
    0 turns it off; with batch_curve, no more than the model's measured batch curve says pays), at most max_queue
    requests waiting, each answered within request_timeout_s."""

    model_config = GROUP_CONFIG

    max_batch: Annotated[int, Flag(section="model")] = Field(
        16, ge=1, description="largest batch the model runs")
    max_delay_ms: Annotated[float, Flag(section="model")] = Field(
        5.0, ge=0, description="longest wait for a batch to fill, from its first request")
    max_queue: Annotated[int, Flag(section="model")] = Field(
        256, ge=1, description="requests waiting for the model; beyond it answers 503")
    request_timeout_s: float = Field(30.0, gt=0, description="queue + inference time before answering 504")
    retry_after_s: int = Field(1, ge=1, description="Retry-After sent with 503 when the queue is full")
    max_images_per_request: Annotated[int, Flag(section="model")] = Field(
        0, ge=0, description="images one /v2 or gRPC inference request may carry (BYTES elements, or pixel_values "
        "rows), checked from the tensor's shape before anything is decoded (400 beyond); 0: the model's "
        "max_batch. Above max_batch, a request runs as several batches")

    instances: Annotated[int, Flag(section="model")] = Field(
        1, ge=1, description="copies of the model's execution that run batches at once (Triton's instance_group "
        "count): on a CPU, n instances of cores / n intra-op threads each keep the cores busy where one instance's "
        "threads wait on each other")

    batch_curve: Annotated[bool, Flag(section="model")] = Field(
        True, description="measure the model's time per image at batch 1, 2, 4, ... max_batch when a version "
        "warms up (vit_serve.runtime.batch_curve), then batch no larger than pays and wait for a batch to fill "
        "only where it pays; off: max_batch and max_delay_ms as given")
    batch_curve_budget_s: float = Field(10.0, gt=0, description="longest time the batch curve's measurement may "
                                        "take at warm-up (three rounds of 1, 2, 4, ... max_batch images: about "
                                        "3 s for a ViT-S/16 on 2 cores); the sizes it leaves unmeasured are not "
                                        "batched")

    @property
    def batching(self) -> bool:
        """Whether concurrent requests are coalesced (max_batch > 1 and max_delay_ms > 0)."""
        return self.max_batch > 1 and self.max_delay_ms > 0


class TritonClientSettings(BaseSettings):
    """How the Triton backend reaches its server (`--backend triton`)."""

    model_config = GROUP_CONFIG

    triton_url: Annotated[str, Flag(section="triton")] = Field(
        "localhost:8000", description="Triton server host:port (HTTP) for --backend triton")
    triton_timeout_s: Annotated[float, Flag(section="triton", hidden=True)] = Field(
        10.0, gt=0, description="longest wait for one Triton call (inference, health) before answering 504; the "
        "others in flight are not affected")
    triton_startup_timeout_s: Annotated[float, Flag(section="triton", hidden=True)] = Field(
        30.0, ge=0, description="how long start-up waits for the Triton server and model to be ready")


class RepositorySettings(BaseSettings):
    """Which models of the repository are served, at which versions, and how the set changes."""

    model_config = GROUP_CONFIG

    default_model: Annotated[str | None, Flag()] = Field(
        None, description="the model of requests that name none (default: the only model of REPO)")
    model_control: Annotated[Literal["none", "poll", "explicit"], Flag()] = Field(
        "none", description="Triton's model control modes: none (load REPO at start), poll (and follow its "
        "changes), explicit (load what --load-model and the repository API say)")
    repository_poll_s: Annotated[float, Flag(hidden=True)] = Field(
        15.0, gt=0, description="seconds between scans of REPO with --model-control poll")
    unload_grace_s: Annotated[float, Flag(hidden=True)] = Field(
        30.0, ge=0, description="how long an unloaded or replaced version waits for the requests it is "
        "answering; those still in flight then get 503")
    load_models: Annotated[list[str], Flag(name="--load-model",
        metavar="NAME")] = Field(
        default_factory=list, description="--model-control explicit: models to load at start (* for all)")
    version_policy: Annotated[str, Flag(section="model")] = Field(
        "latest:1", description="versions served of each model without a policy of its own (config.toml "
        "version_policy, config.pbtxt): latest, "
        "latest:N, all, or specific:V1,V2")
    repository_api: Annotated[bool, Flag(after="otel")] = Field(
        True, description="serve the repository API (POST /v2/repository/...); off: those routes answer 403")

    traffic: Annotated[list[str], NoDecode, Flag(name="--traffic",
        metavar="NAME=V:W,...")] = Field(
        default_factory=list, description="traffic splits, NAME=V:W,... each (VIT_SERVE_TRAFFIC: a JSON list, or "
        "entries separated by ';'): the versions named are loaded too, and requests naming no version go to one "
        "of them by weight (sticky per X-Session-Id)")
    shadow: Annotated[list[str], NoDecode, Flag(name="--shadow", metavar="NAME=V[:SHARE]")] = Field(
        default_factory=list, description="shadow versions, NAME=V[:SHARE] each (VIT_SERVE_SHADOW as for "
        "traffic): a sampled share (percent, default 100) of the primary's requests also runs on V, off the "
        "answer's path and shed first; the pairs are compared (GET /models/NAME/compare)")
    compare_window: int = Field(1000, ge=1, description="request pairs (primary and shadow / canary) kept per "
                                "model and version for the agreement numbers (GET /models/NAME/compare)")

    @field_validator("version_policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        return str(VersionPolicy.parse(v))

    @field_validator("traffic", "shadow", mode="before")
    @classmethod
    def _entries(cls, v: object) -> object:
        return env_list(v, ";")  # the entries hold commas themselves

    @field_validator("traffic", "shadow")
    @classmethod
    def _named(cls, v: list[str], info: object) -> list[str]:
        what = getattr(info, "field_name", "traffic")
        names: set[str] = set()
        for item in v:
            name, sep, spec = item.partition("=")
            if not sep or not name.strip():
                raise ValueError(f"--{what} {item!r}: expected NAME={'V:W,...' if what == 'traffic' else 'V[:SHARE]'}")
            if name.strip() in names:
                raise ValueError(f"--{what}: model {name.strip()!r} is named twice")
            names.add(name.strip())
            (parse_weights if what == "traffic" else parse_shadow)(spec)
        return v

    @property
    def traffic_weights(self) -> dict[str, dict[int, float]]:
        """--traffic by model: {name: {version: weight}}."""
        return {n.strip(): parse_weights(spec) for n, _, spec in (t.partition("=") for t in self.traffic)}

    @property
    def shadows(self) -> dict[str, tuple[int, float]]:
        """--shadow by model: {name: (version, share in percent)}."""
        return {n.strip(): parse_shadow(spec) for n, _, spec in (t.partition("=") for t in self.shadow)}
