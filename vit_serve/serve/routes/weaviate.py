"""Weaviate's multi2vec inference contract, so that a Weaviate `multi2vec-clip` module can use a served model as
its inference container: at `/weaviate/` for the default model and `/weaviate/{model}/` for each model (the
module's inference URL is then `http://HOST:PORT/weaviate/NAME`).

The contract, as Weaviate's own module and container have it (weaviate/weaviate modules/multi2vec-clip/clients:
vectorizer.go, meta.go, startup.go; weaviate/multi2vec-clip-inference app.py, clip.py):

- `POST /vectorize` `{"texts": [...], "images": [base64...]}` -> `{"textVectors": [[...]], "imageVectors": [[...]]}`,
  the vectors L2-normalised, in the request's order; the Go client marshals an empty list as `null`, taken as none.
  An error answers its status (> 399) with `{"error": message}`, the field the module reads.
- `GET /meta`: a JSON object describing the model (the module stores it as the module's meta); here with the
  fingerprint of its embedding space, also on each /vectorize answer (a field the module ignores).
- `GET /.well-known/ready` and `/.well-known/live`: 204 (the module waits for ready at startup: status <= 299).

The vectors are `embeddings.embed_items`', the code path of POST /v1/embeddings, so that both answer the same
vectors for the same inputs (the items are the texts, then the images: an error naming `input[i]` counts them so).
Keys apply as on the rest of the API (the probes are open as /readyz is); `open_weaviate` lets requests to
/weaviate/ without a key through (`vit_serve.serve.security`).
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from vit_serve import __version__
from vit_serve.serve import embeddings
from vit_serve.serve.caller import ScopeDep, keys_required
from vit_serve.serve.deps import GatewayDep, ModelChoice, SessionHeader
from vit_serve.serve.errors import BadRequestError, NotFoundError, NotReadyError
from vit_serve.serve.labels import LabelCaller
from vit_serve.serve.openai_schema import DATA_URI, Item
from vit_serve.serve.routes.image_request import AdmissionDep
from vit_serve.serve.schemas import StrictJSONResponse

router = APIRouter(tags=["weaviate"])
PREFIXES = ("/weaviate", "/weaviate/{model}")  # the default model's, each model's


class VectorizeRequest(BaseModel):
    """What Weaviate's module sends: texts and base64 images (either may be null or absent)."""

    model_config = ConfigDict(extra="ignore")

    texts: list[str] | None = Field(None, description="texts, each through the model's text tower")
    images: list[str] | None = Field(None, description="images, each base64 (a data:image/...;base64, URI too)")


class VectorizeResponse(BaseModel):
    textVectors: list[list[float]] = Field(description="one vector per text, L2-normalised")  # noqa: N815
    imageVectors: list[list[float]] = Field(description="one vector per image, L2-normalised")  # noqa: N815
    embedding_fingerprint: str | None = Field(None, description=(
        "the identity of the vectors' space (as POST /embed's): refuse to mix vectors whose fingerprints differ; "
        "Weaviate's module ignores it"))


ModelParam = Annotated[str | None, Field(description="the model (GET /models lists them; default: the gateway's "
                                                   "default model)")]


async def weaviate_choice(gateway: GatewayDep, model: ModelParam = None, session: SessionHeader = None
                          ) -> ModelChoice:
    """The model the path names (`/weaviate/{model}/`; `?model=` under `/weaviate/`), else the default model."""
    return ModelChoice(gateway, model, None, session or None)


class WeaviateError(BaseModel):
    """An error answer, as Weaviate's module reads it (`vecResponse.Error`)."""

    error: str


ChoiceDep = Annotated[ModelChoice, Depends(weaviate_choice)]
ERRORS = {code: {"model": WeaviateError, "description": what} for code, what in (
    (400, "bad base64, a text over the context length, a model without a text tower, too many items"),
    (401, "an API key is needed (unless open_weaviate)"), (404, "unknown model"),
    (413, "body or image over the size limit"), (415, "not an image"),
    (422, "a body that is not the contract's, a corrupt image or a bad timeout"),
    (429, "the API key is over its rate"), (503, "queue full, or the model is loading or not ready"),
    (504, "the request's deadline passed"))}
PROBE_ERRORS = {k: ERRORS[k] for k in (401, 404, 422, 503)}


def _each(method: str, path: str, **kw):
    """Register a handler at `path` under both prefixes."""
    def register(fn):
        for prefix in PREFIXES:
            getattr(router, method)(prefix + path, **kw)(fn)
        return fn
    return register


@_each("get", "/.well-known/live", status_code=204, response_class=Response, responses={422: ERRORS[422]})
async def live(model: ModelParam = None) -> Response:
    """204 while the server answers, whatever the model (Weaviate's liveness probe)."""
    return Response(status_code=204)


@_each("get", "/.well-known/ready", status_code=204, response_class=Response, responses=PROBE_ERRORS)
async def ready(request: Request, choice: ChoiceDep) -> Response:
    """204 once the model is loaded and warmed up and its backend answers, else 503 (Weaviate's module waits for
    this at startup); 404 for an unknown model, except where keys are on: this probe is open to anyone, so an
    unknown model is then answered as one not ready (the models' names are the keys' holders' to know)."""
    try:
        with choice.use() as mv:
            ok, _ = await mv.readiness()
    except (NotFoundError, NotReadyError):
        if not keys_required(choice.gateway.settings.security):
            raise
        ok = False
    if ok:
        return Response(status_code=204)
    return StrictJSONResponse({"error": "not ready: GET /readyz and /models say why"}, status_code=503)


@_each("get", "/meta", responses=PROBE_ERRORS)
async def meta(choice: ChoiceDep) -> dict:
    """The model: its name, version, backend, input resolution, embedding and text tower, as a JSON object."""
    with choice.use() as mv:
        info = mv.info
        return {"model": mv.name, "version": str(mv.version), "backend": mv.backend.name,
                "resolution": list(info.resolution), "embedding_dim": info.embedding_dim,
                "text_tower": mv.text_info(), "normalized": True,
                "embedding_fingerprint": info.embedding_fingerprint(True), "server": f"vit-serve {__version__}"}


@_each("post", "/vectorize", response_model=VectorizeResponse, responses=ERRORS)
async def vectorize(request: Request, body: VectorizeRequest, choice: ChoiceDep, scope: ScopeDep,
                    admission: AdmissionDep) -> dict:
    """The vectors of the texts (the text tower) and the images (as POST /embed?normalize=true), L2-normalised,
    from one version of the model: POST /v1/embeddings' code path (`embeddings.embed_items`), so its vectors."""
    texts, images = body.texts or [], body.images or []
    if not texts and not images:
        return {"textVectors": [], "imageVectors": [], "embedding_fingerprint": None}
    items = [Item(text=t) for t in texts] + [Item(image=_image(b, i)) for i, b in enumerate(images)]
    who = LabelCaller.of(request.app, scope)
    done = await embeddings.embed_items(choice, admission, items, None, who.limits, who.scope)
    vectors = done.vectors.tolist()
    return {"textVectors": vectors[:len(texts)], "imageVectors": vectors[len(texts):],
            "embedding_fingerprint": done.fingerprint}


def _image(value: str, i: int) -> bytes:
    """images[i]'s bytes: base64 (what Weaviate sends), or a data:image/...;base64, URI; 400 otherwise."""
    found = DATA_URI.match(value)
    try:
        return base64.b64decode(value[found.end():] if found else value, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequestError(f"images[{i}] is not base64 (an image's bytes in base64, as Weaviate sends them, or "
                              f"a data:image/...;base64, URI)") from None
