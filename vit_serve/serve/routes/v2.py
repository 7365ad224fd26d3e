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
"""

from __future__ import annotations

import asyncio
import zlib
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Path, Request
from fastapi.responses import Response
from pydantic import BaseModel

from vit_serve import __version__
from vit_serve.serve.backends.base import ModelInfo
from vit_serve.serve.deps import GatewayDep
from vit_serve.serve.errors import BadRequestError, TooLargeError, UnsupportedMediaError
from vit_serve.serve.gateway import Gateway
from vit_serve.serve.inference import CLASSIFY, Task
from vit_serve.serve.model_version import ModelVersion
from vit_serve.serve.runner import Arrival
from vit_serve.serve.schemas import StrictJSONResponse
from vit_serve.serve.v2_protocol import (
    HEADER_LENGTH,
    InferRequest,
    OutputTensor,
    Tensor,
    classify,
    encode_infer_response,
    parse_infer_request,
)

router = APIRouter(prefix="/v2", tags=["v2 (Open Inference Protocol)"])
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


def _versions(gateway: Gateway, name: str) -> list[str]:
    served = gateway.repository.served.get(name, {}) if gateway.repository else {}
    return [str(v) for v in sorted(served, reverse=True)]


def model_metadata(mv: ModelVersion, versions: list[str]) -> dict[str, Any]:
    info = mv.info
    h, w = info.resolution
    outputs = [{"name": "logits", "datatype": "FP32", "shape": [-1, info.num_classes]}]
    if info.explain:
        outputs.append({"name": "rollout", "datatype": "FP32", "shape": [-1, *info.grid]})
    return {
        "name": mv.name,
        "versions": versions,
        "platform": f"vit-serve_{mv.backend.name}",
        "inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [-1, 3, h, w]},
                   {"name": "image", "datatype": "BYTES", "shape": [-1]}],
        "outputs": outputs,
        "parameters": {"input": "send pixel_values or image, not both", "preprocess": info.preprocess.to_dict(),
                       "labels": info.labels},
    }


@router.get("", responses={200: {"description": "server metadata"}})
async def server_metadata() -> dict:
    """`{"name", "version", "extensions"}`."""
    return {"name": "vit-serve", "version": __version__,
            "extensions": ["binary_tensor_data", "classification", "model_repository"]}


@router.get("/health/live", response_model=ServerLive)
async def live() -> dict:
    """200 `{"live": true}` while the server answers."""
    return {"live": True}


@router.get("/health/ready", response_model=ServerReady, responses={503: {"model": ServerReady}})
async def ready(gateway: GatewayDep) -> StrictJSONResponse:
    """200 `{"ready": true}` once the model is loaded, warmed up and its backend answers; 503 `{"ready": false,
    "error": why}` before."""
    ok, why = await gateway.readiness()
    return StrictJSONResponse({"ready": True} if ok else {"ready": False, "error": why}, 200 if ok else 503)


@router.get("/models/{name}", responses={200: MODEL_LINKS, 404: V2_ERROR, 503: V2_ERROR})
async def metadata(name: NameDep, gateway: GatewayDep) -> dict:
    """Model metadata (its newest version in service): inputs `pixel_values` FP32 [-1, 3, H, W] and `image`
    BYTES [-1] (send one), outputs `logits` FP32 [-1, K] and `rollout` FP32 [-1, gh, gw] (with an explain graph);
    `versions`: those in service, newest first; parameters: the preprocessing contract and the labels."""
    return model_metadata(gateway.model(name), _versions(gateway, name))


@router.get("/models/{name}/versions/{version}", responses={404: V2_ERROR, 503: V2_ERROR})
async def version_metadata(name: NameDep, version: VersionDep, gateway: GatewayDep) -> dict:
    """The same, for one version."""
    return model_metadata(gateway.model(name, version), _versions(gateway, name))


async def _ready(gateway: Gateway, name: str, version: str | None) -> StrictJSONResponse:
    mv = gateway.model(name, version)
    ok, why = await mv.readiness()
    body = {"name": name, "ready": ok, **({} if ok else {"error": why})}
    return StrictJSONResponse(body, 200 if ok else 503)


READY_DOC = {"response_model": ModelReady, "responses": {404: V2_ERROR, 503: {"model": ModelReady}}}


@router.get("/models/{name}/ready", **READY_DOC)
async def model_ready(name: NameDep, gateway: GatewayDep) -> StrictJSONResponse:
    """200 `{"name", "ready": true}` when the model is ready, 503 (`"ready": false`) before, 404 for a name the
    repository does not have."""
    return await _ready(gateway, name, None)


@router.get("/models/{name}/versions/{version}/ready", **READY_DOC)
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


async def _pixels(mv: ModelVersion, inputs: dict[str, Tensor]) -> np.ndarray:
    """The request's one input -> x [B, 3, H, W] float32."""
    info = mv.info
    unknown = set(inputs) - {"pixel_values", "image"}
    if unknown or len(inputs) != 1:
        raise BadRequestError(f"send exactly one input, pixel_values or image (got {sorted(inputs)})")
    h, w = info.resolution
    if "pixel_values" in inputs:
        t = inputs["pixel_values"]
        if t.datatype not in ("FP32", "FP16", "FP64"):
            raise BadRequestError(f"pixel_values must be FP32 (got {t.datatype})")
        if len(t.shape) != 4 or t.shape[1:] != [3, h, w] or t.shape[0] < 1:
            raise BadRequestError(f"pixel_values must have shape [B, 3, {h}, {w}] (got {t.shape})")
        return np.asarray(t.data, dtype=np.float32)
    t = inputs["image"]
    if t.datatype != "BYTES" or not t.data:
        raise BadRequestError("image must be BYTES holding at least one encoded image")
    decoded = await asyncio.gather(*(mv.decode(bytes(b), keep=False) for b in t.data))
    return np.concatenate([d.x for d in decoded])


INFER_DOC = {
    "response_class": Response,
    "responses": {200: {"description": "outputs (JSON, or JSON + binary tensors)"}, 400: V2_ERROR, 404: V2_ERROR,
                  413: V2_ERROR, 415: V2_ERROR, 503: V2_ERROR, 504: V2_ERROR},
    "openapi_extra": {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"type": "object"}},
        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}},
}


@router.post("/models/{name}/infer", **INFER_DOC)
async def infer(name: NameDep, request: Request, gateway: GatewayDep) -> Response:
    """Inference: `{"id"?, "inputs": [{"name", "datatype", "shape", "data" | parameters.binary_data_size}],
    "outputs"?: [{"name", "parameters": {"binary_data", "classification"}}], "parameters"?:
    {"binary_data_output", "head_fusion", "discard_ratio"}}` -> `{"model_name", "model_version", "id"?,
    "outputs": [{"name", "datatype", "shape", "data" | parameters.binary_data_size}]}` (+ raw tensors after the
    JSON, with the `Inference-Header-Content-Length` header, when any output is binary). `classification: k`
    answers BYTES [B, k] of "logit:index:label" (Triton's classification extension); NaN / inf in JSON data
    are null. The model's newest version in service answers (`model_version` says which)."""
    return await _infer(request, gateway, gateway.model(name))


@router.post("/models/{name}/versions/{version}/infer", **INFER_DOC, include_in_schema=False)  # Triton's alias
async def version_infer(name: NameDep, version: VersionDep, request: Request, gateway: GatewayDep) -> Response:
    """The same, for one version."""
    return await _infer(request, gateway, gateway.model(name, version))


async def _infer(request: Request, gateway: Gateway, mv: ModelVersion) -> Response:
    with mv.using(), mv.arriving() as arrival:
        return await _infer_on(request, gateway, mv, arrival)


async def _infer_on(request: Request, gateway: Gateway, mv: ModelVersion, arrival: Arrival) -> Response:
    info = mv.info
    body = _decompress(await request.body(), request.headers.get("content-encoding", "").strip().lower(),
                       gateway.settings.max_body_bytes)
    req = parse_infer_request(body, request.headers.get(HEADER_LENGTH))
    available = ["logits", *(["rollout"] if info.explain else [])]
    wanted = req.outputs if req.outputs is not None else [{"name": n} for n in available]
    for out in wanted:
        if out["name"] not in available:
            raise BadRequestError(f"unknown output {out['name']!r}; this model has {available}")
    if any(out["name"] == "rollout" for out in wanted):
        hf, dr = req.parameters.get("head_fusion"), req.parameters.get("discard_ratio")
        if dr is not None and not isinstance(dr, (int, float)):
            raise BadRequestError("parameters.discard_ratio must be a number")
        if dr is not None and not 0 <= dr < 1:
            raise BadRequestError("parameters.discard_ratio must be in [0, 1)")
        task: Task = mv.explain_task("rollout", hf, dr)
    else:
        task = CLASSIFY
    x = await _pixels(mv, req.inputs)
    result = await mv.infer(task, x, arrival)
    outputs = [_output(o, result.outputs[o["name"]], req.binary_output(o), info) for o in wanted]
    content, headers = encode_infer_response(mv.name, str(mv.version), req.id, outputs)
    return Response(content, headers=headers, media_type=headers["Content-Type"])



def _output(out: dict[str, Any], arr: np.ndarray, binary: bool, info: ModelInfo) -> OutputTensor:
    """One requested output: the FP32 tensor, or its classification (labels on the logits only)."""
    k = InferRequest.class_count(out)
    if k == 0:
        return OutputTensor(out["name"], "FP32", list(arr.shape), arr, binary)
    shape, items = classify(arr, k, info.labels if out["name"] == "logits" else None)
    return OutputTensor(out["name"], "BYTES", shape, items, binary)
