"""POST /classify: an image in, the top-k classes out."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from vit_serve.manifest import LOGITS, ROLLOUT
from vit_serve.runtime.postprocess import rollout_payload, top_k
from vit_serve.runtime.task import CLASSIFY, Task
from vit_serve.serve.caller import ScopeDep
from vit_serve.serve.deps import ModelChoiceDep
from vit_serve.serve.model_version import ModelVersion
from vit_serve.serve.routes.image_request import BY_ID, ERRORS, infer_upload
from vit_serve.serve.schemas import ClassifyResponse
from vit_serve.serve.uploads import IMAGE_REQUEST_BODY

router = APIRouter(tags=["classify"])


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

    async with infer_upload(request, choice, scope, task_of) as done:
        mv, decoded, result = done.mv, done.decoded, done.result
    info = mv.info
    total_ms = (time.perf_counter() - t0) * 1e3
    wait_ms = max(0.0, (done.t_decoded - done.t_read) * 1e3 - decoded.decode_ms)
    response.headers["Server-Timing"] = ", ".join(
        f"{name};dur={ms:.3f}" for name, ms in (
            ("read", (done.t_read - t0) * 1e3), ("decode_wait", wait_ms), ("decode", decoded.decode_ms),
            ("queue", result.queue_ms), ("infer", result.infer_ms), ("total", total_ms)))
    answer = {
        "id": decoded.id,
        "model": info.name,
        "version": str(mv.version),
        "resolution": info.resolution,
        "predictions": top_k(result.outputs[LOGITS][0], top_k_, info),
        "timing_ms": result.timing_ms(decoded.decode_ms, total_ms),
    }
    if explain:  # the explain task carries its resolved rollout settings
        answer["explanation"] = rollout_payload("rollout", done.task.rollout, result.outputs[ROLLOUT][0], info)
    return answer
