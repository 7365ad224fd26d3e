"""OpenAI's embeddings API: POST /v1/embeddings (texts and images, mixed, into the model's joint space) and GET
/v1/models, with OpenAI's bodies and error shape (`openai_schema`), so that OpenAI's SDKs and the tools built on them
(LangChain, LlamaIndex, vector databases' embedders) call the gateway as they call OpenAI. The request goes through
`embeddings` under the same keys, rate limits, priorities, deadlines, cancellation and metrics as POST /embed."""

from __future__ import annotations

import inspect

import numpy as np
from fastapi import APIRouter, Request

from vit_serve.serve import embeddings
from vit_serve.serve.caller import ScopeDep
from vit_serve.serve.deps import GatewayDep, ModelChoice, SessionHeader, VersionQuery
from vit_serve.serve.image_urls import UrlPolicy
from vit_serve.serve.labels import LabelCaller
from vit_serve.serve.openai_schema import (
    EmbeddingsRequest,
    EmbeddingsResponse,
    InputError,
    ModelList,
    OpenAIError,
    encode_vector,
    items_of,
)
from vit_serve.serve.routes.image_request import AdmissionDep
from vit_serve.serve.routes.models import _repository

router = APIRouter(prefix="/v1", tags=["openai"])

ERRORS = {status: {"model": OpenAIError, "description": why} for status, why in {
    400: "not a valid request: a bad input, an image that is not base64, token ids, a text over the context "
         "length, a model without a text tower asked for text, dimensions without Matryoshka training, too many items",
    401: "an API key is needed", 404: "unknown model or version", 413: "body or image over the size limit",
    415: "an image that is not one", 422: "a corrupt image, or bad query parameters",
    429: "the API key is over its rate", 503: "queue full, or the model is loading", 504: "the deadline passed",
}.items()}

DESCRIPTION = inspect.cleandoc("""OpenAI's embeddings: `{"input": ..., "model": NAME, "encoding_format":
    "float" | "base64", "dimensions": D}` -> `{"object": "list", "data": [{"object": "embedding", "index",
    "embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}`.

    `input` is a string or a list. A `data:image/...;base64,` string is an image; any other string is text, for the
    model's text tower (`NAME_text.onnx` beside an export, or the tower a converted CLIP / SigLIP checkpoint holds);
    Jina-style items `{"text": ...}` and `{"image": base64, data URI or http(s) URL}` say which (a URL is fetched
    only from the hosts the operator allows, image_url_hosts, and never from a non-public address). Image and text
    vectors are in one space, L2-normalised: an image's is POST /embed's embedding normalised (open_clip's
    `encode_image`), a text's the tower's (`encode_text`). One request mixes both; each vector is what the item
    alone would get.
    `dimensions` truncates and renormalises, for models whose manifest declares Matryoshka training only.
    `usage.prompt_tokens` counts text tokens and image patches. `embedding_fingerprint` (not OpenAI's) names the
    space the vectors are in, texts and images alike: vectors of different fingerprints must not be mixed. At most
    the model's images per request (VIT_SERVE_MAX_IMAGES_PER_REQUEST, by default its max_batch) items; each item
    beyond the first counts in the key's rate. Errors: OpenAI's `{"error": {"message", "type", "param", "code"}}`.

    Not OpenAI's (the SDK's `extra_body`): `"tokens": "patch", "layer": k` adds to each image item `"layer",
    "grid": [gh, gw], "patch_tokens"`, block k's patch tokens as POST /embed?tokens=patch gives them (floats, or
    one base64 string of them all with encoding_format=base64), at most VIT_SERVE_MAX_PATCH_TOKEN_FLOATS floats
    over the request's images; the torch backend only.""")


@router.post("/embeddings", response_model=EmbeddingsResponse, response_model_exclude_unset=True,
             description=DESCRIPTION, responses=ERRORS)
async def create_embeddings(body: EmbeddingsRequest, request: Request, gateway: GatewayDep, scope: ScopeDep,
                            admission: AdmissionDep, version: VersionQuery = None,
                            session: SessionHeader = None) -> dict:
    """The embeddings of the request's items (`DESCRIPTION`)."""
    try:
        items = items_of(body.input)
    except InputError as e:
        raise embeddings.refuse(e) from None
    s = gateway.settings
    items = await embeddings.fetched(items, UrlPolicy.of(s.security), s.max_body_bytes)  # image URLs, if allowed
    choice = ModelChoice(gateway, body.model, version, session or None)
    who = LabelCaller.of(request.app, scope)
    layer = body.layer if body.tokens == "patch" else None
    done = await embeddings.embed_items(choice, admission, items, body.dimensions, who.limits, who.scope, layer,
                                        gateway.settings.max_patch_token_floats)
    data = [_item(done, i, v, body.encoding_format) for i, v in enumerate(done.vectors)]
    return {"object": "list", "data": data, "model": done.model, "model_version": done.version,
            "embedding_fingerprint": done.fingerprint,
            "usage": {"prompt_tokens": done.prompt_tokens, "total_tokens": done.prompt_tokens}}


def _item(done: embeddings.Embedded, i: int, vector: np.ndarray, encoding: str) -> dict:
    """One item's entry of `data` (an image's patch tokens with tokens=patch)."""
    out = {"object": "embedding", "index": i, "embedding": encode_vector(vector, encoding)}
    tokens = done.patch_tokens.get(i)
    if tokens is not None:
        out.update(layer=done.layer, grid=done.grid, patch_tokens=encode_vector(tokens.reshape(-1), encoding)
                   if encoding == "base64" else tokens.astype(np.float32).tolist())
    return out


@router.get("/models", response_model=ModelList, responses={k: ERRORS[k] for k in (401, 503)})
async def list_models(gateway: GatewayDep) -> dict:
    """The models in service, as OpenAI lists its models (`id`: the name `model` takes)."""
    repo = _repository(gateway)
    cards = []
    for name in sorted(repo.served):
        newest = repo.newest(name)
        if newest is not None:
            cards.append({"id": name, "object": "model", "created": int(newest.loaded_at), "owned_by": "vit-serve"})
    return {"object": "list", "data": cards}
