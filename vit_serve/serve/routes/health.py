"""GET /healthz (the process answers) and GET /readyz (model loaded, warmed up, backend reachable).

/readyz is open to anyone (probes), so its `reason` is a short state that names no file, host or exception text;
the full reason is logged (once, when it changes) and shown, behind the key, by GET /models. The other open
readiness probes answer the same state (`public_reason`): /v2/health/ready's `error`; gRPC ServerReady and
ModelReady answer true / false only.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request

from vit_serve.serve.deps import GatewayDep
from vit_serve.serve.gateway import Gateway
from vit_serve.serve.model_version import ModelVersion
from vit_serve.serve.schemas import Health, Readiness, StrictJSONResponse

router = APIRouter(tags=["health"])
log = logging.getLogger("vit_serve.serve")
WHY = "GET /models says why"


@router.get("/healthz", response_model=Health)
async def healthz() -> dict:
    """Liveness: `{"status": "ok"}` whenever the server answers at all."""
    return {"status": "ok"}


def _version_state(v: ModelVersion) -> str:
    if not v.warm:
        return f"the warm-up failed ({WHY})" if v.error else "warming up"
    return f"the {v.backend.name} backend is not ready"


def public_reason(gateway: Gateway) -> str:
    """Why the gateway is not ready, in words fit for anyone: states and model names only."""
    if gateway.draining:
        return "draining"  # shutting down (vit_serve.serve.shutdown): still answering, taking no new traffic
    repo = gateway.repository
    if repo is None or not gateway.started:
        return "the models are loading"
    name = repo.default_name
    if name is not None:
        newest = repo.newest(name)
        return f"model {name!r} is not loaded ({WHY})" if newest is None else _version_state(newest)
    loaded = repo.loaded()
    if not loaded:
        return "no model is loaded"
    cold = [v for v in loaded if not v.warm]
    return "; ".join(f"{v.label}: {_version_state(v)}" for v in cold) or f"a model's backend is not ready ({WHY})"


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
async def readyz(request: Request, gateway: GatewayDep) -> StrictJSONResponse:
    """Readiness: 200 `{"ready": true, "model", "backend"}` once the default model (or, when there is none, every
    loaded model) is loaded and warmed up and its backend answers; 503 `{"ready": false, "reason"}` before that
    (or while a Triton server is unreachable, or `"draining"` once the server is shutting down: it still answers
    for `shutdown_drain_s`), the reason a short state (GET /models has the details). A model
    of the repository that failed to load is shown by GET /models and does not make the gateway unready."""
    ok, detail = await gateway.readiness()
    state = request.app.state
    if detail != getattr(state, "readiness_detail", None):  # logged when it changes, not at every probe
        state.readiness_detail = detail
        if not ok:
            log.info("not ready: %s", detail)
    repo = gateway.repository
    name = repo.default_name if repo is not None else None
    newest = repo.newest(name) if repo is not None else None
    body = Readiness(ready=ok, model=name, backend=newest.backend.name if newest else None,
                     reason=None if ok else public_reason(gateway))
    return StrictJSONResponse(body.model_dump(exclude_none=True), status_code=200 if ok else 503)
