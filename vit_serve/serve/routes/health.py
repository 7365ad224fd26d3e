"""GET /healthz (the process answers) and GET /readyz (model loaded, warmed up, backend reachable)."""

from __future__ import annotations

from fastapi import APIRouter

from vit_serve.serve.deps import GatewayDep
from vit_serve.serve.schemas import Health, Readiness, StrictJSONResponse

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
async def healthz() -> dict:
    """Liveness: `{"status": "ok"}` whenever the server answers at all."""
    return {"status": "ok"}


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
async def readyz(gateway: GatewayDep) -> StrictJSONResponse:
    """Readiness: 200 `{"ready": true, "model", "backend"}` once the default model (or, when there is none, every
    loaded model) is loaded and warmed up and its backend answers; 503 `{"ready": false, "reason"}` before that
    (or while a Triton server is unreachable). A model of the repository that failed to load is shown by
    GET /models and does not make the gateway unready."""
    ok, reason = await gateway.readiness()
    repo = gateway.repository
    name = repo.default_name if repo is not None else None
    newest = repo.newest(name) if repo is not None else None
    body = Readiness(ready=ok, model=name, backend=newest.backend.name if newest else None, reason=reason)
    return StrictJSONResponse(body.model_dump(exclude_none=True), status_code=200 if ok else 503)
