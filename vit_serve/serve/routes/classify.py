"""POST /classify: an image in, the top-k classes out."""

from __future__ import annotations

import time
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Query, Request, Response

from vit_serve.manifest import EMBEDDING, LOGITS, ROLLOUT
from vit_serve.runtime import zero_shot
from vit_serve.runtime.postprocess import rollout_payload, top_k
from vit_serve.runtime.task import CLASSIFY, Task
from vit_serve.serve.caller import ScopeDep
from vit_serve.serve.deps import ModelChoiceDep
from vit_serve.serve.errors import BadRequestError
from vit_serve.serve.model_version import ModelVersion
from vit_serve.serve.routes.image_request import BY_ID, ERRORS, AdmissionDep, infer_upload
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
    admission: AdmissionDep,
    top_k_: Annotated[int, Query(alias="top_k", ge=1, description="classes to return (at most K)")] = 5,
    explain: Annotated[bool, Query(description="also return the attention rollout of the same forward pass "
                                               "(models with an explain graph)")] = False,
    labels: Annotated[str | None, Query(description="comma-separated labels to classify the image among, zero-shot "
                                                    "(models served with a text tower, vit-export --text-tower)")
                      ] = None,
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

    `?labels=cat,dog,...` (a model served with its text tower, `NAME_text.onnx`): the classes are these labels,
    zero-shot, as open_clip's recipe: the image embedding (normalised) . each label's text embedding (its prompts'
    normalised embeddings averaged, normalised) x exp(logit_scale) (+ logit_bias); scores softmax over the labels
    (CLIP) or each label's sigmoid (SigLIP); `index` is the label's position in `labels`. Label embeddings are
    cached (VIT_SERVE_LABEL_CACHE_SIZE); at most VIT_SERVE_MAX_LABELS labels of VIT_SERVE_MAX_LABEL_CHARS
    characters each, 400 beyond, and 400 for a model without a text tower or with explain=true (GET /explain?id=
    explains the image).

    The `Server-Timing` header splits the same time finer (ms): read (receiving and hashing the body),
    decode_wait (waiting for a decode thread), decode, queue, infer, text (the labels' embeddings and logits)
    and total.
    """
    t0 = time.perf_counter()
    if labels is not None and explain:
        raise BadRequestError("labels and explain=true do not go together: classify by labels, then explain the "
                              "image with GET /explain?id=")
    names: list[str] | None = None

    def task_of(mv: ModelVersion) -> Task:
        nonlocal names
        if labels is not None:
            task = mv.zero_shot_task()
            names = mv.parse_labels(labels)
            return task
        return mv.explain_task("rollout", None, None) if explain else CLASSIFY

    text_ms = 0.0
    async with infer_upload(request, choice, scope, task_of, admission) as done:
        mv, decoded, result = done.mv, done.decoded, done.result
        if names is not None:
            logits, text_ms = await mv.label_logits(names, result.outputs[EMBEDDING])
            assert mv.text is not None
            predictions = label_top_k(logits[0], names, top_k_, mv.text.scores)
        else:
            predictions = top_k(result.outputs[LOGITS][0], top_k_, mv.info)
    info = mv.info
    total_ms = (time.perf_counter() - t0) * 1e3
    wait_ms = max(0.0, (done.t_decoded - done.t_read) * 1e3 - decoded.decode_ms)
    timings = [("read", (done.t_read - t0) * 1e3), ("decode_wait", wait_ms), ("decode", decoded.decode_ms),
               ("queue", result.queue_ms), ("infer", result.infer_ms)]
    if names is not None:
        timings.append(("text", text_ms))
    response.headers["Server-Timing"] = ", ".join(
        f"{name};dur={ms:.3f}" for name, ms in (*timings, ("total", total_ms)))
    answer = {
        "id": decoded.id,
        "model": info.name,
        "version": str(mv.version),
        "resolution": info.resolution,
        "predictions": predictions,
        "timing_ms": result.timing_ms(decoded.decode_ms, total_ms),
    }
    if explain:  # the explain task carries its resolved rollout settings
        answer["explanation"] = rollout_payload("rollout", done.task.rollout, result.outputs[ROLLOUT][0], info)
    return answer


def label_top_k(logits: np.ndarray, labels: list[str], k: int, scores: str) -> list[dict]:
    """Zero-shot logits [n] over `labels` -> the k best as {"label", "index" (into labels), "score"}, best first
    (ties by index); scores softmax over the labels or sigmoid (`zero_shot.label_scores`)."""
    p = zero_shot.label_scores(logits, scores)
    best = np.argsort(-logits.astype(np.float64), kind="stable")[:min(k, len(labels))]
    return [{"label": labels[i], "index": int(i), "score": float(p[i])} for i in best]
