"""POST /classify: an image in, the top-k classes out."""

from __future__ import annotations

import dataclasses
import time
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from vit_serve.runtime.decode import Decoded
from vit_serve.runtime.task import CLASSIFY, Task
from vit_serve.serve.caller import ScopeDep
from vit_serve.serve.deps import ModelChoiceDep
from vit_serve.serve.gateway import top_k
from vit_serve.serve.model_version import ModelVersion
from vit_serve.serve.runner import Result
from vit_serve.serve.schemas import ClassifyResponse, ErrorBody
from vit_serve.serve.uploads import IMAGE_REQUEST_BODY, Upload, read_image

router = APIRouter(tags=["classify"])
# The OpenAPI link to GET /explain of the image just answered: its id, and the model and version that answered.
BY_ID = {"id": "$response.body#/id", "model": "$response.body#/model", "version": "$response.body#/version"}

ERRORS = {
    400: {"model": ErrorBody, "description": "malformed multipart body, several models and none named, or "
                                             "explain=true for a model without an explain graph"},
    404: {"model": ErrorBody, "description": "unknown model or version (?model=, ?version=)"},
    413: {"model": ErrorBody, "description": "body over the size limit, or image over the pixel limit"},
    415: {"model": ErrorBody, "description": "not an image (or not a format PIL reads)"},
    422: {"description": "corrupt / truncated / empty image, or bad query parameters"},
    503: {"model": ErrorBody, "description": "queue full (Retry-After), or the model is loading or unloaded"},
    504: {"model": ErrorBody, "description": "no answer within the request timeout"},
}


# exclude_unset: the explanation is in the answer only when asked for (null scores of predictions stay).
@router.post("/classify", response_model=ClassifyResponse, response_model_exclude_unset=True,
             openapi_extra=IMAGE_REQUEST_BODY, responses={
    **ERRORS, 200: {"links": {"ExplainById": {  # OpenAPI link: stateful clients (schemathesis) chain the two calls
        "operationRef": "#/paths/~1explain/get", "parameters": BY_ID,
        "description": "the attention map of the image just classified: GET /explain?id="}}}})
async def classify(
    request: Request,
    response: Response,
    choice: ModelChoiceDep,
    scope: ScopeDep,
    top_k_: Annotated[int, Query(alias="top_k", ge=1, description="classes to return (at most K)")] = 5,
    explain: Annotated[bool, Query(description="also return the attention rollout of the same forward pass "
                                               "(models with an explain graph)")] = False,
) -> dict:
    """Classify one image.

    Body: multipart/form-data with the image in field `file`, or the raw image with `Content-Type: image/*`
    (any format PIL reads; EXIF orientation applied; preprocessed with the model's own contract).

    Answer: `{"id": the image's id for this API key (an HMAC of the key and the image bytes, not their sha256),
    "model": name, "resolution": [H, W],
    "predictions": [{"label", "index", "score"}] (softmax probabilities, best first, top_k of them),
    "timing_ms": {"decode", "queue", "infer", "total", "batch_size"}}`. The image is kept for a while, so that
    `GET /explain?id=...` can explain it without a new upload. `?model=&version=` choose the model (default:
    the gateway's default model, at its newest version in service).

    `?explain=true` adds `"explanation": {"method": "rollout", "head_fusion", "discard_ratio", "query",
    "grid": [gh, gw], "map": gh x gw floats}` (as GET /explain?format=json), from one pass through the explain
    graph, which gives the logits and the rollout together; other rollout settings: GET /explain?id=. A model
    without an explain graph answers 400.

    The `Server-Timing` header splits the same time finer (ms): read (receiving and hashing the body),
    decode_wait (waiting for a decode thread), decode, queue, infer and total.
    """
    t0 = time.perf_counter()

    def task_of(mv: ModelVersion) -> Task:
        return mv.explain_task("rollout", None, None) if explain else CLASSIFY

    with choice.announce(task_of):  # 404 / 400 before the body is read; the version is chosen once it is
        upload = await read_image(request)
    t_read = time.perf_counter()
    with choice.use() as mv, mv.arriving() as arrival:
        task = task_of(mv)
        decoded = await decode_kept(mv, upload, scope)
        t_decoded = time.perf_counter()
        result = await mv.infer(task, decoded.x, arrival)
    info = mv.info
    total_ms = (time.perf_counter() - t0) * 1e3
    wait_ms = max(0.0, (t_decoded - t_read) * 1e3 - decoded.decode_ms)
    response.headers["Server-Timing"] = ", ".join(
        f"{name};dur={ms:.3f}" for name, ms in (
            ("read", (t_read - t0) * 1e3), ("decode_wait", wait_ms), ("decode", decoded.decode_ms),
            ("queue", result.queue_ms), ("infer", result.infer_ms), ("total", total_ms)))
    answer = {
        "id": decoded.id,
        "model": info.name,
        "version": str(mv.version),
        "resolution": info.resolution,
        "predictions": top_k(result.outputs["logits"][0], top_k_, info),
        "timing_ms": result.timing_ms(decoded.decode_ms, total_ms),
    }
    if explain:
        answer["explanation"] = _explanation(mv, task, result)
    return answer


async def decode_kept(mv: ModelVersion, upload: Upload, scope: str) -> Decoded:
    """The upload decoded (none if the caller sent it before: its crop is in the store) and kept for GET
    /explain, with the caller's id for it (`stores.secret`): another caller's identical upload neither finds
    this crop nor gets this id."""
    secret = mv.store.secret
    image = secret.image_id(scope, upload.sha256)
    decoded = await mv.decode(upload.data, secret.slot(scope, image))
    return dataclasses.replace(decoded, id=image)


def _explanation(mv: ModelVersion, task: Task, result: Result) -> dict:
    """The rollout part of an explain task's result, as GET /explain?format=json has it."""
    rollout, info, settings = result.outputs["rollout"][0], mv.info, task.rollout
    assert settings is not None  # an explain task carries its resolved settings
    return {"method": "rollout", "head_fusion": settings.head_fusion, "discard_ratio": settings.discard_ratio,
            "query": "cls" if info.pool == "token" else "patch-mean", "grid": info.grid, "map": rollout.tolist()}
