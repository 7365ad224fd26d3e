"""POST /classify: an image in, the top-k classes out."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from vit_serve.serve.deps import ModelDep
from vit_serve.serve.gateway import top_k
from vit_serve.serve.inference import CLASSIFY
from vit_serve.serve.schemas import ClassifyResponse, ErrorBody
from vit_serve.serve.uploads import IMAGE_REQUEST_BODY, read_image

router = APIRouter(tags=["classify"])
# The OpenAPI link to GET /explain of the image just answered: its id, and the model and version that answered.
BY_ID = {"id": "$response.body#/id", "model": "$response.body#/model", "version": "$response.body#/version"}

ERRORS = {
    400: {"model": ErrorBody, "description": "malformed multipart body, or several models and none named"},
    404: {"model": ErrorBody, "description": "unknown model or version (?model=, ?version=)"},
    413: {"model": ErrorBody, "description": "body over the size limit, or image over the pixel limit"},
    415: {"model": ErrorBody, "description": "not an image (or not a format PIL reads)"},
    422: {"description": "corrupt / truncated / empty image, or bad query parameters"},
    503: {"model": ErrorBody, "description": "queue full (Retry-After), or the model is loading or unloaded"},
    504: {"model": ErrorBody, "description": "no answer within the request timeout"},
}


@router.post("/classify", response_model=ClassifyResponse, openapi_extra=IMAGE_REQUEST_BODY, responses={
    **ERRORS, 200: {"links": {"ExplainById": {  # OpenAPI link: stateful clients (schemathesis) chain the two calls
        "operationRef": "#/paths/~1explain/get", "parameters": BY_ID,
        "description": "the attention map of the image just classified: GET /explain?id="}}}})
async def classify(
    request: Request,
    response: Response,
    mv: ModelDep,
    top_k_: Annotated[int, Query(alias="top_k", ge=1, description="classes to return (at most K)")] = 5,
) -> dict:
    """Classify one image.

    Body: multipart/form-data with the image in field `file`, or the raw image with `Content-Type: image/*`
    (any format PIL reads; EXIF orientation applied; preprocessed with the model's own contract).

    Answer: `{"id": sha256 hex of the image bytes, "model": name, "resolution": [H, W],
    "predictions": [{"label", "index", "score"}] (softmax probabilities, best first, top_k of them),
    "timing_ms": {"decode", "queue", "infer", "total", "batch_size"}}`. The image is kept for a while, so that
    `GET /explain?id=...` can explain it without a new upload. `?model=&version=` choose the model (default:
    the gateway's default model, at its newest version in service).

    The `Server-Timing` header splits the same time finer (ms): read (receiving and hashing the body),
    decode_wait (waiting for a decode thread), decode, queue, infer and total.
    """
    t0 = time.perf_counter()
    with mv.arriving() as arrival:
        upload = await read_image(request)
        t_read = time.perf_counter()
        decoded = await mv.decode(upload.data, upload.sha256)
        t_decoded = time.perf_counter()
        result = await mv.infer(CLASSIFY, decoded.x, arrival)
    info = mv.info
    total_ms = (time.perf_counter() - t0) * 1e3
    wait_ms = max(0.0, (t_decoded - t_read) * 1e3 - decoded.decode_ms)
    response.headers["Server-Timing"] = ", ".join(
        f"{name};dur={ms:.3f}" for name, ms in (
            ("read", (t_read - t0) * 1e3), ("decode_wait", wait_ms), ("decode", decoded.decode_ms),
            ("queue", result.queue_ms), ("infer", result.infer_ms), ("total", total_ms)))
    return {
        "id": decoded.id,
        "model": info.name,
        "version": str(mv.version),
        "resolution": info.resolution,
        "predictions": top_k(result.outputs["logits"][0], top_k_, info),
        "timing_ms": {"decode": decoded.decode_ms, "queue": result.queue_ms, "infer": result.infer_ms,
                      "total": total_ms, "batch_size": result.batch_size},
    }
