"""POST /embed: an image in, its embedding out (the pre-logits representation, `vit_serve.embedding`)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request

from vit_serve.serve import pipeline
from vit_serve.serve.caller import ScopeDep
from vit_serve.serve.deps import GatewayDep, ModelChoiceDep
from vit_serve.serve.routes.image_request import BY_ID, ERRORS, AdmissionDep, MaxPatchesQuery
from vit_serve.serve.schemas import EmbedResponse
from vit_serve.serve.uploads import IMAGE_REQUEST_BODY

router = APIRouter(tags=["embed"])


def _answer(done: pipeline.Answered) -> dict:
    """The answer of POST /embed (with tokens=patch: the layer, the grid and the patch tokens)."""
    vector = done.answer.embedding
    assert vector is not None
    out = {"id": done.image_id, "model": done.info.name, "version": done.version, "resolution": done.info.resolution,
           "dim": int(vector.shape[-1]), "normalized": done.ask.normalize, "embedding": vector.tolist(),
           "embedding_fingerprint": done.info.embedding_fingerprint(done.ask.normalize),
           "timing_ms": done.timings.timing_ms()}
    tokens = done.answer.patch_tokens
    if tokens is not None:
        out.update(layer=done.job.task.layer, grid=done.info.grid, patch_tokens=tokens.tolist())
    return out


@router.post("/embed", response_model=EmbedResponse, response_model_exclude_unset=True,
             openapi_extra=IMAGE_REQUEST_BODY, responses={
    **ERRORS, 400: {"description": "malformed multipart body, several models and none named, or a model without "
                                   "an embedding output"},
    200: {"links": {"ExplainById": {"operationRef": "#/paths/~1explain/get", "parameters": BY_ID,
                                    "description": "the attention map of the image just embedded: GET /explain?id="}}}})
async def embed(
    request: Request,
    choice: ModelChoiceDep,
    scope: ScopeDep,
    admission: AdmissionDep,
    gateway: GatewayDep,
    normalize: Annotated[bool, Query(description="L2-normalise the embedding (cosine similarity is then the "
                                                 "dot product)")] = False,
    max_patches: MaxPatchesQuery = None,
    tokens: Annotated[Literal["none", "patch"], Query(description="patch: also the patch tokens of block `layer` "
                                                                  "(the torch backend only)")] = "none",
    layer: Annotated[int, Query(description="tokens=patch: the block, 0-based (negative: from the last, -1)")] = -1,
) -> dict:
    """The embedding of one image: `forward_head(forward_features(x), pre_logits=True)` of the model, [D]
    floats, the representation the classifier head reads (retrieval, deduplication, clustering).

    Body as POST /classify (multipart field `file`, or a raw `image/*` body). Models served from a checkpoint
    have one; an ONNX export has one when exported with `vit-export --outputs logits,embedding` (other models
    answer 400). The image is kept like /classify's, so `GET /explain?id=` works on it too.

    `tokens=patch` adds `"layer", "grid": [gh, gw], "patch_tokens"`: block `layer`'s output over the patches
    (gh * gw rows of D floats, row-major, prefix tokens cut, before the final norm: timm's
    `forward_intermediates(indices=[layer], norm=False)`), for dense retrieval and segmentation; at most
    VIT_SERVE_MAX_PATCH_TOKEN_FLOATS floats (400 beyond), the torch backend only (400 on the others).
    """
    ask = pipeline.Ask("embed", normalize=normalize, max_patches=max_patches,
                       layer=layer if tokens == "patch" else None,
                       max_floats=gateway.settings.max_patch_token_floats)
    return _answer(await pipeline.answer(request, choice, scope, admission, ask))
