"""GET /explain (an image classified earlier, by id) and POST /explain (an upload): what the model attended to.

Methods: `rollout` (attention rollout, Abnar & Zuidema 2020: any backend with an explain graph; exported graphs
have their head_fusion / discard_ratio baked in, other values answer 400 naming them) and `grad_rollout`
(gradient-weighted rollout, Chefer et al. 2021: the torch backend only, 400 elsewhere).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from PIL import Image

from vit_serve.explain import DEFAULT_DISCARD_RATIO, DEFAULT_HEAD_FUSION, HEAD_FUSIONS
from vit_serve.manifest import LOGITS, ROLLOUT
from vit_serve.overlay import COLORMAPS
from vit_serve.runtime.postprocess import rollout_payload, top_k
from vit_serve.runtime.scheduling import Result
from vit_serve.runtime.task import Task
from vit_serve.serve.caller import ScopeDep
from vit_serve.serve.deps import ModelChoiceDep, ModelDep
from vit_serve.serve.errors import NotFoundError
from vit_serve.serve.model_version import ModelVersion
from vit_serve.serve.routes.image_request import BY_ID, ERRORS, AdmissionDep, infer_upload
from vit_serve.serve.schemas import ErrorBody, ExplainResponse
from vit_serve.serve.uploads import IMAGE_REQUEST_BODY

router = APIRouter(tags=["explain"])

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
) -> ExplainParams:
    return ExplainParams(method, head_fusion, discard_ratio, format, target, alpha, colormap)


ParamsDep = Annotated[ExplainParams, Depends(explain_params)]


def _task(mv: ModelVersion, p: ExplainParams) -> Task:
    return mv.explain_task(p.method, p.head_fusion, p.discard_ratio, p.target)


async def _answer(mv: ModelVersion, task: Task, image_id: str, crop: Image.Image, result: Result,
                  p: ExplainParams, t0: float, decode_ms: float) -> Response | dict:
    """The explain task's result as GET /explain answers it: the PNG overlay over `crop`, or the JSON map."""
    heat = result.outputs[ROLLOUT][0]
    info = mv.info
    if p.format == "png":
        png = await mv.overlay(crop, heat, p.alpha, p.colormap)
        return Response(png, media_type="image/png", headers={"X-Image-Id": image_id, "X-Model": info.name,
                                                              "X-Model-Version": str(mv.version)})
    logits = result.outputs.get(LOGITS)
    return {
        "id": image_id,
        "model": info.name,
        "version": str(mv.version),
        **rollout_payload(p.method, task.rollout, heat, info),
        "predictions": top_k(logits[0], 5, info) if logits is not None else [],
        "timing_ms": result.timing_ms(decode_ms, (time.perf_counter() - t0) * 1e3),
    }


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
    t0 = time.perf_counter()
    task = _task(mv, params)
    slot = mv.store.secret.slot(scope, id)  # the caller's own: another key's id names another slot
    crop = await asyncio.get_running_loop().run_in_executor(mv.pool, mv.crop_of, slot)  # Redis: a round trip
    if crop is None:
        raise NotFoundError(f"no image with id {id} here for model {mv.name!r} (never sent to it, expired or "
                            f"evicted); send the image again with POST /explain (multipart field 'file' or a raw "
                            f"image/* body)")
    admission.check(mv)
    with mv.arriving(admission.priority) as arrival:
        admission.at("decode", mv)
        x = await mv.tensor_of(crop)
        result = await mv.infer(task, x, arrival, admission)
        return await _answer(mv, task, id, crop, result, params, t0, 0.0)


@router.post("/explain", response_model=ExplainResponse, responses={200: {**PNG, **BY_ID_LINK}, **ERRORS},
             openapi_extra=IMAGE_REQUEST_BODY)
async def explain_upload(request: Request, choice: ModelChoiceDep, params: ParamsDep, scope: ScopeDep,
                         admission: AdmissionDep) -> Response | dict:
    """Explain an uploaded image (same body as POST /classify, same parameters and answers as GET /explain)."""
    t0 = time.perf_counter()
    async with infer_upload(request, choice, scope, lambda mv: _task(mv, params), admission) as done:
        decoded = done.decoded  # the overlay is drawn while the version is still held
        return await _answer(done.mv, done.task, decoded.id, decoded.crop, done.result, params, t0,
                             decoded.decode_ms)
