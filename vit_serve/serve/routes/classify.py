"""POST /classify: an image in, the top-k classes out."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from vit_serve.serve import answer_hooks, pipeline
from vit_serve.serve.caller import ScopeDep
from vit_serve.serve.deps import GatewayDep, ModelChoiceDep
from vit_serve.serve.errors import BadRequestError
from vit_serve.serve.routes.image_request import BY_ID, ERRORS, AdmissionDep, MaxPatchesQuery
from vit_serve.serve.schemas import ClassifyResponse
from vit_serve.serve.uploads import IMAGE_REQUEST_BODY

router = APIRouter(tags=["classify"])

# The operation's description (OpenAPI), kept out of the handler.
DESCRIPTION = inspect.cleandoc("""Classify one image.

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

    `?labels=cat,dog,...` (a model served with its text tower: `NAME_text.onnx` beside an export, or the tower a
    converted checkpoint holds): the classes are these labels, zero-shot, as open_clip's recipe: the image
    embedding (normalised) . each label's text embedding (its prompts' normalised embeddings averaged, normalised)
    x exp(logit_scale) (+ logit_bias); scores softmax over the labels
    (CLIP) or each label's sigmoid (SigLIP); `index` is the label's position in `labels`. Label embeddings are
    cached per API key (VIT_SERVE_LABEL_CACHE_SIZE); labels within VIT_SERVE_MAX_LABELS, VIT_SERVE_MAX_LABEL_BYTES
    and the text tower's context length, labels x templates within VIT_SERVE_MAX_LABEL_PROMPTS (400 beyond; also
    for a model without a text tower or with explain=true: GET /explain?id= explains the image).

    `?labels=...&abstain=true` adds `"abstention": {"abstained", "score", "threshold", "source"}`: abstained (the
    answer is "none of these") when the best label's score is below `threshold=` ("request"), or without one
    below the model's reference's calibrated threshold ("reference": the (1 - quantile) quantile of its held-out
    images' top-1 scores, 5% of in-distribution images at the default 0.95; a model without a reference answers
    400); the predictions stay, for clients that want them anyway.

    A model carrying a reference (`vit-export --reference-images DIR`, `vit-serve train`; GET /models shows it)
    adds `"ood": {"score", "flag", "method", "threshold"}`: how unlike the reference the image is, from the same
    pass (Mahalanobis distance of its embedding, or the energy of its logits), and whether it is above the
    threshold (the reference's calibration quantile). Not with labels, nor with explain=true for a Mahalanobis
    reference (the explain pass gives no embedding); never with `--no-monitoring`.

    `Server-Timing` splits the same time finer (ms): read (receiving and hashing the body), decode_wait (waiting
    for a decode thread), decode, queue, infer, text (the labels' embeddings and logits) and total.
    """)


# exclude_unset: the explanation is in the answer only when asked for (null scores of predictions stay).
@router.post("/classify", response_model=ClassifyResponse, response_model_exclude_unset=True,
             openapi_extra=IMAGE_REQUEST_BODY, description=DESCRIPTION, responses={
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
    max_patches: MaxPatchesQuery = None,
    abstain: Annotated[bool, Query(description="with labels: answer \"none of these\" when the best label's score "
                                               "is below the threshold")] = False,
    threshold: Annotated[float | None, Query(ge=0.0, le=1.0, description="abstain=true: the threshold (default: "
                                             "calibrated from the model's reference)")] = None,
) -> dict:
    """Classify one image (`DESCRIPTION`)."""
    if labels is not None and explain:
        raise BadRequestError("labels and explain=true do not go together: classify by labels, then explain the "
                              "image with GET /explain?id=")
    ask = pipeline.Ask("classify", top_k_, labels, pipeline.Explain() if explain else None, max_patches=max_patches,
                       abstain=abstain, threshold=threshold)
    hooks = (answer_hooks.server_timing(response), answer_hooks.sampling(gateway, admission))
    return _answer(await pipeline.answer(request, choice, scope, admission, ask, hooks))


def _answer(done: pipeline.Answered) -> dict:
    """The answer of POST /classify (`DESCRIPTION`)."""
    answer = {"id": done.image_id, "model": done.info.name, "version": done.version,
              "resolution": done.info.resolution, "predictions": done.answer.prediction_dicts(),
              "timing_ms": done.timings.timing_ms()}
    if done.answer.ood is not None:
        answer["ood"] = dataclasses.asdict(done.answer.ood)
    if done.answer.explanation is not None:
        answer["explanation"] = done.answer.explanation.payload()
    if done.answer.abstention is not None:
        answer["abstention"] = dataclasses.asdict(done.answer.abstention)
    return answer
