"""The gateway as a Ray Serve application: `build_app(settings, ...)`, and `run(settings, ...)` for
`vit-serve serve --engine ray`.

* The ingress deployment (`RayIngress`) is the FastAPI app of `create_app(settings)`: every route, decode, key, store
  and metric is the gateway's. Its settings say engine="ray", so each model version it loads is a
  `RayModelBackend` (vit_serve.runtime.backends.ray) on that version's deployment, driven by a `DirectRunner`.
  Each answer carries `X-Ray-Replica`, the ingress replica that served it.
* One deployment per model version (`ModelServer`, named `deployment_name(model, path)`), with `num_replicas` or
  an `autoscaling_config`, and `ray_actor_options` (e.g. `{"num_gpus": 1}`): settings.ray's (replicas,
  max_replicas, replica_cpus, replica_gpus; VIT_SERVE_REPLICAS, --replicas, ...), or build_app's arguments, for the
  models without their own; a model's REPO/NAME/config.toml may set its own, as Ray Serve keeps them per deployment
  (`Deployment`). Each replica loads the model with `vit_serve.runtime.load` of its `LoadSpec` (torch,
  onnxruntime, openvino, tensorrt: MODEL's files, the discovery's choice, a model's own runtime) and warms it
  up. The versions deployed are those the gateway's repository would serve (`select_versions`).
* Dynamic batching in the replica with the gateway's scheduler (`vit_serve.runtime.scheduling.runner_for`, a
  `BatchingRunner` in one model thread), up to `max_batch` images or `max_delay_ms` from the first, the model's own
  config.pbtxt limits first, as the gateway's; each request keeps its priority level and the seconds left to its
  deadline (a `Ticket` rebuilt in the replica: clocks differ between processes). The runner waits for a batch to
  fill only while more requests are known to be coming; a replica, away from the uploads, knows one thing: when
  its latest request came. So the stream of requests to it counts as one request coming (`Arrival`) while its
  latest came within the stalled-arrival time (`STALL_S`): a batch waits up to `max_delay_ms` for more while
  requests keep coming (as Ray's `@serve.batch` did), and not once they have stopped.
* `GET /explain?id=` works whichever ingress replica classified the image when the store is shared:
  settings.explain_store.store = "redis://HOST:PORT/DB" (VIT_SERVE_STORE).

* Replicas that reserve no GPU get `CUDA_VISIBLE_DEVICES=""` (Ray >= 2.48 no longer sets it for them, and a
  replica would otherwise use a GPU that no one reserved for it): `actor_options`.
* Before deploying, `run` checks what the application reserves against the cluster (`resource_shortfall`) and
  refuses in one line with the numbers, rather than waiting forever for a replica Ray cannot place. The models
  are loaded by the replicas, so the launching machine needs no TensorRT for an engine (`check_launch`).

The deployments are fixed when the application is built: model control is "none" (a new version needs a new
`serve.run`, which Ray Serve rolls out replica by replica). The Ray Serve proxy serves HTTP (`run` starts it on
settings.host / settings.port, with settings' TLS files); the gateway's gRPC port is not served here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

try:
    import ray
    from ray import serve
    from ray.serve.handle import DeploymentHandle
except ImportError:  # one line for the CLI and for an import by hand
    raise ImportError("vit_serve.deploy.ray needs Ray Serve: pip install 'vit-serve[ray]' (ray[serve])") from None

from vit_serve.runtime import LoadSpec, Outputs, Task, check, load, resolve_backend
from vit_serve.runtime.backends.base import LocalBackend
from vit_serve.runtime.backends.ray import RAY_METRICS, deployment_name
from vit_serve.runtime.discovery import ModelEntry, VersionPolicy, VersionSource, scan, select_versions
from vit_serve.runtime.scheduling import DEFAULT_PRIORITY, BatchingRunner, NoEvents, Runner, Ticket, runner_for
from vit_serve.serve.app import create_app
from vit_serve.serve.settings import ServeSettings

log = logging.getLogger("vit_serve.deploy.ray")

APP_NAME = "vit-serve"
FAILED = "cannot serve"  # how the ingress says why it cannot start (run() finds it in Ray's status)
REPLICA_HEADER = "X-Ray-Replica"


def _replica_id() -> str:
    return serve.get_replica_context().replica_id.unique_id


class _LastRequest:
    """When the replica's latest request came (`last`, on its runner's clock): the age of its `Arrival`."""

    def __init__(self, last: float) -> None:
        self.last = last


class ModelServer:
    """One model version: its replicas load the model, batch requests and run them in one model thread."""

    def __init__(self, spec: LoadSpec, version: int, max_batch: int, max_delay_ms: float) -> None:
        name = spec.name or Path(spec.path).stem
        self.name, self.version = name, version
        self.replica = _replica_id()
        self.thread = ThreadPoolExecutor(1, thread_name_prefix=f"vit-serve-model-{name}")
        self.limits = spec.limits.model_copy(update={"max_batch": max_batch, "max_delay_ms": max_delay_ms,
                                                     "instances": 1, "batch_curve": False})
        self.backend: LocalBackend | None = None
        self.runner: Runner | None = None
        self.heard: _LastRequest | None = None  # set once the runner runs in the replica's event loop
        self.error: str | None = None
        t0 = time.perf_counter()
        try:
            loaded = load(spec)
            if not isinstance(loaded, LocalBackend):
                raise ValueError(f"the {loaded.name} backend runs elsewhere already; Ray serves local backends")
            loaded.warmup()
            self.backend = loaded
            self.runner = runner_for(loaded, self.limits, NoEvents(), self.thread)
            log.info("%s version %d loaded (%s) and warmed up in %.2f s on replica %s", name, version,
                     loaded.name, time.perf_counter() - t0, self.replica)
        except Exception as e:  # the gateway shows the reason (GET /models); other models serve on
            self.error = " ".join(str(e).split()) or type(e).__name__
            log.warning("%s version %d cannot load: %s", name, version, self.error)

    def _loaded(self) -> LocalBackend:
        if self.backend is None:
            raise RuntimeError(self.error)
        return self.backend

    def _running(self) -> Runner:
        """The runner, started in the replica's event loop on its first request, with the replica's stream of
        requests announced as coming."""
        self._loaded()
        runner = self.runner
        assert runner is not None
        if self.heard is None:
            assert isinstance(runner, BatchingRunner)
            runner.start()
            self.heard = _LastRequest(runner.clock.now())
            runner.arriving().heard_from(self.heard)  # never done: it stalls when no request comes
        return runner

    def describe(self) -> dict[str, Any]:
        """What the ingress needs: the model's info, version, whether it can do grad_rollout."""
        backend = self._loaded()
        return {"info": backend.info, "version": self.version, "grad_rollout": backend.supports_grad_rollout,
                "replica": self.replica}

    def ready(self) -> bool:
        return self.backend is not None and self.backend.ready()

    async def run(self, task: Task, x: np.ndarray, timeout_s: float | None = None, priority: int = 0
                  ) -> tuple[Outputs, str, int]:
        """`task` on x [n, 3, H, W], with `timeout_s` left to its deadline (None: none) at level `priority` (0:
        the default one) -> (its outputs, this replica's id, the images in the batch it ran in)."""
        runner = self._running()
        now = runner.clock.now()
        assert self.heard is not None
        self.heard.last = now
        ticket = Ticket(arrived=now, deadline=None if timeout_s is None else now + timeout_s,
                        priority=priority or DEFAULT_PRIORITY)
        result = await runner.submit(task, x, ticket=ticket)
        return result.outputs, self.replica, result.batch_size


class _ReplicaHeader:
    """ASGI middleware: every HTTP answer names the ingress replica that served it."""

    def __init__(self, app: Callable, replica: str) -> None:
        self.app, self.value = app, replica.encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (REPLICA_HEADER.lower().encode(), self.value)]}
            await send(message)

        await self.app(scope, receive, send_named)


class RayIngress:
    """The gateway's FastAPI app; its models are the `ModelServer` deployments passed in (as handles)."""

    async def __init__(self, settings: ServeSettings, models: list[DeploymentHandle], startup_timeout_s: float
                       ) -> None:
        self.settings = settings
        self.replica = _replica_id()
        try:  # every model deployment has a replica (loaded, or knowing why not) before the gateway starts
            ready = await asyncio.wait_for(asyncio.gather(*(m.ready.remote() for m in models)), startup_timeout_s)
        except TimeoutError:
            raise TimeoutError(f"the model deployments did not start within {startup_timeout_s:g} s") from None
        root = Path(settings.model)
        if len(models) == 1 and not ready[0] and (not root.is_dir() or (root / "config.json").is_file()):
            try:  # one model, and it cannot load: nothing to serve (the single gateway does not start either)
                await models[0].describe.remote()
            except Exception as e:
                reason = " ".join(str(getattr(e, "cause", None) or e).split())
                raise RuntimeError(f"{FAILED} {settings.model}: {reason}") from None

    def __serve_build_asgi_app__(self) -> Any:
        app = create_app(self.settings)
        app.state.gateway.metrics.registry.register(RAY_METRICS)  # the replicas' counts on /metrics
        app.add_middleware(_ReplicaHeader, replica=self.replica)
        return app


# Deployments made of classes importable by name (Ray pickles a class it cannot import by value, globals and all).
MODEL_DEPLOYMENT = serve.deployment(ModelServer)
# The ingress deployment keeps the name it had as `Gateway`: `serve status`, replica actor names and Ray's metrics
# labels name it, and dashboards and scripts written against them keep working.
INGRESS_DEPLOYMENT = serve.deployment(serve.ingress()(RayIngress), name="Gateway")


SECURITY_FILES = ("api_keys_file", "admin_api_keys_file", "ssl_certfile", "ssl_keyfile")


def _resolved(value: str | None) -> str | None:
    """An existing path made absolute; anything else (unset, a hub id, a Triton name) as it is."""
    return str(Path(value).resolve()) if value and Path(value).exists() else value


def _absolute(settings: ServeSettings) -> ServeSettings:
    """MODEL and the security group's files made absolute: replicas do not run in the caller's working directory.
    Every group travels with the copy (Ray pickles the settings to the replicas)."""
    security = settings.security
    files = {f: _resolved(getattr(security, f)) for f in SECURITY_FILES}
    return settings.model_copy(update={"model": _resolved(settings.model),
                                       "security": security.model_copy(update=files)})


def _check(settings: ServeSettings) -> None:
    if not settings.model:
        raise ValueError("no model given: pass REPO (a folder of models) or MODEL (a checkpoint, NAME.onnx, an "
                         "engine)")
    if settings.backend == "triton":
        raise ValueError("--backend triton already runs the models on a Triton server; serve the gateway alone "
                         "(the local engine) in front of it")
    control = settings.repository.model_control
    if control != "none":
        raise ValueError(f"--model-control {control} is not available on Ray Serve: the model deployments are fixed "
                         f"when the application is built (use none; serve again to roll out a new version)")
    if settings.grpc_port is not None:
        raise ValueError("--grpc-port is not served on Ray Serve (HTTP goes through Ray Serve's proxy)")


def check_launch(settings: ServeSettings) -> None:
    """The checks the launching machine can make (one-line errors): what Ray Serve cannot serve, and the gateway's
    `check` of the files; not its TensorRT check, since the replicas load the engine on their own machines
    (a GPU node with TensorRT), and the one launching needs neither."""
    _check(settings)
    spec = LoadSpec.of(settings)
    if resolve_backend(spec) == "tensorrt":
        if not Path(spec.path).exists():
            raise FileNotFoundError(f"no such file: {spec.path}")
        return
    check(spec)


HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": ""}


def actor_options(options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Ray actor options of a replica: `options` with Ray Serve's default of one CPU spelled out, and, when the
    replica reserves no GPU, `CUDA_VISIBLE_DEVICES=""` in its runtime environment (unless `options` set one)."""
    out: dict[str, Any] = {**(options or {})}
    out.setdefault("num_cpus", 1)
    if not out.get("num_gpus"):
        env = dict(out.get("runtime_env") or {})
        env["env_vars"] = {**HIDE_GPUS, **(env.get("env_vars") or {})}
        out["runtime_env"] = env
    return out


@dataclasses.dataclass(frozen=True)
class Deployment:
    """One model deployment's size: `replicas` (the least, when autoscaling), `max_replicas` (None: a fixed
    number), and each replica's `cpus` and `gpus`."""

    replicas: int
    max_replicas: int | None
    cpus: float
    gpus: float

    @property
    def most(self) -> int:
        """The replicas it may reach."""
        return self.replicas if self.max_replicas is None else self.max_replicas

    def options(self, scaling: Mapping[str, Any], actor: Mapping[str, Any]) -> dict[str, Any]:
        """Its Ray Serve options: num_replicas or autoscaling_config (over `scaling`), and ray_actor_options
        (over `actor`; `actor_options`)."""
        resources = {**actor, "num_cpus": self.cpus, "num_gpus": self.gpus}
        if not self.gpus:
            resources.pop("num_gpus")
        out: dict[str, Any] = {"ray_actor_options": actor_options(resources)}
        if self.max_replicas is None:
            out["num_replicas"] = self.replicas
        else:
            out["autoscaling_config"] = {**scaling, "min_replicas": self.replicas, "max_replicas": self.max_replicas}
        return out


def deployment_of(settings: ServeSettings, entry: ModelEntry, num_replicas: int | None = None,
                  autoscaling_config: Mapping[str, Any] | None = None,
                  ray_actor_options: Mapping[str, Any] | None = None) -> Deployment:
    """A model's deployment: its own config's replicas, max_replicas, replica_cpus and replica_gpus
    (`ModelConfig.deployment`), else the arguments', else settings.ray's. ValueError: replicas above
    max_replicas."""
    scaling, actor, own = autoscaling_config or {}, ray_actor_options or {}, settings.ray
    replicas = num_replicas if num_replicas is not None else scaling.get("min_replicas", own.replicas)
    most = scaling.get("max_replicas", own.max_replicas)
    gpus = actor.get("num_gpus", own.replica_gpus) or 0.0
    out = Deployment(*entry.config.deployment(replicas, most, actor.get("num_cpus", own.replica_cpus), gpus))
    if out.max_replicas is not None and out.max_replicas < out.replicas:
        raise ValueError(f"model {entry.name}: replicas ({out.replicas}) is above max_replicas ({out.max_replicas})")
    return out


@dataclasses.dataclass(frozen=True)
class ResourceRequest:
    """What an application reserves at most: `deployments` model deployments of `replicas` replicas each (an
    autoscaling one's max_replicas), each replica `replica_cpus` and `replica_gpus`, and `ingress_replicas` of
    `ingress_cpus` each; `own`: the models whose config.toml sizes their deployment otherwise, by name (not
    counted in `deployments`)."""

    deployments: int
    replicas: int
    replica_cpus: float
    replica_gpus: float
    ingress_replicas: int
    ingress_cpus: float
    autoscaling: bool = False
    own: tuple[tuple[str, Deployment], ...] = ()


def _amount(x: float) -> str:
    return f"{x:g}"


def resource_shortfall(request: ResourceRequest, total: Mapping[str, float],
                       available: Mapping[str, float] | None = None) -> str | None:
    """Why the cluster (`ray.cluster_resources()`, and `ray.available_resources()` when given) cannot place every
    replica of `request`, in one line with the numbers; None when it can. Ray would otherwise wait for ever."""
    models = request.deployments * request.replicas
    replicas = f"{request.replicas} replica" + ("s" if request.replicas != 1 else "")
    head = (f"{request.deployments} model deployments x {replicas}" if request.deployments > 1
            else f"{request.replicas} model {replicas.split()[1]}")
    if request.autoscaling:
        head = f"up to {head} (--max-replicas)"
    flags = "--max-replicas" if request.autoscaling else "--replicas"
    own_cpus = sum(d.most * d.cpus for _, d in request.own)
    own_gpus = sum(d.most * d.gpus for _, d in request.own)
    cpus = "".join(f" + {name}: {d.most} x {_amount(d.cpus)} CPU" for name, d in request.own)
    gpus = "".join(f" + {name}: {d.most} x {_amount(d.gpus)} GPU" for name, d in request.own if d.gpus)
    if request.own:
        flags += " (or a model's config.toml replicas, max_replicas)"
    for unit, key, need, parts, knob in (
        ("CPU", "CPU", models * request.replica_cpus + own_cpus + request.ingress_replicas * request.ingress_cpus,
         f"{head} x {_amount(request.replica_cpus)} CPU{cpus} + {request.ingress_replicas} ingress x "
         f"{_amount(request.ingress_cpus)} CPU", "--replica-cpus"),
        ("GPU", "GPU", models * request.replica_gpus + own_gpus, f"{head} x {_amount(request.replica_gpus)} GPU{gpus}",
         "--replica-gpus"),
    ):
        have = float(total.get(key, 0.0))
        free = have if available is None else min(have, float(available.get(key, 0.0)))
        if need <= free + 1e-9:
            continue
        has = f"the cluster has {_amount(have)}" + (f" ({_amount(free)} free)" if free < have - 1e-9 else "")
        return f"{parts} = {_amount(need)} {unit}s, {has}: lower {flags} or {knob}"
    return None


def _limits(settings: ServeSettings, entry: ModelEntry) -> tuple[int, float]:
    """(max_batch, max_delay_ms) of a model: its own config's, else the settings' (as the gateway's repository
    reads them, `ModelConfig.over`); (1, 0) when batching is off."""
    limits = entry.config.over(settings.limits)
    return (limits.max_batch, limits.max_delay_ms) if limits.batching else (1, 0.0)


def served_versions(settings: ServeSettings) -> list[tuple[ModelEntry, VersionSource]]:
    """The model versions of settings.model that the gateway would serve (each model's version policy, else the
    settings', chosen as the gateway's repository chooses them: `select_versions`)."""
    default = VersionPolicy.parse(settings.repository.version_policy)
    chosen: list[tuple[ModelEntry, VersionSource]] = []
    for name, entry in sorted(scan(settings.model, settings.model_name).items()):
        if entry.error is not None:
            log.warning("model %s is not served: %s", name, entry.error)
        chosen += [(entry, entry.versions[v]) for v in select_versions(entry, default)]
    return chosen


def build_app(settings: ServeSettings, num_replicas: int | None = None,
              autoscaling_config: dict[str, Any] | None = None,
              ray_actor_options: dict[str, Any] | None = None, ingress_replicas: int | None = None,
              ingress_actor_options: dict[str, Any] | None = None, max_ongoing_requests: int | None = None,
              startup_timeout_s: float = 600.0) -> serve.Application:
    """The application: the gateway's ingress (`ingress_replicas`, `ingress_actor_options`) and one deployment
    per model version (`num_replicas`, or `autoscaling_config`; `ray_actor_options`, e.g. {"num_gpus": 1}: the
    defaults of the models whose config.toml sets none, settings.ray's where None, `deployment_of`;
    `max_ongoing_requests` per model replica, default twice its batch so that one batch fills while one runs).
    Replicas without a GPU see none (`actor_options`). ValueError for what Ray Serve cannot serve;
    FileNotFoundError for a missing MODEL."""
    return _build(settings, num_replicas, autoscaling_config, ray_actor_options, ingress_replicas,
                  ingress_actor_options, max_ongoing_requests, startup_timeout_s)[0]


def _build(settings: ServeSettings, num_replicas: int | None = None, autoscaling_config: dict[str, Any] | None = None,
           ray_actor_options: dict[str, Any] | None = None, ingress_replicas: int | None = None,
           ingress_actor_options: dict[str, Any] | None = None, max_ongoing_requests: int | None = None,
           startup_timeout_s: float = 600.0) -> tuple[serve.Application, ResourceRequest]:
    """`build_app`, and what the application reserves at most."""
    check_launch(settings)
    settings = _absolute(settings)
    sizes = (num_replicas, autoscaling_config, ray_actor_options)
    common = deployment_of(settings, ModelEntry(""), *sizes)  # a model without its own config's
    models: list[serve.Application] = []
    own: list[tuple[str, Deployment]] = []
    for entry, source in served_versions(settings):
        max_batch, delay_ms = _limits(settings, entry)
        size = deployment_of(settings, entry, *sizes)
        if size != common:
            own.append((entry.name, size))
        options: dict[str, Any] = {
            "name": deployment_name(entry.name, source.path),
            "max_ongoing_requests": max_ongoing_requests or 2 * max_batch,
            **size.options(autoscaling_config or {}, ray_actor_options or {}),
        }
        # --backend openvino runs the ONNX exports too, and a model's own runtime and precision hold, as locally.
        backend = "openvino" if settings.backend == "openvino" and source.backend == "onnxruntime" else source.backend
        runtime = {k: v for k, v in entry.config.given().items()
                   if k in ("runtime", "precision", "performance_hint", "streams", "force_precision")}
        spec = LoadSpec.of(settings, path=str(source.path), backend=backend, name=entry.name, engine="local",
                           **runtime)
        if Path(settings.model).is_dir() and resolve_backend(spec) != "torch":  # as the local repository does:
            spec = spec.replace(tome=None, compile=False, torchscript=False)  # for its checkpoints only
        models.append(MODEL_DEPLOYMENT.options(**options).bind(spec, source.version, max_batch, delay_ms))
    if not models:
        raise ValueError(f"no model to serve in {settings.model}")
    front = actor_options(ingress_actor_options)
    ingress_replicas = settings.ray.ingress_replicas if ingress_replicas is None else ingress_replicas
    ingress = INGRESS_DEPLOYMENT.options(num_replicas=ingress_replicas, max_ongoing_requests=settings.limits.max_queue,
                                         ray_actor_options=front)
    request = ResourceRequest(len(models) - len(own), common.most, float(common.cpus), float(common.gpus),
                              ingress_replicas, float(front["num_cpus"]), common.max_replicas is not None, tuple(own))
    return ingress.bind(settings.model_copy(update={"engine": "ray"}), models, startup_timeout_s), request


def _why_not_started(e: Exception, name: str) -> str:
    """The ingress's own reason (`FAILED ...`) from Ray's status of the application, else Ray's first line."""
    texts = [str(e)]
    try:
        status = serve.status().applications.get(name)
        if status is not None:
            texts += [status.message, *(d.message for d in status.deployments.values())]
    except Exception:  # the controller is gone: Ray's own message
        pass
    lines = [line.strip() for text in texts for line in text.splitlines() if line.strip()]
    ours = [line[line.index(FAILED):] for line in lines if f"RuntimeError: {FAILED} " in line]
    return ours[-1] if ours else (lines[0] if lines else type(e).__name__)


# Ray Serve gives its HTTP proxy 5 s to start and then kills it, which fails serve.start on a loaded 2-core machine
# (a fresh worker process imports Ray Serve and uvicorn first). Read by the Serve controller, which inherits the
# environment of the local cluster that `start_ray` starts; a cluster started elsewhere keeps its own setting.
SERVE_ENV_DEFAULTS = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60"}
RAY_START_TIMEOUT = "timed out during startup"  # ray._private.node's message when a local node is slow to start


def start_ray(address: str | None = None, **init_options: Any) -> None:
    """`ray.init(address, **init_options)` (no address: a local cluster, tried once more when Ray says its node
    timed out during startup), with SERVE_ENV_DEFAULTS for the variables the environment does not set."""
    for key, value in SERVE_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        ray.init(address=address, **init_options)
    except Exception as e:
        # Ray gives a new local node a fixed 30 s to register with its GCS; on a loaded 2-core machine that can
        # pass. One more try, after cleaning up the half-started node, is what a user would do by hand.
        if address is not None or RAY_START_TIMEOUT not in str(e):
            raise
        ray.shutdown()
        ray.init(address=address, **init_options)


def run(settings: ServeSettings, address: str | None = None, blocking: bool = True, name: str = APP_NAME,
        route_prefix: str = "/", **options: Any) -> DeploymentHandle:
    """Start (or join, `address`: "auto", "ray://HOST:PORT") a Ray cluster, the Ray Serve proxy on settings.host
    and settings.port (a proxy already running keeps its own), and the application `name` at `route_prefix`
    (`build_app(settings, **options)`); with `blocking`, serve until interrupted, then delete it. RuntimeError
    (one line, the reason) when it does not start, or when the cluster cannot place its replicas
    (`resource_shortfall`; an application of that name already running is replaced, so only the cluster's total
    counts then)."""
    app, request = _build(settings, **options)
    settings = _absolute(settings)  # the proxy reads the TLS files in its own process
    if not ray.is_initialized():
        start_ray(address, logging_level=logging.WARNING)
    http = {"host": settings.host, "port": settings.port}
    tls = settings.security
    if tls.ssl_certfile:
        http |= {"ssl_certfile": tls.ssl_certfile, "ssl_keyfile": tls.ssl_keyfile}
    serve.start(http_options=http)
    replacing = name in serve.status().applications
    short = resource_shortfall(request, ray.cluster_resources(), None if replacing else ray.available_resources())
    if short:
        raise RuntimeError(f"the Ray Serve application cannot start: {short}")
    try:
        handle = serve.run(app, name=name, route_prefix=route_prefix)
    except Exception as e:
        raise RuntimeError(f"the Ray Serve application did not start: {_why_not_started(e, name)}") from None
    log.info("serving %s on http://%s:%d%s (Ray Serve)", name, settings.host, settings.port, route_prefix)
    if not blocking:
        return handle
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        serve.delete(name)
    return handle
