"""A model version served by its own Ray Serve deployment: the backend of a gateway running as a Ray Serve ingress.

`vit_serve.deploy.ray.build_app` makes one deployment per model version, named by `deployment_name`, whose
replicas load the model with `vit_serve.runtime.load` (torch, onnxruntime, tensorrt) and batch with the gateway's
scheduler (`vit_serve.runtime.scheduling`).
In the ingress (`LoadSpec.engine` "ray"), `load` gives a `RayModelBackend` for every version the
repository loads: a `RemoteBackend` (its replicas batch, so the gateway drives it with a `DirectRunner`) that
sends each request to the deployment's handle, with the `ModelInfo` its replica loaded.

Each answer names the replica and the size of the batch it ran in; `RAY_METRICS` counts them per replica
(`vit_serve_ray_requests_total`, `vit_serve_ray_batch_size`), and the ingress serves them on /metrics beside the
gateway's own. Imported only with engine="ray": nothing else in vit_serve.runtime needs Ray.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram

from vit_serve.runtime.backends.base import NO_OPTIONS, CallOptions, RemoteBackend
from vit_serve.runtime.errors import BackendUnavailableError
from vit_serve.runtime.metrics import BATCH_BUCKETS, MODEL
from vit_serve.runtime.spec import LoadSpec
from vit_serve.runtime.task import Outputs, Task

try:
    from ray import serve
    from ray.exceptions import RayError, RayTaskError
except ImportError:  # the extra is missing
    raise ImportError("engine=ray needs Ray Serve: pip install 'vit-serve[ray]' (ray[serve])") from None

# Process-wide: an ingress replica is one process serving one gateway app (vit_serve.deploy.ray registers it).
RAY_METRICS = CollectorRegistry(auto_describe=True)
REPLICA_REQUESTS = Counter("vit_serve_ray_requests", "requests answered by each model replica",
                           [*MODEL, "replica"], registry=RAY_METRICS)
REPLICA_BATCH = Histogram("vit_serve_ray_batch_size", "images in the replica's batch that each request ran in",
                          MODEL, buckets=BATCH_BUCKETS, registry=RAY_METRICS)


log = logging.getLogger("vit_serve.runtime.backends.ray")
# How long the ingress waits, at most, for a model deployment to describe itself when it loads that model.
DESCRIBE_WAIT_S = 300.0


def deployment_name(model: str, path: str | Path) -> str:
    """The deployment of the model version `model` served from `path` (an absolute path: the ingress and
    `build_app` find the same files): the model name, then a digest of the path (versions differ by it)."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", model)[:64]
    return f"{slug}-{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"


class RayModelBackend(RemoteBackend):
    """A handle on the deployment of one model version; built in the ingress by `vit_serve.runtime.load`."""

    name = "ray"

    def __init__(self, spec: LoadSpec) -> None:
        try:
            app = serve.get_replica_context().app_name
        except Exception:
            raise RuntimeError("engine=ray runs the gateway inside Ray Serve, as the ingress of "
                               "vit_serve.deploy.ray.build_app (vit-serve serve --engine ray)") from None
        self.deployment = deployment_name(spec.name or Path(spec.path).stem, spec.path)
        self.timeout_s = spec.limits.request_timeout_s
        self.handle = serve.get_deployment_handle(self.deployment, app_name=app)
        described = self._describe()
        self.version = str(described["version"])
        self.supports_grad_rollout = bool(described["grad_rollout"])
        self.info = dataclasses.replace(described["info"], device="remote")  # the gateway decodes on its CPU

    def _describe(self) -> dict[str, Any]:
        """What the deployment's replica loaded, in the model thread. Its replicas are up (the ingress waited for
        them), yet a new handle's first call can take longer than one request's timeout on a loaded machine (Ray
        routes it once the controller has told this process where the replicas are): tried again until
        DESCRIBE_WAIT_S, else a refused load would stay refused for as long as the application runs."""
        deadline = time.monotonic() + max(DESCRIBE_WAIT_S, self.timeout_s)
        while True:
            try:
                return self.handle.describe.remote().result(timeout_s=self.timeout_s)
            except RayTaskError as e:  # the replica's own reason (the model cannot load): no retry helps
                raise _cause(e) from None
            except (RayError, TimeoutError) as e:
                if time.monotonic() + 1.0 >= deadline:
                    raise BackendUnavailableError(f"deployment {self.deployment!r} does not answer: "
                                                  f"{' '.join(str(e).split())[:300] or type(e).__name__}") from None
                log.warning("deployment %r does not answer yet (%s); trying again", self.deployment,
                            type(e).__name__)
                time.sleep(1.0)

    async def run(self, task: Task, x: np.ndarray, options: CallOptions = NO_OPTIONS) -> Outputs:
        """One call to the deployment, with the seconds left to the request's deadline and its level: the
        replica's runner queues it by them."""
        try:
            outputs, replica, rows = await self.handle.run.remote(task, x, options.timeout_s, options.priority)
        except RayTaskError as e:  # what the replica raised (NotImplementedError: 400, ...)
            raise _cause(e) from None
        except RayError as e:  # no replica, replica died, back-pressure
            raise BackendUnavailableError(f"the {self.info.name} deployment cannot answer: "
                                          f"{' '.join(str(e).split())[:300]}") from None
        REPLICA_REQUESTS.labels(self.info.name, self.version, replica).inc()
        REPLICA_BATCH.labels(self.info.name, self.version).observe(rows)
        return outputs

    async def ready(self) -> bool:
        try:
            return bool(await asyncio.wait_for(self.handle.ready.remote(), self.timeout_s))
        except (RayError, TimeoutError):
            return False

    async def close(self) -> None:
        """Nothing to release: the deployment belongs to the application."""


def _cause(e: RayTaskError) -> Exception:
    """The exception the replica raised (its message without the remote traceback)."""
    cause: Any = e.cause
    return cause if isinstance(cause, Exception) else RuntimeError(str(e).splitlines()[-1])
