"""GET /explain (an image classified earlier, by id) and POST /explain (an upload): what the model attended to.

Methods: `rollout` (attention rollout, Abnar & Zuidema 2020: any backend with an explain graph; exported graphs
have their head_fusion / discard_ratio baked in, other values answer 400 naming them) and `grad_rollout`
(gradient-weighted rollout, Chefer et al. 2021: the torch backend only, 400 elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from vit_serve.explain import DEFAULT_DISCARD_RATIO, DEFAULT_HEAD_FUSION, HEAD_FUSIONS
from vit_serve.overlay import COLORMAPS
from vit_serve.serve import pipeline
from vit_serve.serve.caller import ScopeDep
from vit_serve.serve.deps import ModelChoiceDep, ModelDep
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
class ExplainParams:
    method: Literal["rollout", "grad_rollout"]
    head_fusion: str | None
    discard_ratio: float | None
    format: Literal["png", "json"]
    target: int | None
    alpha: float
    colormap: str
    size: int | None
    max_patches: int | None = None


async def explain_params(
    method: Annotated[Literal["rollout", "grad_rollout"], Query(description="grad_rollout: torch backend only")
                      ] = "rollout",
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


def _shaped(done: pipeline.Answered) -> Response | dict:
    """The answer as GET /explain gives it: the PNG overlay over the model-input crop, or the JSON map."""
    if done.overlay is not None:
        return Response(done.overlay, media_type="image/png", headers={
            "X-Image-Id": done.image_id, "X-Model": done.info.name, "X-Model-Version": done.version})
    assert done.answer.explanation is not None
    return {"id": done.image_id, "model": done.info.name, "version": done.version,
            **done.answer.explanation.payload(), "predictions": done.answer.prediction_dicts(),
            "timing_ms": done.timings.timing_ms()}


@router.get("/explain", response_model=ExplainResponse, responses={200: PNG, 404: {"model": ErrorBody}, **ERRORS})
async def explain_by_id(
    mv: ModelDep,
    params: ParamsDep,
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
    """
    return _shaped(await pipeline.answer_kept(mv, scope, admission, _ask(params), id))


@router.post("/explain", response_model=ExplainResponse, responses={200: {**PNG, **BY_ID_LINK}, **ERRORS},
             openapi_extra=IMAGE_REQUEST_BODY)
async def explain_upload(request: Request, choice: ModelChoiceDep, params: ParamsDep, scope: ScopeDep,
                         admission: AdmissionDep) -> Response | dict:
    """Explain an uploaded image (same body as POST /classify, same parameters and answers as GET /explain)."""
    return _shaped(await pipeline.answer(request, choice, scope, admission, _ask(params)))
