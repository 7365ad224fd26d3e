"""The gateway's settings: `ServeSettings`, environment variables `VIT_SERVE_*` overridden by `vit-serve serve`
flags, in typed groups.

`ServeSettings` nests `limits` (`RunnerLimits`), `triton` (`TritonClientSettings`), `repository`
(`RepositorySettings`), `security` (`SecuritySettings`: who may call), `explain_store` (`StoreSettings`: the
images kept for GET /explain?id=), `monitor` (`MonitoringSettings`: OOD scores, drift, the payload sampler) and
`ray` (`RayDeploymentSettings`: the Ray Serve deployments of --engine ray);
the rest (the model, the listeners, decode, compute) is its own. Components take their own group, and read a
group's field through it (`settings.limits.max_batch`). The names of the outside stay flat: every field of every
group is `VIT_SERVE_<FIELD>` (VIT_SERVE_MAX_BATCH), a `vit-serve serve` flag (--max-batch) and a name in a settings
file (`ServeSettings.of({"max_batch": 4})` takes such names). In Python the settings are two typed models, by scope:
`ServerSettings` (the server's: listeners, keys and TLS, repository control, backends, bounds, stores, telemetry) and
`ModelDefaults` (the keys of a model's config.toml), given as `ServeSettings(model=REPO, server=ServerSettings(
port=8080), model_defaults=ModelDefaults(max_batch=4))` and read back as `settings.server` / `settings.model_defaults`
(a group instance may be passed too: `ServeSettings(limits=RunnerLimits(...))`). Flat keywords
(`ServeSettings(max_batch=4)`) still work, deprecated: a DeprecationWarning names the typed keyword to use.
The flat environment names are the canonical ones; the nested
spelling of a group's field (VIT_SERVE_LIMITS__MAX_BATCH) is deprecated, read with a `SettingNameWarning` that
names the flat one (`ENV_RENAMED`).

The settings a model's own REPO/NAME/config.toml may set (`vit_serve.runtime.model_config.ModelConfig`: its
limits, instances, compute, decode, monitoring) are, here, the defaults of the models without their own: their
flags are listed as "model defaults" (`Flag(section="model")`).

A settings file (`vit-serve serve --config FILE`, `vit_serve.serve.config_file.settings_from_file`) holds the same
flat names. Precedence: keywords (flags) > VIT_SERVE_* > the file > the defaults.
"""

from __future__ import annotations

import ipaddress
import warnings
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    create_model,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from vit_serve.flag import Flag
from vit_serve.monitor import DEFAULT_MIN_WINDOW, DEFAULT_SIGNIFICANCE
from vit_serve.runtime.settings import (
    DECODE_WORKERS_CAP,
    DECODE_WORKERS_MIN,
    GROUP_CONFIG,
    RepositorySettings,
    RunnerLimits,
    TritonClientSettings,
    available_cpus,
    default_decode_workers,
    env_list,
)
from vit_serve.runtime.zero_shot import LabelLimits
from vit_serve.serve.keys import key_hash
from vit_serve.serve.setting_scopes import Scope, scope_of
from vit_serve.serve.stores.redaction import redacted
from vit_serve.serve.stores.secret import process_secret
from vit_serve.tome_schedule import parse_tome

BackendName = Literal["auto", "torch", "onnxruntime", "openvino", "tensorrt", "triton"]
DEFAULT_LABELS = LabelLimits()

__all__ = ["DECODE_WORKERS_CAP", "DECODE_WORKERS_MIN", "DEFAULT_LABELS", "ENV_RENAMED", "BackendName",
           "ModelDefaults", "MonitoringSettings", "RayDeploymentSettings", "RepositorySettings", "RunnerLimits",
           "SecuritySettings", "ServeSettings", "ServerSettings", "SettingNameWarning", "StoreSettings",
           "TritonClientSettings", "available_cpus", "default_decode_workers"]

class SecuritySettings(BaseSettings):
    """Who may call: API keys (kept as sha256 hashes only), admin keys, open probes, TLS, browsers of other
    origins."""

    model_config = GROUP_CONFIG

    api_keys: Annotated[list[str], NoDecode, Flag(name="--api-key", metavar="KEY")] = Field(
        default_factory=list, description="keys a client sends as Authorization: Bearer KEY or X-API-Key "
        "(VIT_SERVE_API_KEYS: a JSON list or comma-separated; sha256:HEX entries are taken as hashes); none: no "
        "key needed")
    api_keys_file: Annotated[str | None, Flag(metavar="FILE")] = Field(
        None, description="a file of keys (or sha256:HEX hashes), one a line, each optionally followed by name=NAME "
        "priority=LEVEL rate=R burst=B (vit_serve.serve.keys); rates are per replica (each process keeps its own "
        "buckets). Read again on SIGHUP and when it changes (checked at most once a second): write a new file and "
        "rename it over the old one to revoke a key without a restart; a file that cannot be read then keeps the "
        "keys read before and logs an error")
    admin_api_keys: Annotated[list[str], NoDecode, Flag(name="--admin-api-key", metavar="KEY")] = Field(
        default_factory=list, description="keys that may also load and unload models (the repository API); "
        "none: nobody may, unless allow_any_key_admin")
    admin_api_keys_file: Annotated[str | None, Flag(metavar="FILE", hidden=True)] = Field(
        None, description="a file of admin keys, one a line (the fields of api_keys_file); read again on SIGHUP and "
        "when it changes, as api_keys_file")
    default_key_priority: int | None = Field(
        None, ge=1, description="the priority level (1 the most urgent) of the keys given without priority= "
        "(api_keys, key-file lines without it); unset: the middle of the levels the key files give, rounded "
        "toward the less urgent (levels 1 and 4: 3), so that a key nobody ranked outranks no ranked key; 1 when "
        "the files give none")
    max_concurrent_per_key: int = Field(
        64, ge=0, description="requests of one API key in flight at once on this replica (HTTP and gRPC); beyond "
        "it 429 with Retry-After (RESOURCE_EXHAUSTED); 0: no cap")
    allow_any_key_admin: Annotated[bool, Flag()] = Field(
        False, description="without admin keys, let any caller with a valid key (anyone, when no API key is set) "
        "load and unload models; off: load / unload answer 403")
    open_probes: Annotated[bool, Flag(hidden=True)] = Field(
        True, description="health and readiness answer without a key, so that probes keep working (/metrics needs "
        "one on the main port: scrapers use metrics_port, or send a key)")
    open_weaviate: Annotated[bool, Flag()] = Field(
        False, description="let requests to /weaviate/ (Weaviate's multi2vec contract: /vectorize, /meta) through "
        "without an API key, for Weaviate's module, which sends none (a key that is sent is still checked; the rest "
        "of the API keeps its keys; a warning is logged at startup): give Weaviate a gateway of its own that only "
        "Weaviate's pods reach, as the serving guide's NetworkPolicy does")
    image_url_hosts: Annotated[list[str], NoDecode, Flag(name="--image-url-host", metavar="HOST")] = Field(
        default_factory=list, description="hosts whose http(s):// image URLs a request may name (POST "
        "/v1/embeddings), fetched by the gateway; *.example.com allows its subdomains. None: image URLs are "
        "refused. Loopback, link-local, private and unspecified addresses are refused after DNS resolution and at "
        "every redirect, even for a host named here, unless image_url_networks names them")
    image_url_networks: Annotated[list[str], NoDecode, Flag(name="--image-url-network", metavar="CIDR",
                                                             hidden=True)] = Field(
        default_factory=list, description="networks (CIDR) an allowed host may resolve to although they are not "
        "public (an image store on the cluster's own network, e.g. 10.0.12.0/24); none: public addresses only")
    image_url_max_bytes: int = Field(
        8 * 2**20, ge=1, description="largest image fetched from a URL, in bytes (the answer is refused beyond)")
    image_url_timeout_s: float = Field(
        5.0, gt=0, description="seconds a URL's image may take to fetch, its DNS lookups and redirects included")
    cors_origins: Annotated[list[str], NoDecode, Flag(name="--cors-origin",
        metavar="ORIGIN")] = Field(
        default_factory=list, description="origins browsers may call from (Starlette's CORSMiddleware; * for "
        "any); none: CORS off")
    ssl_certfile: Annotated[str | None, Flag()] = Field(
        None, description="TLS certificate (PEM) for HTTPS and gRPC")
    ssl_keyfile: Annotated[str | None, Flag()] = Field(
        None, description="TLS private key (PEM) for HTTPS and gRPC")

    @field_validator("api_keys", "admin_api_keys", "cors_origins", "image_url_hosts", "image_url_networks",
                     mode="before")
    @classmethod
    def _comma_list(cls, v: object) -> object:
        return env_list(v)  # VIT_SERVE_API_KEYS=a,b as well as a JSON list

    @field_validator("api_keys", "admin_api_keys")
    @classmethod
    def _hash_keys(cls, v: list[str]) -> list[str]:
        return [key_hash(k) for k in v]  # the keys themselves are never kept (nor shown by model_dump)

    @field_validator("image_url_hosts")
    @classmethod
    def _lower_hosts(cls, v: list[str]) -> list[str]:
        return [h.strip().lower().rstrip(".") for h in v if h.strip()]

    @field_validator("image_url_networks")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        return [str(ipaddress.ip_network(n.strip(), strict=False)) for n in v if n.strip()]  # ValueError: not a CIDR

    @model_validator(mode="after")
    def _tls_pair(self) -> SecuritySettings:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile go together: give both or neither")
        return self


class StoreSettings(BaseSettings):
    """Where the crops for GET /explain?id= live, how many and for how long, and the secret their ids are made
    with (`vit_serve.serve.stores.secret`)."""

    model_config = GROUP_CONFIG
    _store_secret_made: bool = PrivateAttr(False)

    store: Annotated[str, Flag(section="store", metavar="URL")] = Field(
        "memory", description="where the crops for GET /explain?id= live: memory (this process), or "
        "redis://HOST:PORT/DB (shared by every replica)")
    store_size: int = Field(256, ge=0, description="recent images kept (model-input crops); 0 keeps none")
    store_ttl_s: float = Field(600.0, gt=0, description="seconds an image stays available to GET /explain")
    store_password_file: Annotated[str | None, Flag(section="store", metavar="FILE", hidden=True)] = Field(
        None, description="a file holding the Redis password (a Secret mount), so that it is in neither the "
        "--store URL nor the environment")
    store_secret_file: Annotated[str | None, Flag(section="store", metavar="FILE")] = Field(
        None, description="a file holding the store secret (16 bytes or more, the same on every replica): "
        "explain ids and Redis entries are HMACs with it (vit_serve.serve.stores.secret); unset, and without "
        "store_secret, the process makes one, so replicas in other processes cannot explain each other's images")
    # No flag (a command line is visible to every user), and never dumped: pickling carries it (Ray Serve).
    store_secret: SecretStr | None = Field(None, exclude=True, description="the store secret itself "
                                           "(VIT_SERVE_STORE_SECRET): as store_secret_file")

    @model_validator(mode="after")
    def _store_secret(self) -> StoreSettings:
        if self.store_secret is None and self.store_secret_file is None:
            self.store_secret, self._store_secret_made = SecretStr(process_secret()), True
        return self

    @property
    def store_secret_generated(self) -> bool:
        """Whether the store secret is this process's own (none given): other processes' gateways do not share
        it, unless these settings are sent to them (Ray Serve)."""
        return self._store_secret_made

    def given(self) -> dict[str, Any]:
        """The fields this group was given (explicitly or by the environment), the made secret left out."""
        values = {k: getattr(self, k) for k in self.model_fields_set}
        if self._store_secret_made:
            values.pop("store_secret", None)
        return values

    def __repr_args__(self) -> Any:
        for name, value in super().__repr_args__():
            yield name, redacted(value) if name == "store" and isinstance(value, str) else value


class MonitoringSettings(BaseSettings):
    """Watching what the gateway serves (`vit_serve.monitor`, for versions whose model carries a reference): a
    per-image OOD score in each /classify answer, drift of a window of recent answers against the reference
    (GET /models/NAME/drift, /metrics), and a sample of the requests kept for later labelling (the payload
    sampler, off by default)."""

    model_config = GROUP_CONFIG

    monitoring: Annotated[bool, Flag(section="model")] = Field(
        True, description="models carrying a reference get OOD scores in their answers and a drift window")
    drift_window: Annotated[int, Flag(section="model", metavar="N")] = Field(
        500, ge=1, description="answered images kept per model version, compared with its reference")
    drift_significance: float = Field(DEFAULT_SIGNIFICANCE, gt=0, lt=1, description="the drift alarm's level: "
                                      "on when the Bonferroni-corrected KS p-value is below it")
    drift_min_window: int = Field(DEFAULT_MIN_WINDOW, ge=1, description="images the window needs before the "
                                  "alarm can turn on (at most drift_window)")
    drift_refresh_s: float = Field(15.0, gt=0, description="seconds between two computations of a version's "
                                   "drift for /metrics (and only when its window has grown since): a scrape "
                                   "reads the last one, whatever the scrape rate; GET /models/NAME/drift computes "
                                   "its own")
    sample_rate: Annotated[float, Flag(section="sampler", metavar="RATE")] = Field(
        0.0, ge=0, le=1, description="share of /classify requests sampled (their model-input crop as PNG, top-1 "
        "and OOD score) for labelling later; 0: off")
    sample_flagged_rate: float = Field(1.0, ge=0, le=1, description="share of OOD-flagged requests sampled "
                                       "(kept before the others)")
    sample_dir: Annotated[str | None, Flag(section="sampler", metavar="DIR")] = Field(
        None, description="folder the sampled requests are written to, as Parquet parts")
    sample_max_bytes: int = Field(256 * 2**20, ge=1, description="the sample folder's cap in bytes: the oldest "
                                  "unflagged parts are removed first")
    sample_retention_s: float = Field(7 * 86400.0, gt=0, description="seconds sampled parts are kept")
    sample_redis_url: Annotated[str | None, Flag(section="sampler", metavar="URL", hidden=True)] = Field(
        None, description="a Redis server the samples are added to (stream sample_redis_stream) instead of a "
        "folder")
    sample_redis_stream: str = Field("vit_serve:samples", min_length=1, description="the Redis stream of the "
                                     "samples")
    sample_redis_password_file: str | None = Field(None, description="a file holding the password of the "
                                                   "samples' Redis (a Secret mount), so that it is not in the URL")
    sample_redis_timeout_s: float = Field(2.0, gt=0, description="socket timeout (connect, read, write) of the "
                                          "samples' Redis connection; a batch that times out is dropped, counted")
    sample_redis_ttl_s: float = Field(86400.0, gt=0, description="the samples' stream expires this long after its "
                                      "last entry, so that a volatile-* maxmemory policy can evict it before the "
                                      "explain store's crops")

    @model_validator(mode="after")
    def _consistent(self) -> MonitoringSettings:
        if self.drift_min_window > self.drift_window:
            if "drift_min_window" not in self.model_fields_set:  # only the window was made small: it is the minimum
                self.__dict__["drift_min_window"] = self.drift_window  # not counted as given
                return self._consistent()
            raise ValueError(f"drift_min_window ({self.drift_min_window}) is larger than drift_window "
                             f"({self.drift_window}): the drift alarm could never turn on")
        if self.sample_rate > 0 and (self.sample_dir is None) == (self.sample_redis_url is None):
            raise ValueError("sample_rate > 0 needs one place for the samples: sample_dir (--sample-dir DIR) or "
                             "sample_redis_url (--sample-redis-url URL), not " +
                             ("neither" if self.sample_dir is None else "both"))
        return self

    def sampler_settings(self) -> Any:
        """The payload sampler's settings (`vit_serve.runtime.payload_sampler.SamplerSettings`)."""
        from pathlib import Path

        from vit_serve.runtime.payload_sampler import SamplerSettings

        return SamplerSettings(rate=self.sample_rate, folder=None if self.sample_dir is None else Path(self.sample_dir),
                               max_bytes=self.sample_max_bytes, retention_s=self.sample_retention_s,
                               redis_url=self.sample_redis_url, redis_stream=self.sample_redis_stream,
                               flagged_rate=self.sample_flagged_rate, redis_ttl_s=self.sample_redis_ttl_s,
                               redis_timeout_s=self.sample_redis_timeout_s,
                               redis_password_file=None if self.sample_redis_password_file is None
                               else Path(self.sample_redis_password_file))

    def __repr_args__(self) -> Any:
        for name, value in super().__repr_args__():
            yield name, redacted(value) if name == "sample_redis_url" and isinstance(value, str) else value


class RayDeploymentSettings(BaseSettings):
    """With --engine ray (`vit_serve.deploy.ray`): each model version's Ray Serve deployment (its replicas,
    autoscaling and actor resources: model defaults, which a model's config.toml may set, as Ray Serve keeps them
    per deployment), and the gateway's own replicas."""

    model_config = GROUP_CONFIG

    replicas: Annotated[int, Flag(section="model")] = Field(
        1, ge=1, description="Ray Serve (--engine ray): replicas of each model deployment")
    max_replicas: Annotated[int | None, Flag(section="model")] = Field(
        None, ge=1, description="Ray Serve: autoscale each model deployment from replicas up to this")
    ingress_replicas: Annotated[int, Flag(section="ray", hidden=True)] = Field(
        1, ge=1, description="gateway replicas (more need --store redis://... for GET /explain?id=)")
    replica_cpus: Annotated[float, Flag(section="model")] = Field(
        1.0, ge=0, description="Ray Serve: CPUs of each model replica (ray_actor_options num_cpus)")
    replica_gpus: Annotated[float, Flag(section="model")] = Field(
        0.0, ge=0, description="Ray Serve: GPUs of each model replica (ray_actor_options num_gpus)")


class SettingNameWarning(DeprecationWarning):
    """A setting was given by a deprecated name (`ENV_RENAMED`); the message names the one to use.
    `vit-serve` shows these (Python hides other DeprecationWarnings outside __main__)."""


class _GroupEnv(EnvSettingsSource):
    """A group's `VIT_SERVE_<FIELD>` variables, and its deprecated names (`ENV_RENAMED`) where the canonical one
    is not set, each with a `SettingNameWarning`."""

    def _load_env_vars(self) -> Mapping[str, str | None]:
        env = dict(super()._load_env_vars())
        fold = (lambda n: n) if self.case_sensitive else str.lower
        for old, new in ENV_RENAMED.items():
            if fold(old) not in env or new[len("VIT_SERVE_"):].lower() not in self.settings_cls.model_fields:
                continue  # not set, or another group's
            if fold(new) in env:
                warnings.warn(f"{old} and {new} are both set: {new} wins ({old} is deprecated)", SettingNameWarning,
                              stacklevel=1)
            else:
                warnings.warn(f"{old} is deprecated: set {new}", SettingNameWarning, stacklevel=1)
                env[fold(new)] = env[fold(old)]
        return env


class _FlatEnv(EnvSettingsSource):
    """`VIT_SERVE_<FIELD>` for the fields of ServeSettings and of its groups, the names flat; a group's values are
    handed over as a dict under the group's name (VIT_SERVE_<GROUP> itself is no variable)."""

    def __call__(self) -> dict[str, Any]:
        values = {k: v for k, v in super().__call__().items() if k not in GROUPS}
        for name, group in GROUPS.items():
            if found := _GroupEnv(group)():
                values[name] = found
        return values


# A settings file's values (flat names, checked already) while `config_file.settings_from_file` builds settings.
_FILE_VALUES: ContextVar[dict[str, Any] | None] = ContextVar("vit_serve_settings_file", default=None)


class _FileValues(PydanticBaseSettingsSource):
    """The settings file's values, below the environment: a group's fields as a dict under the group's name, so
    that the environment's values of the same group are merged over them field by field."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ gives every value at once

    def __call__(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, value in (_FILE_VALUES.get() or {}).items():
            if name in FLAT:
                out.setdefault(FLAT[name], {})[name] = value
            else:
                out[name] = value
        return out


class ServeSettings(BaseSettings):
    """Everything `vit-serve serve` can be told, in groups (`limits`, `triton`, `repository`, `security`,
    `explain_store`, `monitor`). Each field, a group's too, is also `VIT_SERVE_<FIELD>` (e.g. VIT_SERVE_MAX_BATCH)."""

    model_config = SettingsConfigDict(env_prefix="VIT_SERVE_", extra="forbid", protected_namespaces=())

    # The field order is the order of `vit-serve serve --help` (vit_serve.cli.flags; a Flag's `after` moves one).
    model: Annotated[str, Flag(metavar="REPO|MODEL", positional=True)] = Field(
        "", description="REPO: a folder of models (exports, checkpoints, or NAME/VERSION/ folders), or one model: "
        "a checkpoint, NAME.onnx, a TensorRT engine, or a Triton model name")
    backend: Annotated[BackendName, Flag()] = Field(
        "auto", description="auto: from MODEL's suffix (.onnx onnxruntime, .xml openvino, .engine/.plan tensorrt, "
        "else torch); openvino also serves the NAME.onnx exports")
    triton: TritonClientSettings = Field(default_factory=TritonClientSettings)
    model_name: Annotated[str | None, Flag()] = Field(
        None, description="name shown to clients (default: MODEL's file stem)")
    host: Annotated[str, Flag()] = Field("127.0.0.1", description="the address HTTP listens on")
    port: Annotated[int, Flag()] = Field(8000, ge=0, le=65535, description="the HTTP port (0 picks a free one)")

    # The Open Inference Protocol over gRPC (KServe v2 GRPCInferenceService), beside HTTP.
    grpc_port: Annotated[int | None, Flag()] = Field(
        None, ge=0, le=65535, description="serve gRPC on this port (off when unset)")
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="serve GET /metrics to anyone on this port of its own, for Prometheus "
        "(its scrape annotations and ServiceMonitor name it; deploy/ uses 8002) and nothing else there; 0 picks a "
        "free port. /metrics on the main port needs an API key when keys are on (it shows every model's traffic "
        "and every key's name), so set this where a scraper has no key; with TLS it serves HTTPS. Off when unset")
    grpc_max_message_bytes: Annotated[int, Flag(hidden=True)] = Field(
        64 * 1024 * 1024, ge=1024, description="largest gRPC message either way (gRPC's own default, 4 MiB, is "
        "smaller than a 12 MP JPEG)")
    grpc_max_concurrent_calls: Annotated[int, Flag(hidden=True)] = Field(
        32, ge=1, description="gRPC calls in flight at once (grpcio's maximum_concurrent_rpcs; RESOURCE_EXHAUSTED "
        "beyond): the messages held are at most this x grpc_max_message_bytes")
    root_path: Annotated[str, Flag()] = Field(
        "", pattern=r"^(/[^/?#\s]+)*$", description="the URL prefix a proxy serves the gateway under (uvicorn's "
        "root_path, e.g. /vit): routes and key checks see the path without it")
    # Graceful shutdown (vit_serve.serve.shutdown): on SIGTERM / SIGINT, drain, then grace, then 503 the rest.
    shutdown_drain_s: Annotated[float, Flag(hidden=True)] = Field(
        5.0, ge=0, description="on SIGTERM / SIGINT: seconds the readiness probes answer 503 (draining) while the "
        "server still accepts and answers, so that a load balancer stops sending before the listener closes")
    shutdown_grace_s: Annotated[float, Flag(hidden=True)] = Field(
        20.0, ge=0, description="after the drain: seconds the queued and running requests have to finish; the "
        "requests still waiting then are answered 503 + Retry-After")
    limits: RunnerLimits = Field(default_factory=RunnerLimits)

    # Untrusted input.
    max_body_bytes: int = Field(10 * 1024 * 1024, ge=1, description="largest request body (413 beyond)")
    # Slow clients (vit_serve.serve.slow_clients): what a slowloris or a stalled upload may hold, and for how long.
    header_timeout_s: float = Field(10.0, gt=0, description="a connection that has not sent a request's complete "
                                    "headers within this many seconds of opening, or of its previous answer, is "
                                    "closed")
    body_timeout_s: float = Field(60.0, gt=0, description="a request's whole body must arrive within this many "
                                  "seconds of its headers, else 408 and the connection is closed (60 s: 10 MiB at "
                                  "1.4 Mbit/s; raise it with max_body_bytes for slow links)")
    max_connections: int = Field(1000, ge=1, description="HTTP connections (or requests in progress) at once; a "
                                 "request beyond it is answered 503 + Retry-After. Each may hold up to "
                                 "max_body_bytes while its body is read; keep it under the open-files limit")
    max_pixels: int = Field(50_000_000, ge=1, description="largest decoded image, width x height (413 beyond)")
    max_patch_token_floats: int = Field(262_144, ge=1, description="most floats one /embed?tokens=patch answer "
                                        "holds (patches x width; 400 beyond): a B/16 at 224 px is 196 x 768 = "
                                        "150,528")
    priority_levels: int = Field(10, ge=1, le=2**31 - 1, description="the priority levels a /v2 or gRPC request "
                                 "may ask for with parameters.priority (1 the most urgent .. this; 0: its key's "
                                 "level), as Triton's dynamic_batching priority_levels; a level beyond is 422 / "
                                 "INVALID_ARGUMENT")
    # Zero-shot labels (POST /classify?labels=, the v2 `labels` parameter) on models served with a text tower.
    max_labels: int = Field(DEFAULT_LABELS.max_labels, ge=1, description="most labels in one request with labels "
                            "(400 beyond)")
    max_label_chars: int = Field(DEFAULT_LABELS.max_label_chars, ge=1, description="longest label of a request, in "
                                 "characters (400 beyond)")
    label_cache_size: int = Field(DEFAULT_LABELS.cache_size, ge=0, description="labels whose text embeddings each "
                                  "text tower keeps (LRU); 0 encodes every label every time")
    max_label_bytes: int = Field(DEFAULT_LABELS.max_label_bytes, ge=1, description="longest label of a request, in "
                                 "UTF-8 bytes (400 beyond; a label must also fit the text tower's context length "
                                 "in every template, in tokens)")
    max_label_prompts: int = Field(DEFAULT_LABELS.max_label_prompts, ge=1, description="most labels x templates "
                                   "(prompts) in one request with labels (400 beyond)")
    text_chunk_size: int = Field(DEFAULT_LABELS.chunk_size, ge=1, description="prompts a text tower encodes per "
                                 "run: a request with labels is encoded this many at a time, so that its memory "
                                 "is one chunk's whatever labels x templates is")
    text_queue_size: int = Field(DEFAULT_LABELS.queue_size, ge=1, description="requests with labels each text "
                                 "tower holds, waiting or being encoded (503 + Retry-After beyond)")

    threads: Annotated[int | None, Flag(section="model")] = Field(
        None, ge=1, description="intra-op threads of the model runtime (default: its own)")
    intra_op_spinning: Annotated[bool, Flag(section="model")] = Field(
        False, description="onnxruntime's session.intra_op.allow_spinning: on, the model runs 14-25% faster "
        "where uploads are cheap to decode (small photos); off (the default), its idle threads leave the cores "
        "to the decode threads, 15-25% faster with 12 MP uploads")
    runtime: Annotated[Literal["onnxruntime", "openvino"] | None, Flag(section="model", none="file")] = Field(
        None, description="what runs a model's ONNX exports: onnxruntime, openvino, or file (None here: by the "
        "file, NAME.onnx onnxruntime and an OpenVINO IR NAME.xml openvino)")
    precision: Annotated[Literal["auto", "f32", "bf16", "f16", "int8"], Flag(section="model")] = Field(
        "auto", description="the OpenVINO backend's inference precision: auto (the CPU plugin's native: bf16 "
        "where the CPU has AVX512-BF16 or AMX, else f32), f32, bf16, f16, or int8 (a graph quantized by vit-export "
        "--format openvino --precision int8); any but f32 must pass the accuracy gate at load (top-1 agreement "
        "and cosine to fp32 on real photos) or is refused")
    performance_hint: Annotated[Literal["latency", "throughput"], Flag(section="model")] = Field(
        "latency", description="OpenVINO's PERFORMANCE_HINT: latency (one stream: each batch on every thread) or "
        "throughput (several streams, for instances > 1)")
    streams: Annotated[int | None, Flag(section="model")] = Field(
        None, ge=1, description="OpenVINO's NUM_STREAMS (default: the performance hint's)")
    openvino_cache_dir: Annotated[str | None, Flag(metavar="DIR", hidden=True)] = Field(
        None, description="where OpenVINO caches compiled models, so that a restart does not compile again "
        "(default: $XDG_CACHE_HOME/vit-serve/openvino; empty: no cache)")
    force_precision: Annotated[bool, Flag(section="model")] = Field(
        False, description="serve an OpenVINO precision that missed its accuracy bounds at load (logged with the "
        "numbers) instead of refusing the model")
    device: Annotated[Literal["auto", "cpu", "cuda"], Flag(section="model")] = (
        Field("auto", description="torch / onnxruntime device"))
    tome: Annotated[str | None, Flag(section="model", metavar="R")] = Field(
        None, description="token merging (ToMe) set on every checkpoint the torch backend loads: r per layer "
        "(`vit_serve.tome.parse_tome`'s forms); exported models keep their own")
    compile: Annotated[bool, Flag(section="model")] = Field(
        False, description="torch.compile (inductor) the checkpoints the torch backend loads: compiled and "
        "warmed up at load, its logits checked against eager's; exports are unaffected")
    compile_precision: Annotated[Literal["fp32", "bf16", "auto"], Flag(section="model")] = Field(
        "fp32", description="with compile: fp32, bf16 (CPU autocast, on a CPU with AVX512_BF16 or AMX; refused at "
        "load below 99.5% top-1 agreement or cosine 0.999 against eager fp32 on held-out digits scans) or auto "
        "(bf16 where the CPU has it and it passes, else fp32)")
    torchscript: Annotated[bool, Flag(section="model")] = Field(
        False, description="trace the checkpoints the torch backend loads with torch.jit (classify / embed; "
        "explain stays eager), checked against eager at load: the model threads then run without Python's GIL; "
        "exports are unaffected; not with compile")
    choose_runtime: Annotated[bool, Flag(section="model")] = Field(
        True, description="at load, time the runtimes installed for each model at batch 1 and max_batch (a "
        "checkpoint on the CPU in fp32: eager PyTorch and its in-memory export on onnxruntime and OpenVINO; "
        "NAME.onnx: onnxruntime and OpenVINO at its precision setting), check each one's logits against the fp32 "
        "reference, and serve the fastest that meets its precision's accuracy bounds "
        "(vit_serve.runtime.runtime_choice); the table is logged and in GET /models. Only with --backend auto: "
        "an explicit --backend, or a model's runtime setting, names what serves")
    choose_runtime_budget_s: float = Field(10.0, gt=0, description="longest time the runtimes' timing may take "
                                           "at load (the exports and the accuracy check come on top)")
    pin_runtime: Annotated[str | None, Flag(section="model", metavar="RUNTIME[:PRECISION]")] = Field(
        None, description="serve this runtime, unmeasured: eager, onnxruntime or openvino for a checkpoint on the "
        "CPU; onnxruntime, openvino or openvino:bf16 (f32, fp16, int8) for NAME.onnx")
    repository: RepositorySettings = Field(default_factory=RepositorySettings)
    explain_store: StoreSettings = Field(default_factory=StoreSettings)
    security: SecuritySettings = Field(default_factory=SecuritySettings)
    monitor: MonitoringSettings = Field(default_factory=MonitoringSettings)
    request_ids: Annotated[bool, Flag(hidden=True)] = Field(
        True, description="echo X-Request-ID (made when absent) and log one line per request with it")
    otel: Annotated[bool, Flag()] = Field(
        False, description="OpenTelemetry tracing (the otel extra): a span per request, the trace context passed "
        "on to Triton; exporter, endpoint, service name and sampler from the standard OTEL_* variables "
        "(vit_serve.serve.tracing)")
    # fast by default: unique 12 MP uploads 2.9-4x faster through the gateway, within 44.8-47.6 dB of the exact
    # input, top-1 unchanged on the digits scans (README, "Decoding uploads").
    decode: Annotated[Literal["fast", "exact"] | None, Flag(section="model", none="contract")] = Field(
        "fast", description="how uploads are decoded and resized: fast (the default: JPEG DCT-domain "
        "downscaling, integer reduction first), exact (timm's transform, bit for bit), or contract (None here): "
        "the model's own contract field")
    engine: Annotated[Literal["local", "ray"], Flag(section="ray")] = Field(
        "local", description="where the models run: local (in this process), or ray (each model version a Ray "
        "Serve deployment that this gateway, a Ray Serve ingress, calls; vit_serve.deploy.ray sets it)")

    # Compute.
    decode_workers: int = Field(0, ge=0, description="threads decoding and preprocessing uploads (0: sized "
                                "against the model's threads, max(1, min(4, cores - threads)), see "
                                "default_decode_workers)")
    gpu_decode: bool = Field(True, description="on CUDA, decode JPEG uploads with nvJPEG and resize them on the "
                             "GPU (torchvision); other formats and any failure take the CPU path")
    ray: RayDeploymentSettings = Field(default_factory=RayDeploymentSettings)  # last: its flags follow --address

    def __init__(self, **values: Any) -> None:
        flat = [k for k in values if k in _SCOPED]
        if flat:  # before the sources merge: the environment's and a file's values are flat too, and fine
            warnings.warn(_flat_keywords_message(flat), DeprecationWarning, stacklevel=2)
        super().__init__(**values)

    @classmethod
    def of(cls, values: Mapping[str, Any], **typed: Any) -> ServeSettings:
        """Settings from flat setting names (`{"max_batch": 4, "port": 8080}`: the names of the flags, of the
        VIT_SERVE_* variables and of settings files), without the deprecation warning of flat keywords: how the
        command line and settings files build them. `typed`: other keywords (`model`, a group instance)."""
        server = {k: v for k, v in values.items() if _SCOPED.get(k) == "server"}
        defaults = {k: v for k, v in values.items() if _SCOPED.get(k) == "model_defaults"}
        rest = {k: v for k, v in values.items() if k not in _SCOPED}
        return cls(**rest, **typed, server=ServerSettings.model_construct(**server),
                   model_defaults=ModelDefaults.model_construct(**defaults))

    @property
    def server(self) -> ServerSettings:
        """The server's settings (every setting but `model` and the model defaults), flat: a copy."""
        return ServerSettings.model_construct(**{k: self._flat(k) for k in ServerSettings.model_fields})

    @property
    def model_defaults(self) -> ModelDefaults:
        """The settings of the models without their own config.toml (the keys of `ModelConfig`), flat: a copy."""
        return ModelDefaults.model_construct(**{k: self._flat(k) for k in ModelDefaults.model_fields})

    def _flat(self, name: str) -> Any:
        return getattr(getattr(self, FLAT[name]) if name in FLAT else self, name)

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, _FlatEnv(settings_cls), _FileValues(settings_cls), dotenv_settings, file_secret_settings

    @classmethod
    def flat_fields(cls) -> dict[str, FieldInfo]:
        """Every setting by its flat name (the groups' fields in their group's place), in order: the names of
        the environment variables (VIT_SERVE_<NAME>), the keywords and the flags."""
        out: dict[str, FieldInfo] = {}
        for name, info in cls.model_fields.items():
            out.update(GROUPS[name].model_fields if name in GROUPS else {name: info})
        return out

    @model_validator(mode="before")
    @classmethod
    def _route_flat(cls, data: Any) -> Any:
        """Flat names (`max_batch=4`) into their group, over the group's environment or given instance."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for key, scoped in (("server", ServerSettings), ("model_defaults", ModelDefaults)):
            typed = data.pop(key, None)
            if isinstance(typed, BaseModel):
                typed = {k: getattr(typed, k) for k in typed.model_fields_set}
            wrong = sorted(set(typed or {}) - set(scoped.model_fields))
            if wrong:
                raise ValueError(f"{key}: {', '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} not of "
                                 f"{scoped.__name__}")
            data.update(typed or {})  # over the environment's and the file's: given, as a keyword is
        for name, group in GROUPS.items():
            flat = {k: data.pop(k) for k in group.model_fields if k in data}
            if not flat:
                continue
            given = data.get(name)
            base = _given(given) if isinstance(given, BaseSettings) else dict(given or {})
            data[name] = base | flat
        return data

    @field_validator("tome")
    @classmethod
    def _check_tome(cls, v: str | None) -> str | None:
        if v is not None:
            parse_tome(v)  # ValueError: the accepted forms
        return v

    @field_validator("decode", mode="before")
    @classmethod
    def _contract_decode(cls, v: object) -> object:
        return None if v == "contract" else v

    @model_validator(mode="after")
    def _size_decode_workers(self) -> ServeSettings:
        if self.decode_workers == 0:
            self.decode_workers = default_decode_workers(available_cpus(), self.threads, self.device)
        return self

    @property
    def label_limits(self) -> LabelLimits:
        """The limits, cache size and scheduling of requests with labels (max_labels, max_label_chars,
        label_cache_size, max_label_bytes, max_label_prompts, text_chunk_size, text_queue_size)."""
        return LabelLimits(self.max_labels, self.max_label_chars, self.label_cache_size, self.max_label_bytes,
                           self.max_label_prompts, self.text_chunk_size, self.text_queue_size)


def _given(group: BaseSettings) -> dict[str, Any]:
    """The fields a group instance was given (explicitly or by its environment), to merge flat names over."""
    if isinstance(group, StoreSettings):
        return group.given()
    return {k: getattr(group, k) for k in group.model_fields_set}


# The groups by their attribute name, and each flat name (a field or property of a group) by its group's.
GROUPS: dict[str, type[BaseSettings]] = {
    name: info.annotation for name, info in ServeSettings.model_fields.items()
    if isinstance(info.annotation, type) and issubclass(info.annotation, BaseSettings)}
FLAT: dict[str, str] = {k: name for name, group in GROUPS.items()
                        for k in [*group.model_fields, *(a for a, v in vars(group).items() if isinstance(v, property))]}
# Each deprecated environment name and the name to set instead. The canonical names are flat, VIT_SERVE_<FIELD>,
# as the flags, settings files and a model's config.toml name a setting; the nested spelling pydantic-settings
# users write for a group's field (VIT_SERVE_LIMITS__MAX_BATCH) is read too, with a warning naming the flat one.
ENV_RENAMED: dict[str, str] = {f"VIT_SERVE_{name.upper()}__{field.upper()}": f"VIT_SERVE_{field.upper()}"
                               for name, group in GROUPS.items() for field in group.model_fields}


def _scoped_model(name: str, doc: str, scope: str) -> type[BaseModel]:
    """A model of the flat settings of one scope (`_SCOPED`), each field ServeSettings' own (type, default,
    constraints, description: one text), checked again by ServeSettings when passed to it."""
    fields: dict[str, Any] = {k: (info.annotation, info) for k, info in ServeSettings.flat_fields().items()
                              if _SCOPED.get(k) == scope}
    return create_model(name, __doc__=doc, __config__=ConfigDict(extra="forbid", protected_namespaces=()),
                        __module__=__name__, **fields)


# Each setting a keyword of ServeSettings may not give flat without a warning, by the typed keyword it belongs to:
# the model defaults (the keys of a model's config.toml, `ModelConfig`), else the server's; `model` (what to
# serve) stays a keyword of its own.
_SCOPED: dict[str, str] = {k: "model_defaults" if scope_of(k) is Scope.MODEL else "server"
                           for k in ServeSettings.flat_fields() if k != "model"}
ServerSettings = _scoped_model("ServerSettings", """The server's settings, as Triton keeps its server's options apart
    from each model's config: listeners, keys and TLS, repository control, backends, request bounds, stores and
    telemetry (`vit_serve.serve.setting_scopes.SERVER_SETTINGS`), flat: `ServerSettings(port=8080, api_keys=[...])`.
    `ServeSettings(server=ServerSettings(...))` sets them (the fields given, over VIT_SERVE_* and a file), and
    `settings.server` reads them.""", "server")
ModelDefaults = _scoped_model("ModelDefaults", """The settings of the models without their own
    REPO/NAME/config.toml (or config.pbtxt): exactly the keys of `vit_serve.runtime.model_config.ModelConfig`, with
    the server's defaults: `ModelDefaults(max_batch=4, instances=2)`. `ServeSettings(model_defaults=ModelDefaults(
    ...))` sets them (the fields given, over VIT_SERVE_* and a file), and `settings.model_defaults` reads them.""",
                              "model_defaults")


def _flat_keywords_message(names: list[str]) -> str:
    """The deprecation of flat keywords `names`, naming the typed keyword each belongs to."""
    parts = []
    for scope, cls in (("server", "ServerSettings"), ("model_defaults", "ModelDefaults")):
        mine = [f"{k}=..." for k in names if _SCOPED[k] == scope]
        if mine:
            parts.append(f"{scope}={cls}({', '.join(mine)})")
    return (f"flat keywords of ServeSettings are deprecated ({', '.join(names)}): pass "
            f"ServeSettings({', '.join(parts)}), or ServeSettings.of({{...}}) for flat setting names")
