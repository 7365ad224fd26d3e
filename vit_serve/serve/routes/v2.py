"""The Open Inference Protocol (KServe v2 / Triton HTTP) under /v2, with the binary tensor data extension.

Every model of the repository is under `/v2/models/{name}` (its newest version in service) and
`/v2/models/{name}/versions/{version}`. A model has two inputs, of which a request sends one: `pixel_values` FP32
[-1, 3, H, W] (preprocessed with the contract in `GET /v2/models/{name}` parameters) or `image` BYTES [-1] (encoded
images, preprocessed here); and outputs `logits` FP32 [-1, K] and, when the backend can explain, `rollout` FP32
[-1, gh, gw] (attention rollout; request parameters `head_fusion` / `discard_ratio` choose its settings). A request
naming no outputs gets all of them (raw with `parameters.binary_data_output`, as Triton; tritonclient sets it). An
output with `parameters.classification = k` comes back as Triton's classification extension: BYTES [B, k] of
"logit:index:label" (v2_protocol). Health answers the KServe bodies (`{"live": true}`, `{"ready": true}`, `{"name",
"ready"}`) with Triton's status codes (200, or 503 when not ready). Errors answer `{"error": message}`.

A request carries at most `max_images_per_request` images (by default the model's max_batch), checked from its
tensors' shapes before anything is decoded (`v2_model.request_bounds`): beyond it, 400 naming the limit.
"""

from __future__ import annotations

import zlib
from typing import Annotated

from fastapi import APIRouter, Path, Request
from fastapi.responses import Response
from pydantic import BaseModel

from vit_serve.serve import pipeline, v2_model
from vit_serve.serve.admission import admission_of
from vit_serve.serve.caller import caller_scope
from vit_serve.serve.deps import SESSION_HEADER, GatewayDep, ModelChoice
from vit_serve.serve.errors import V2, BadRequestError, TooLargeError, UnsupportedMediaError
from vit_serve.serve.gateway import Gateway
from vit_serve.serve.labels import LabelCaller
from vit_serve.serve.routes import health, repository
from vit_serve.serve.schemas import StrictJSONResponse
from vit_serve.serve.slow_clients import body_clock
from vit_serve.serve.v2_model import model_metadata, versions
from vit_serve.serve.v2_protocol import (
    HEADER_LENGTH,
    InferRequest,
    RequestBounds,
    encode_infer_response,
    parse_infer_request,
)

__all__ = ["model_metadata", "router"]  # model_metadata lives in v2_model; importable from here as before

# All of /v2, one router group: the protocol's routes below, then the repository extension (routes.repository),
# each declared with its whole path (a matched route's path is the metrics' endpoint label). Its errors answer
# `{"error": message}` (serve.errors.envelope: the V2 prefix, routed or not).
router = APIRouter()
protocol = APIRouter(prefix=V2, tags=["v2 (Open Inference Protocol)"])
V2_ERROR = {"content": {"application/json": {"schema": {"type": "object", "properties": {"error": {
    "type": "string"}}}}}}
NameDep = Annotated[str, Path(description="the model's name (GET /v2/models/{name} lists it)")]
VersionDep = Annotated[str, Path(description="a version of the model in service (its metadata lists them)")]
# OpenAPI links from a model's metadata to the calls that take its name (stateful clients chain them).
_BY_NAME = {"name": "$response.body#/name"}
MODEL_LINKS = {"links": {
    "ModelReady": {"operationRef": "#/paths/~1v2~1models~1{name}~1ready/get", "parameters": _BY_NAME},
    "ModelInfer": {"operationRef": "#/paths/~1v2~1models~1{name}~1infer/post", "parameters": _BY_NAME},
    "VersionMetadata": {"operationRef": "#/paths/~1v2~1models~1{name}~1versions~1{version}/get",
                        "parameters": {**_BY_NAME, "version": "$response.body#/versions/0"}},
}}


class ServerLive(BaseModel):
    live: bool


class ServerReady(BaseModel):
    ready: bool


class ModelReady(BaseModel):
    name: str
    ready: bool


@protocol.get("", responses={200: {"description": "server metadata"}})
async def server_metadata() -> dict:
    """`{"name", "version", "extensions"}`."""
    return v2_model.server_metadata()


@protocol.get("/health/live", response_model=ServerLive)
async def live() -> dict:
    """200 `{"live": true}` while the server answers."""
    return {"live": True}


@protocol.get("/health/ready", response_model=ServerReady, responses={503: {"model": ServerReady}})
async def ready(gateway: GatewayDep) -> StrictJSONResponse:
    """200 `{"ready": true}` once the model is loaded, warmed up and its backend answers; 503 `{"ready": false,
    "error": why}` before, `why` the short state /readyz answers (open to anyone: no file, host or exception
    text; GET /models says more), and `"error": "draining"` once the server is shutting down."""
    ok, _ = await gateway.readiness()
    body = {"ready": True} if ok else {"ready": False, "error": health.public_reason(gateway)}
    return StrictJSONResponse(body, 200 if ok else 503)


@protocol.get("/models/{name}", responses={200: MODEL_LINKS, 404: V2_ERROR, 503: V2_ERROR})
async def metadata(name: NameDep, gateway: GatewayDep) -> dict:
    """Model metadata (its newest version in service): inputs `pixel_values` FP32 [-1, 3, H, W] and `image`
    BYTES [-1] (send one), outputs `logits` FP32 [-1, K] and `rollout` FP32 [-1, gh, gw] (with an explain graph);
    `versions`: those in service, newest first; parameters: the preprocessing contract and the labels."""
    return model_metadata(gateway.model(name), versions(gateway, name))


@protocol.get("/models/{name}/versions/{version}", responses={404: V2_ERROR, 503: V2_ERROR})
async def version_metadata(name: NameDep, version: VersionDep, gateway: GatewayDep) -> dict:
    """The same, for one version."""
    return model_metadata(gateway.model(name, version), versions(gateway, name))


async def _ready(gateway: Gateway, name: str, version: str | None) -> StrictJSONResponse:
    mv = gateway.model(name, version)
    ok, why = await mv.readiness()
    body = {"name": name, "ready": ok, **({} if ok else {"error": why})}
    return StrictJSONResponse(body, 200 if ok else 503)


READY_DOC = {"response_model": ModelReady, "responses": {404: V2_ERROR, 503: {"model": ModelReady}}}


@protocol.get("/models/{name}/ready", **READY_DOC)
async def model_ready(name: NameDep, gateway: GatewayDep) -> StrictJSONResponse:
    """200 `{"name", "ready": true}` when the model is ready, 503 (`"ready": false`) before, 404 for a name the
    repository does not have."""
    return await _ready(gateway, name, None)


@protocol.get("/models/{name}/versions/{version}/ready", **READY_DOC)
async def version_ready(name: NameDep, version: VersionDep, gateway: GatewayDep) -> StrictJSONResponse:
    """The same, for one version."""
    return await _ready(gateway, name, version)


def _decompress(body: bytes, encoding: str, limit: int) -> bytes:
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise UnsupportedMediaError(f"Content-Encoding {encoding!r} is not supported (gzip, deflate or none)")
    d = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error as e:
        raise BadRequestError(f"cannot decompress the {encoding} body ({e})") from e
    if len(out) > limit:
        raise TooLargeError(f"the decompressed body is larger than the limit of {limit} bytes "
                            f"(VIT_SERVE_MAX_BODY_BYTES)")
    return out


INFER_DOC = {
    "response_class": Response,
    "responses": {200: {"description": "outputs (JSON, or JSON + binary tensors)"}, 400: V2_ERROR, 404: V2_ERROR,
                  413: V2_ERROR, 415: V2_ERROR, 503: V2_ERROR, 504: V2_ERROR},
    "openapi_extra": {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"type": "object"}},
        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}},
}


@protocol.post("/models/{name}/infer", **INFER_DOC)
async def infer(name: NameDep, request: Request, gateway: GatewayDep) -> Response:
    """Inference: `{"id"?, "inputs": [{"name", "datatype", "shape", "data" | parameters.binary_data_size}], "outputs"?:
    [{"name", "parameters": {"binary_data", "classification"}}], "parameters"?: {"binary_data_output", "head_fusion",
    "discard_ratio", "timeout" (µs, Triton's: 0 none), "priority" (Triton's levels: 1 first, up to
    VIT_SERVE_PRIORITY_LEVELS; it may lower the API key's level, never raise it)}}` -> `{"model_name", "model_version",
    "id"?, "outputs": [{"name", "datatype", "shape", "data" | parameters.binary_data_size}]}` (+ raw tensors after the
    JSON, with the `Inference-Header-Content-Length` header, when any output is binary). `classification: k` answers
    BYTES [B, k] of "logit:index:label" (Triton's classification extension); NaN / inf in JSON data are null. The
    model's newest version in service answers, or its traffic split's draw (sticky per `X-Session-Id`; `model_version`
    says which)."""
    session = request.headers.get(SESSION_HEADER) or None  # sticky traffic splits (deps.SessionHeader)
    return await _infer(request, gateway, ModelChoice(gateway, name, None, session))


@protocol.post("/models/{name}/versions/{version}/infer", **INFER_DOC, include_in_schema=False)  # Triton's alias
async def version_infer(name: NameDep, version: VersionDep, request: Request, gateway: GatewayDep) -> Response:
    """The same, for one version."""
    return await _infer(request, gateway, ModelChoice(gateway, name, version))


async def _infer(request: Request, gateway: Gateway, choice: ModelChoice) -> Response:
    """The request through the one pipeline (404 / 503 before the body is read; the version chosen once, then kept
    unless it left service meanwhile), its outputs shaped into the protocol's body."""

    def parse(raw: bytes, bounds: RequestBounds) -> InferRequest:
        body = _decompress(raw, request.headers.get("content-encoding", "").strip().lower(),
                           gateway.settings.max_body_bytes)
        return parse_infer_request(body, request.headers.get(HEADER_LENGTH), bounds)

    async def caller() -> LabelCaller:
        return LabelCaller.of(request.app, await caller_scope(request))  # whose label cache and rate

    source = pipeline.TensorRequest(request.body, parse, caller, body_clock(request.scope))
    done = await pipeline.answer_tensors(choice, admission_of(request.scope), source)
    outputs = v2_model.output_tensors(done.request, done.wanted, done.answer)
    content, headers = encode_infer_response(done.model, done.version, done.request.id, outputs)
    return Response(content, headers=headers, media_type=headers["Content-Type"])


router.include_router(protocol)
router.include_router(repository.router)
