"""The gateway's one settings class: environment variables `VIT_SERVE_*`, overridden by `vit-serve serve` flags."""

from __future__ import annotations

import json
import os
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

BackendName = Literal["auto", "torch", "onnxruntime", "tensorrt", "triton"]


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


class ServeSettings(BaseSettings):
    """Everything `vit-serve serve` can be told. Each field is also `VIT_SERVE_<FIELD>` (e.g. VIT_SERVE_MAX_BATCH)."""

    model_config = SettingsConfigDict(env_prefix="VIT_SERVE_", extra="forbid", protected_namespaces=())
    _store_secret_made: bool = PrivateAttr(False)

    model: str = Field("", description="REPO: a folder of models (exports, checkpoints, or NAME/VERSION/ folders), "
                                       "or one model: a checkpoint, NAME.onnx, a TensorRT engine, or a Triton "
                                       "model name")
    default_model: str | None = Field(None, description="the model of requests that name none (default: the only "
                                      "model of REPO)")
    model_control: Literal["none", "poll", "explicit"] = Field(
        "none", description="Triton's model control modes: none (load REPO at start), poll (and follow its "
                            "changes), explicit (load what --load-model and the repository API say)")
    repository_poll_s: float = Field(15.0, gt=0, description="seconds between scans of REPO with "
                                     "--model-control poll")
    unload_grace_s: float = Field(30.0, ge=0, description="how long an unloaded or replaced version waits for the "
                                  "requests it is answering; those still in flight then get 503")
    load_models: list[str] = Field(default_factory=list, description="--model-control explicit: models to load "
                                   "at start (* for all)")
    version_policy: str = Field("latest:1", description="versions served of each model without its own "
                                "config.pbtxt policy: latest, latest:N, all, or specific:V1,V2")
    repository_api: bool = Field(True, description="serve the repository API (POST /v2/repository/...); off: "
                                 "those routes answer 403")
    backend: BackendName = Field("auto", description="auto: from MODEL's suffix (.onnx, .engine/.plan, else torch)")
    engine: Literal["local", "ray"] = Field(
        "local", description="where the models run: local (in this process), or ray (each model version a Ray "
                             "Serve deployment that this gateway, a Ray Serve ingress, calls; vit_serve.deploy.ray "
                             "sets it)")
    triton_url: str = Field("localhost:8000", description="Triton server host:port (HTTP) for --backend triton")
    triton_timeout_s: float = Field(10.0, gt=0, description="longest wait for one Triton call (inference, "
                                    "health) before answering 504; the others in flight are not affected")
    triton_startup_timeout_s: float = Field(30.0, ge=0, description="how long start-up waits for the Triton "
                                            "server and model to be ready")
    model_name: str | None = Field(None, description="name shown to clients (default: MODEL's file stem)")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)

    # Dynamic batching: coalesce up to max_batch images or max_delay_ms; max_batch 1 or delay 0 turns it off.
    max_batch: int = Field(16, ge=1, description="largest batch the model runs")
    max_delay_ms: float = Field(5.0, ge=0, description="longest wait for a batch to fill, from its first request")
    max_queue: int = Field(256, ge=1, description="requests waiting for the model; beyond it answers 503")
    request_timeout_s: float = Field(30.0, gt=0, description="queue + inference time before answering 504")
    retry_after_s: int = Field(1, ge=1, description="Retry-After sent with 503 when the queue is full")

    # Untrusted input.
    max_body_bytes: int = Field(10 * 1024 * 1024, ge=1, description="largest request body (413 beyond)")
    max_pixels: int = Field(50_000_000, ge=1, description="largest decoded image, width x height (413 beyond)")
    max_images_per_request: int = Field(
        0, ge=0, description="images one /v2 or gRPC inference request may carry (BYTES elements, or pixel_values "
        "rows), checked from the tensor's shape before anything is decoded (400 beyond); 0: the model's "
        "max_batch. Above max_batch, a request runs as several batches")

    # The Open Inference Protocol over gRPC (KServe v2 GRPCInferenceService), beside HTTP.
    grpc_port: int | None = Field(None, ge=0, le=65535, description="serve gRPC on this port (off when unset)")
    grpc_max_message_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="largest gRPC message either "
                                        "way (gRPC's own default, 4 MiB, is smaller than a 12 MP JPEG)")
    grpc_max_concurrent_calls: int = Field(32, ge=1, description="gRPC calls in flight at once (grpcio's "
                                           "maximum_concurrent_rpcs; RESOURCE_EXHAUSTED beyond): the messages held "
                                           "are at most this x grpc_max_message_bytes")

    # Who may call: API keys (kept as sha256 hashes only), TLS, browsers of other origins.
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="keys a client sends as Authorization: Bearer KEY or X-API-Key "
        "(VIT_SERVE_API_KEYS: a JSON list or comma-separated; sha256:HEX entries are taken as hashes); none: no "
        "key needed")
    api_keys_file: str | None = Field(None, description="a file of keys (or sha256:HEX hashes), one a line")
    admin_api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="keys that may also load and unload models (the repository API); "
        "none: nobody may, unless allow_any_key_admin")
    admin_api_keys_file: str | None = Field(None, description="a file of admin keys, one a line")
    allow_any_key_admin: bool = Field(False, description="without admin keys, let any caller with a valid key "
                                      "(anyone, when no API key is set) load and unload models; off: load / unload "
                                      "answer 403")
    open_probes: bool = Field(True, description="health, readiness and metrics answer without a key (probes and "
                              "scrapers keep working)")
    root_path: str = Field("", pattern=r"^(/[^/?#\s]+)*$", description="the URL prefix a proxy serves the "
                           "gateway under (uvicorn's root_path, e.g. /vit): routes and key checks see the path "
                           "without it")
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="origins browsers may call from (Starlette's CORSMiddleware; * for "
        "any); none: CORS off")
    request_ids: bool = Field(True, description="echo X-Request-ID (made when absent) and log one line per "
                              "request with it")
    otel: bool = Field(False, description="OpenTelemetry tracing (the otel extra): a span per request, the trace "
                       "context passed on to Triton; exporter, endpoint, service name and sampler from the "
                       "standard OTEL_* variables (vit_serve.serve.tracing)")
    ssl_certfile: str | None = Field(None, description="TLS certificate (PEM) for HTTPS and gRPC")
    ssl_keyfile: str | None = Field(None, description="TLS private key (PEM) for HTTPS and gRPC")

    # Images kept for GET /explain?id=...
    store: str = Field("memory", description="where the crops for GET /explain?id= live: memory (this process), "
                       "or redis://HOST:PORT/DB (shared by every replica)")
    store_size: int = Field(256, ge=0, description="recent images kept (model-input crops); 0 keeps none")
    store_ttl_s: float = Field(600.0, gt=0, description="seconds an image stays available to GET /explain")
    store_password_file: str | None = Field(None, description="a file holding the Redis password (a Secret "
                                            "mount), so that it is in neither the --store URL nor the environment")
    store_secret_file: str | None = Field(None, description="a file holding the store secret (16 bytes or more, "
                                          "the same on every replica): explain ids and Redis entries are HMACs "
                                          "with it (vit_serve.serve.stores.secret); unset, and without "
                                          "store_secret, the process makes one, so replicas in other processes "
                                          "cannot explain each other's images")
    store_secret: SecretStr | None = Field(None, description="the store secret itself (VIT_SERVE_STORE_SECRET; no "
                                           "flag, a command line is visible to every user): as store_secret_file")

    # Compute.
    decode_workers: int = Field(0, ge=0, description="threads decoding and preprocessing uploads (0: sized "
                                "against the model's threads, max(1, min(4, cores - threads)), see "
                                "default_decode_workers)")
    threads: int | None = Field(None, ge=1, description="intra-op threads of the model runtime (default: its own)")
    # fast by default: unique 12 MP uploads 2.9-4x faster through the gateway, within 44.8-47.6 dB of the exact
    # input, top-1 unchanged on the digits scans (README, "Decoding uploads").
    decode: Literal["exact", "fast"] | None = Field(
        "fast", description="how uploads are decoded and resized: fast (the default: JPEG DCT-domain downscaling, "
                            "integer reduction first), exact (timm's transform, bit for bit), or contract (None "
                            "here): the model's own contract field")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="torch / onnxruntime device")
    gpu_decode: bool = Field(True, description="on CUDA, decode JPEG uploads with nvJPEG and resize them on the "
                             "GPU (torchvision); other formats and any failure take the CPU path")

    @field_validator("decode", mode="before")
    @classmethod
    def _contract_decode(cls, v: object) -> object:
        return None if v == "contract" else v

    @field_validator("api_keys", "admin_api_keys", "cors_origins", mode="before")
    @classmethod
    def _comma_list(cls, v: object) -> object:
        if isinstance(v, str):  # VIT_SERVE_API_KEYS=a,b as well as a JSON list
            if v.lstrip().startswith("["):
                return json.loads(v)
            return [p.strip() for p in v.split(",") if p.strip()]
        return v

    @field_validator("api_keys", "admin_api_keys")
    @classmethod
    def _hash_keys(cls, v: list[str]) -> list[str]:
        from vit_serve.serve.security import key_hash

        return [key_hash(k) for k in v]  # the keys themselves are never kept (nor shown by model_dump)

    @model_validator(mode="after")
    def _store_secret(self) -> ServeSettings:
        if self.store_secret is None and self.store_secret_file is None:
            from vit_serve.serve.stores.secret import process_secret

            self.store_secret, self._store_secret_made = SecretStr(process_secret()), True
        return self

    @property
    def store_secret_generated(self) -> bool:
        """Whether the store secret is this process's own (none given): other processes' gateways do not share
        it, unless these settings are sent to them (Ray Serve)."""
        return self._store_secret_made

    def __repr_args__(self) -> Any:
        from vit_serve.serve.stores import redacted

        for name, value in super().__repr_args__():
            yield name, redacted(value) if name == "store" and isinstance(value, str) else value

    @model_validator(mode="after")
    def _tls_pair(self) -> ServeSettings:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile go together: give both or neither")
        return self

    @field_validator("version_policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        from vit_serve.runtime.discovery import VersionPolicy

        return str(VersionPolicy.parse(v))

    @model_validator(mode="after")
    def _size_decode_workers(self) -> ServeSettings:
        if self.decode_workers == 0:
            self.decode_workers = default_decode_workers(available_cpus(), self.threads, self.device)
        return self

    @property
    def batching(self) -> bool:
        """Whether concurrent requests are coalesced (max_batch > 1 and max_delay_ms > 0)."""
        return self.max_batch > 1 and self.max_delay_ms > 0
