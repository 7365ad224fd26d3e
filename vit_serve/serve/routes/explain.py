"""GET /explain (an image classified earlier, by id) and POST /explain (an upload): what the model attended to.

Methods: `rollout` (attention rollout, Abnar & Zuidema 2020: any backend with an explain graph; exported graphs
have their head_fusion / discard_ratio baked in, other values answer 400 naming them) and `grad_rollout`
(gradient-weighted rollout, Chefer et al. 2021: the torch backend only, 400 elsewhere), and on GET `similarity`
(why did this match: the image embedding's cosine with a text, another kept image or a zero-shot label, split over
the patches, `vit_serve.similarity`; the torch backend only, 400 elsewhere: the exported graphs give no patch
tokens).
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from vit_serve.explain import DEFAULT_DISCARD_RATIO, DEFAULT_HEAD_FUSION, HEAD_FUSIONS
from vit_serve.overlay import COLORMAPS
from vit_serve.serve import pipeline
from vit_serve.serve.admission import Admission
from vit_serve.serve.caller import ScopeDep
from vit_serve.serve.deps import ModelChoiceDep, ModelDep
from vit_serve.serve.errors import BadRequestError, InvalidValueError
from vit_serve.serve.model_version import ModelVersion
from vit_serve.serve.routes.image_request import BY_ID, ERRORS, AdmissionDep, MaxPatchesQuery
from vit_serve.serve.schemas import ErrorBody, ExplainResponse
from vit_serve.serve.uploads import IMAGE_REQUEST_BODY

router = APIRouter(tags=["explain"])

# ?size= bounds: a phone's thumbnail to a large screen; more would only spend the decode pool's time on pixels.
MIN_SIZE, MAX_SIZE = 16, 2048

PNG = {"content": {"image/png": {"schema": {"type": "string", "format": "binary"}}},
       "description": "format=png: the map over the model-input crop (headers X-Image-Id, X-Model); "
                      "format=json: the map as numbers"}
# OpenAPI link from an upload's answer to the same image by id (format=json carries it in the body).
BY_ID_LINK = {"links": {"ExplainById": {
    "operationRef": "#/paths/~1explain/get", "parameters": BY_ID,
    "description": "the same image again by its id, e.g. with other rollout settings: GET /explain?id="}}}


@dataclass(frozen=True)
class SimilarityQuery:
    """What a similarity map compares the image with: one of a text, a kept image's id, a zero-shot label; and
    whether the map is multiplied by the rollout."""

    text: str | None = None
    query_id: str | None = None
    label: str | None = None
    times_rollout: bool = False


async def similarity_query(
    text: Annotated[str | None, Query(description="method=similarity: a text, through the model's text tower "
                                                  "(encoded as a ?labels= label is: its templates averaged)")] = None,
    query_id: Annotated[str | None, Query(pattern="^[0-9a-f]{64}$", description=(
        "method=similarity: another image's id (from /classify or /embed, same API key): its embedding"))] = None,
    label: Annotated[str | None, Query(description="method=similarity: one of the model's labels, of a zero-shot "
                                                   "head (vit-serve convert --zero-shot): its text embedding")] = None,
    rollout: Annotated[bool, Query(description="method=similarity: multiply the map by the attention rollout "
                                               "(scaled to a maximum of 1)")] = False,
) -> SimilarityQuery:
    return SimilarityQuery(text, query_id, label, rollout)


@dataclass(frozen=True)
class ExplainParams:
    method: Literal["rollout", "grad_rollout", "similarity"]
    head_fusion: str | None
    discard_ratio: float | None
    format: Literal["png", "json"]
    target: int | None
    alpha: float
    colormap: str
    size: int | None
    max_patches: int | None = None


async def explain_params(
    method: Annotated[Literal["rollout", "grad_rollout", "similarity"], Query(
        description="grad_rollout: torch backend only; similarity: GET on the torch backend only, with one of text=, "
                    "query_id=, label=")] = "rollout",
    head_fusion: Annotated[Literal[HEAD_FUSIONS] | None, Query(
        description=f"rollout: fuse heads by mean, max or min (default: {DEFAULT_HEAD_FUSION}, or the exported "
                    f"graph's)")] = None,
    discard_ratio: Annotated[float | None, Query(
        ge=0.0, lt=1.0, examples=[DEFAULT_DISCARD_RATIO, 0.0, 0.9999999999999999],
        description=f"rollout: drop this fraction of the weakest attention weights per layer (default: "
                    f"{DEFAULT_DISCARD_RATIO:g}, or the exported graph's); at least one weight is always kept")] = None,
    format: Annotated[Literal["png", "json"], Query(description="png overlay or json grid")] = "png",
    target: Annotated[int | None, Query(ge=0, description="grad_rollout: class to explain (default top-1)")] = None,
    alpha: Annotated[float, Query(ge=0.0, le=1.0, description="png: opacity of the map")] = 0.5,
    colormap: Annotated[Literal[COLORMAPS], Query(description="png: colour map")] = "jet",
    size: Annotated[int | None, Query(
        ge=MIN_SIZE, le=MAX_SIZE, examples=[256],
        description=f"png: the picture's longer side in pixels, {MIN_SIZE} to {MAX_SIZE}, scaled nearest-neighbour "
                    f"from the model-input crop (default: the crop's own size, e.g. 32 x 32)")] = None,
    max_patches: MaxPatchesQuery = None,
) -> ExplainParams:
    return ExplainParams(method, head_fusion, discard_ratio, format, target, alpha, colormap, size, max_patches)


ParamsDep = Annotated[ExplainParams, Depends(explain_params)]


def _ask(p: ExplainParams) -> pipeline.Ask:
    overlay = pipeline.Overlay(p.alpha, p.colormap, p.size) if p.format == "png" else None
    return pipeline.Ask("explain", explain=pipeline.Explain(p.method, p.head_fusion, p.discard_ratio, p.target),
                        overlay=overlay, max_patches=p.max_patches)


SimilarityDep = Annotated[SimilarityQuery, Depends(similarity_query)]


async def _similarity_ask(mv: ModelVersion, scope: str, admission: Admission, p: ExplainParams,
                          q: SimilarityQuery) -> tuple[pipeline.Ask, str]:
    """The Ask of a similarity map and what the query is ("text", "image", "label"): the query vector found first
    (the text tower's embedding of `text`, the kept image's embedding, or the label's index in the head)."""
    mv.needs_tokens("method=similarity")
    asked = [name for name, v in (("text", q.text), ("query_id", q.query_id), ("label", q.label)) if v is not None]
    if len(asked) != 1:
        raise BadRequestError(f"method=similarity needs exactly one of text=, query_id=, label= (got "
                              f"{', '.join(asked) or 'none'})")
    vector, target, kind = None, None, "label"
    if q.text is not None:
        if mv.text is None:
            raise BadRequestError(f"text=: {mv.name} has no text tower; ask with query_id= or label=")
        texts = mv.parse_labels([q.text], "text")
        vector, kind = (await asyncio.get_running_loop().run_in_executor(None, mv.text.classes, texts, scope))[0], \
            "text"
    elif q.query_id is not None:
        kept = await pipeline.answer_kept(mv, scope, admission, pipeline.Ask("embed"), q.query_id)
        vector, kind = kept.answer.embedding, "image"
    elif q.label not in mv.info.labels:
        raise InvalidValueError(f"label {q.label!r} is not one of {mv.name}'s labels")
    else:
        target = mv.info.labels.index(q.label)
    query = None if vector is None else tuple(float(v) for v in vector)
    explain = pipeline.Explain("similarity", p.head_fusion, p.discard_ratio, target, query, q.times_rollout)
    return dataclasses.replace(_ask(p), explain=explain), kind


def _shaped(done: pipeline.Answered, query: str | None = None) -> Response | dict:
    """The answer as GET /explain gives it: the PNG overlay over the model-input crop, or the JSON map (`query`:
    what a similarity map compared the image with)."""
    if done.overlay is not None:
        return Response(done.overlay, media_type="image/png", headers={
            "X-Image-Id": done.image_id, "X-Model": done.info.name, "X-Model-Version": done.version})
    assert done.answer.explanation is not None
    payload = done.answer.explanation.payload()
    return {"id": done.image_id, "model": done.info.name, "version": done.version,
            **payload, "query": query or payload["query"], "predictions": done.answer.prediction_dicts(),
            "timing_ms": done.timings.timing_ms()}


@router.get("/explain", response_model=ExplainResponse, response_model_exclude_unset=True,
            responses={200: PNG, 404: {"model": ErrorBody}, **ERRORS})
async def explain_by_id(
    mv: ModelDep,
    params: ParamsDep,
    similar: SimilarityDep,
    scope: ScopeDep,
    admission: AdmissionDep,
    id: Annotated[str, Query(pattern="^[0-9a-f]{64}$",
                             description="the `id` POST /classify returned to the same API key")],
) -> Response | dict:
    """Explain an image classified recently (kept for `VIT_SERVE_STORE_TTL_S` seconds, at most
    `VIT_SERVE_STORE_SIZE` images).

    format=json answers `{"id", "model", "method", "head_fusion", "discard_ratio", "query", "grid": [gh, gw],
    "map": gh x gw floats, "predictions", "timing_ms"}`; format=png the map blended over the model-input crop.
    An unknown or expired id answers 404: send the image again with POST /explain. The image is found for the
    model it was classified with (or any model with the same preprocessing contract), by the API key that sent
    it: another key's id is a 404, as an id nobody made.

    method=similarity: why did this image match a query (one of `text`, `query_id`, `label`): the cosine of its
    embedding with the query, split over its patches (`map`; sum + `rest` = `cosine`), times the rollout with
    rollout=true. Mean-pooled models exactly; [class]-token models (CLIP): the last block's attention-weighted
    value contributions to the [class] row (through the final LayerNorm, linearised); attention-pooled models
    (SigLIP): the pool's value contributions. The torch backend only (400 on the others).
    """
    ask, query = (await _similarity_ask(mv, scope, admission, params, similar) if params.method == "similarity"
                  else (_ask(params), None))
    return _shaped(await pipeline.answer_kept(mv, scope, admission, ask, id), query)


@router.post("/explain", response_model=ExplainResponse, responses={200: {**PNG, **BY_ID_LINK}, **ERRORS},
             openapi_extra=IMAGE_REQUEST_BODY)
async def explain_upload(request: Request, choice: ModelChoiceDep, params: ParamsDep, scope: ScopeDep,
                         admission: AdmissionDep) -> Response | dict:
    """Explain an uploaded image (same body as POST /classify, same parameters and answers as GET /explain;
    method=similarity on GET /explain?id= only)."""
    if params.method == "similarity":
        raise BadRequestError("method=similarity: POST /classify or /embed the image, then GET /explain?id=&"
                              "method=similarity with text=, query_id= or label=")
    return _shaped(await pipeline.answer(request, choice, scope, admission, _ask(params)))
