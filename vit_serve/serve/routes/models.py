"""GET /models: the repository's models, their versions and states, for people and for the web page."""

from __future__ import annotations

from fastapi import APIRouter

from vit_serve.serve.deps import GatewayDep
from vit_serve.serve.errors import NotReadyError
from vit_serve.serve.schemas import ModelsResponse

router = APIRouter(tags=["models"])


@router.get("/models", response_model=ModelsResponse)
async def models(gateway: GatewayDep) -> dict:
    """Every model of the repository: `{"default_model", "model_control", "models": [{"name", "default",
    "versions": [{"version", "state", "reason", "backend", "resolution", "num_classes", "explain",
    "memory_bytes", "in_flight"}]}]}`. States are Triton's (READY, LOADING, UNLOADING, UNAVAILABLE with its
    reason); a model never loaded has one entry with version and state null."""
    repo = gateway.repository
    if repo is None:
        raise NotReadyError("the models are loading", headers={"Retry-After": "1"})
    default = repo.default_name
    out: dict[str, dict] = {}
    for row in repo.index():
        entry = out.setdefault(row.name, {"name": row.name, "default": row.name == default, "versions": []})
        version = {"version": row.version, "state": row.state, "reason": row.reason}
        mv = repo.served.get(row.name, {}).get(row.version) if row.version is not None else None
        if mv is not None:
            info = mv.info
            version.update(backend=mv.backend.name, resolution=info.resolution, num_classes=info.num_classes,
                           explain=info.explain, memory_bytes=mv.memory_bytes, in_flight=mv.in_flight)
        entry["versions"].append(version)
    return {"default_model": default, "model_control": gateway.settings.repository.model_control,
            "models": list(out.values())}
