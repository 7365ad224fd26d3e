"""POST /embed: an image in, its embedding out (the pre-logits representation, `vit_serve.embedding`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from vit_serve.serve import pipeline
from vit_serve.serve.caller import ScopeDep
from vit_serve.serve.deps import ModelChoiceDep
from vit_serve.serve.routes.image_request import BY_ID, ERRORS, AdmissionDep, MaxPatchesQuery
from vit_serve.serve.schemas import EmbedResponse
from vit_serve.serve.uploads import IMAGE_REQUEST_BODY

router = APIRouter(tags=["embed"])


@router.post("/embed", response_model=EmbedResponse, openapi_extra=IMAGE_REQUEST_BODY, responses={
    **ERRORS, 400: {"description": "malformed multipart body, several models and none named, or a model without "
                                   "an embedding output"},
    200: {"links": {"ExplainById": {"operationRef": "#/paths/~1explain/get", "parameters": BY_ID,
                                    "description": "the attention map of the image just embedded: GET /explain?id="}}}})
async def embed(
    request: Request,
    choice: ModelChoiceDep,
    scope: ScopeDep,
    admission: AdmissionDep,
    normalize: Annotated[bool, Query(description="L2-normalise the embedding (cosine similarity is then the "
                                                 "dot product)")] = False,
    max_patches: MaxPatchesQuery = None,
) -> dict:
    """The embedding of one image: `forward_head(forward_features(x), pre_logits=True)` of the model, [D]
    floats, the representation the classifier head reads (retrieval, deduplication, clustering).

    Body as POST /classify (multipart field `file`, or a raw `image/*` body). Models served from a checkpoint
    have one; an ONNX export has one when exported with `vit-export --outputs logits,embedding` (other models
    answer 400). The image is kept like /classify's, so `GET /explain?id=` works on it too.
    """
    done = await pipeline.answer(request, choice, scope, admission, pipeline.Ask("embed", normalize=normalize,
                                                                                  max_patches=max_patches))
    vector = done.answer.embedding
    assert vector is not None
    return {"id": done.image_id, "model": done.info.name, "version": done.version, "resolution": done.info.resolution,
            "dim": int(vector.shape[-1]), "normalized": normalize, "embedding": vector.tolist(),
            "embedding_fingerprint": done.info.embedding_fingerprint(normalize), "timing_ms": done.timings.timing_ms()}
