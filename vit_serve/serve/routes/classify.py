"""POST /classify: an image in, the top-k classes out."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Query, Request, Response
from PIL import Image

from vit_serve.manifest import EMBEDDING, LOGITS, ROLLOUT
from vit_serve.runtime import zero_shot
from vit_serve.runtime.postprocess import rollout_payload, top_k
from vit_serve.runtime.task import Task
from vit_serve.serve.caller import ScopeDep, keys_required
from vit_serve.serve.deps import GatewayDep, ModelChoiceDep
from vit_serve.serve.errors import BadRequestError
from vit_serve.serve.gateway import Gateway
from vit_serve.serve.labels import LabelCaller
from vit_serve.serve.middleware import request_id
from vit_serve.serve.model_version import ModelVersion
from vit_serve.serve.routes.image_request import BY_ID, ERRORS, AdmissionDep, infer_upload
from vit_serve.serve.schemas import ClassifyResponse
from vit_serve.serve.uploads import IMAGE_REQUEST_BODY

router = APIRouter(tags=["classify"])
log = logging.getLogger("vit_serve.serve")


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
    gateway: GatewayDep,
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
    cached per API key (VIT_SERVE_LABEL_CACHE_SIZE); labels within VIT_SERVE_MAX_LABELS, VIT_SERVE_MAX_LABEL_BYTES
    and the text tower's context length, labels x templates within VIT_SERVE_MAX_LABEL_PROMPTS (400 beyond; also
    for a model without a text tower or with explain=true: GET /explain?id= explains the image).

    A model carrying a reference (`vit-export --reference-images DIR`, `vit-serve train`; GET /models shows it)
    adds `"ood": {"score", "flag", "method", "threshold"}`: how unlike the reference the image is, from the same
    pass (Mahalanobis distance of its embedding, or the energy of its logits), and whether it is above the
    threshold (the reference's calibration quantile). Not with labels, nor with explain=true for a Mahalanobis
    reference (the explain pass gives no embedding); never with `--no-monitoring`.

    `Server-Timing` splits the same time finer (ms): read (receiving and hashing the body), decode_wait (waiting
    for a decode thread), decode, queue, infer, text (the labels' embeddings and logits) and total.
    """
    t0 = time.perf_counter()
    if labels is not None and explain:
        raise BadRequestError("labels and explain=true do not go together: classify by labels, then explain the "
                              "image with GET /explain?id=")
    names: list[str] | None = None
    ood: dict | None = None

    def task_of(mv: ModelVersion) -> Task:
        nonlocal names
        if labels is not None:
            task = mv.zero_shot_task()
            names = mv.parse_labels(labels)
            return task
        return mv.explain_task("rollout", None, None) if explain else mv.classify_task()

    text_ms = 0.0
    async with infer_upload(request, choice, scope, task_of, admission) as done:
        mv, decoded, result = done.mv, done.decoded, done.result
        if names is not None:
            who = LabelCaller.of(request.app, scope)  # its label cache and rate
            logits, text_ms = await mv.label_logits(names, result.outputs[EMBEDDING], admission, who)
            assert mv.text is not None
            predictions = label_top_k(logits[0], names, top_k_, mv.text.scores)
        else:
            predictions = top_k(result.outputs[LOGITS][0], top_k_, mv.info)
            monitor = mv.monitor
            scores = None if monitor is None else monitor.observe(result.outputs)
            ood = None if monitor is None or scores is None else monitor.answer(float(scores[0]))
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
    if names is None and ood is not None:
        answer["ood"] = ood
    if explain:  # the explain task carries its resolved rollout settings
        answer["explanation"] = rollout_payload("rollout", done.task.rollout, result.outputs[ROLLOUT][0], info)
    if gateway.sampler is not None and names is None:
        offer_sample(gateway, mv, decoded.crop, predictions[0], ood, tenant_of(gateway, admission.caller.name))
    return answer


def tenant_of(gateway: Gateway, name: str) -> str:
    """The sampler's tenant column: the name of the key the key check verified (`Admission.caller`), empty when
    the gateway takes no keys."""
    return name if keys_required(gateway.settings.security) else ""


def offer_sample(gateway: Gateway, mv: ModelVersion, crop: Image.Image, top1: dict, ood: dict | None,
                 tenant: str = "") -> None:
    """Hand the answer to the payload sampler when its draw keeps it: the crop is encoded as PNG in the decode
    pool, and offered from the event loop once it is (the answer does not wait for either)."""
    from vit_serve.runtime.payload_sampler import Sample, png_bytes

    sampler, flag = gateway.sampler, None if ood is None else ood["flag"]
    if sampler is None or not sampler.wants(flag):
        return
    rid = request_id.get() if gateway.settings.request_ids else None
    sample = functools.partial(Sample, time=time.time(), model=mv.name, version=str(mv.version), request_id=rid,
                               top1_label=top1["label"], top1_score=float(top1["score"] or 0.0),
                               ood_score=None if ood is None else ood["score"], ood_flag=flag, tenant=tenant)

    def offer(png: asyncio.Future[bytes]) -> None:
        if png.cancelled():
            return
        if (error := png.exception()) is not None:
            log.warning("payload sampler: the crop could not be encoded: %s", error)
            return
        sampler.offer(sample(crop_png=png.result()))

    with contextlib.suppress(RuntimeError):  # the pool is shut down: the gateway is stopping, no sample
        encoding = asyncio.get_running_loop().run_in_executor(gateway.decode_pool, png_bytes, crop)
        encoding.add_done_callback(offer)
        gateway.pending_samples.add(encoding)  # a graceful stop waits for it (Gateway.stop)
        encoding.add_done_callback(gateway.pending_samples.discard)


def label_top_k(logits: np.ndarray, labels: list[str], k: int, scores: str) -> list[dict]:
    """Zero-shot logits [n] over `labels` -> the k best as {"label", "index" (into labels), "score"}, best first
    (ties by index); scores softmax over the labels or sigmoid (`zero_shot.label_scores`)."""
    p = zero_shot.label_scores(logits, scores)
    best = np.argsort(-logits.astype(np.float64), kind="stable")[:min(k, len(labels))]
    return [{"label": labels[i], "index": int(i), "score": float(p[i])} for i in best]
