"""The Open Inference Protocol's model repository extension, as Triton serves it over HTTP.

`POST /v2/repository/index` lists every model of the repository with each version's state (`{"ready": true}`
in the body: only the versions in service); `POST /v2/repository/models/{name}/load` loads a model (again, from
its folder: new versions in, removed ones out) and `.../unload` unloads it. Load and unload need
`--model-control explicit` (Triton's rule; otherwise 400 saying so); tritonclient's
`get_model_repository_index`, `load_model` and `unload_model` work against these routes. `--no-repository-api`
(VIT_SERVE_REPOSITORY_API=false) answers 403 on all three.

`POST /v2/repository/models/{name}/traffic` (admin keys only, in any model control mode) replaces the model's
traffic split: `{"traffic": {"1": 90, "2": 10}, "shadow": {"version": 3, "share": 25} | null}` (weights relative;
`{}` / null: the newest version takes every request). Every version named must be in service; the new policy is
swapped in as one object and answered back with the primary it gives (`traffic`).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request
from pydantic import ValidationError

from vit_serve.serve.deps import GatewayDep
from vit_serve.serve.errors import V2, BadRequestError
from vit_serve.serve.repository import ModelRepository
from vit_serve.serve.schemas import StrictJSONResponse, TrafficSpec
from vit_serve.serve.v2_model import repository_of
from vit_serve.serve.v2_protocol import load_json

router = APIRouter(prefix=f"{V2}/repository", tags=["v2 repository extension"])  # in routes.v2's group
V2_ERROR = {"content": {"application/json": {"schema": {"type": "object", "properties": {"error": {
    "type": "string"}}}}}}
ERRORS = {400: V2_ERROR, 403: V2_ERROR, 503: V2_ERROR}
NameDep = Annotated[str, Path(description="a model of the repository (POST /v2/repository/index lists them)")]
BODY = {"requestBody": {"required": False, "content": {"application/json": {"schema": {"type": "object"}}}}}


async def repository(gateway: GatewayDep) -> ModelRepository:
    """The repository (403 with the repository API off, 503 while loading: `v2_model.repository_of`)."""
    return repository_of(gateway)


RepositoryDep = Annotated[ModelRepository, Depends(repository)]


async def _body(request: Request) -> dict:
    raw = await request.body()
    if not raw.strip():
        return {}
    body = load_json(raw, "the body")  # 400 for nesting too deep to parse, too
    if not isinstance(body, dict):
        raise BadRequestError("the body must be a JSON object")
    return body


@router.post("/index", responses=ERRORS, openapi_extra=BODY)
async def index(request: Request, repo: RepositoryDep) -> StrictJSONResponse:
    """`[{"name", "version", "state", "reason"}]`, one per model version (a model never loaded: its name only);
    body `{"ready": true}`: the versions in service only."""
    body = await _body(request)
    ready = body.get("ready", False)
    if not isinstance(ready, bool):
        raise BadRequestError("'ready' must be true or false")
    rows = []
    for row in repo.index():
        if ready and row.state != "READY":
            continue
        item: dict[str, str] = {"name": row.name}
        if row.version is not None:
            item["version"] = str(row.version)
        if row.state is not None:
            item["state"] = row.state
            item["reason"] = row.reason
        rows.append(item)
    return StrictJSONResponse(rows)


@router.post("/models/{name}/load", responses=ERRORS, openapi_extra=BODY)
async def load(name: NameDep, request: Request, repo: RepositoryDep) -> StrictJSONResponse:
    """Load `name` from the repository (its version policy picks the versions); 200 once they are warmed up
    and in service, 400 with the reason when it cannot be."""
    body = await _body(request)
    if body.get("parameters") not in (None, {}) and not isinstance(body.get("parameters"), dict):
        raise BadRequestError("'parameters' must be an object")
    await repo.load(name)
    return StrictJSONResponse({})


@router.post("/models/{name}/unload", responses=ERRORS, openapi_extra=BODY)
async def unload(name: NameDep, request: Request, repo: RepositoryDep) -> StrictJSONResponse:
    """Stop serving `name`: new requests get 503, those already routed to it finish."""
    await _body(request)
    await repo.unload(name)
    return StrictJSONResponse({})


TRAFFIC_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "$ref": "#/components/schemas/TrafficSpec"}}}}}


@router.post("/models/{name}/traffic", responses={**ERRORS, 404: V2_ERROR}, response_model=TrafficSpec,
             openapi_extra=TRAFFIC_BODY)
async def traffic(name: NameDep, request: Request, repo: RepositoryDep) -> StrictJSONResponse:
    """Replace `name`'s traffic split: `{"traffic": {"VERSION": weight, ...}, "shadow": {"version", "share"} |
    null}`; answers the policy now in force with its `primary`. 400 naming what is wrong (a version not in
    service, a negative weight, weights adding up to 0, a share outside (0, 100])."""
    body = await _body(request)
    unknown = sorted(set(body) - {"traffic", "shadow", "primary"})
    if unknown:
        raise BadRequestError(f"unknown field {', '.join(map(repr, unknown))} (the body has 'traffic' and 'shadow')")
    try:
        spec = TrafficSpec.model_validate({"traffic": body.get("traffic") or {}, "shadow": body.get("shadow")},
                                          strict=False)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise BadRequestError(f"{where}: {first['msg']}") from None
    policy = repo.set_traffic(name, spec)
    return StrictJSONResponse(policy.to_spec(repo.served.get(name, {})).model_dump())
