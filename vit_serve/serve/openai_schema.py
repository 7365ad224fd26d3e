"""OpenAI's embeddings API as /v1 speaks it: the request and response bodies of `POST /v1/embeddings` and `GET
/v1/models`, and OpenAI's error body (`{"error": {"message", "type", "param", "code"}}`), which every answer under
/v1 carries (`serve.errors.envelope`). Pure shapes and their reading, no I/O.

An input is a string or a list of items: a string that is a `data:image/...;base64,` URI is an image (NVIDIA NIM's
extension), any other string is text; a Jina-style `{"text": ...}` or `{"image": ...}` (base64, or a data URI) says
which it is; an `http(s)://` image is a URL (`Item.url`), fetched only where the operator allows it.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

V1 = "/v1"  # the sub-tree whose answers, errors included, are OpenAI's shapes
DATA_URI = re.compile(r"^data:image/[A-Za-z0-9.+-]+(;[A-Za-z0-9=.+-]+)*;base64,", re.ASCII)
URL = re.compile(r"^https?://", re.IGNORECASE | re.ASCII)


class TextItem(BaseModel):
    """A Jina-style text item."""

    model_config = ConfigDict(extra="forbid")
    text: str


class ImageItem(BaseModel):
    """A Jina-style image item: base64, a `data:image/...;base64,` URI or an `http(s)://` URL."""

    model_config = ConfigDict(extra="forbid")
    image: str


class EmbeddingsRequest(BaseModel):
    """POST /v1/embeddings' body (OpenAI's, with images: data URIs and Jina-style items)."""

    input: str | list[str | TextItem | ImageItem] | list[int] | list[list[int]] = Field(description=(
        "a string or a list: strings are text for the model's text tower, except `data:image/...;base64,` URIs "
        "(images); items {\"text\": ...} / {\"image\": base64, data URI or http(s) URL}; token ids are refused"))
    model: str | None = Field(None, description="the model to ask (GET /v1/models; default: the gateway's default)")
    encoding_format: Literal["float", "base64"] = Field("float", description=(
        "float: lists of numbers; base64: each vector's little-endian float32 bytes, base64 (as OpenAI's)"))
    dimensions: int | None = Field(None, ge=1, description=(
        "truncate each vector to this many leading dimensions and renormalise: only for models whose manifest "
        "declares Matryoshka training (embedding.matryoshka_dims), else 400"))
    user: str | None = Field(None, description="ignored (OpenAI's end-user id)")
    tokens: Literal["none", "patch"] = Field("none", description=(
        "patch (not OpenAI's: the SDK's extra_body): each image item also gets the patch tokens of block `layer`, "
        "as POST /embed?tokens=patch (the torch backend only); text items get none"))
    layer: int = Field(-1, description="tokens=patch: the block, 0-based (negative: from the last, -1)")


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="the L2-normalised vector (a base64 string with "
                                                      "encoding_format=base64)")
    layer: int | None = Field(None, description="tokens=patch, an image item: the block (absent otherwise)")
    grid: tuple[int, int] | None = Field(None, description="tokens=patch, an image item: the patch grid (gh, gw)")
    patch_tokens: list[list[float]] | str | None = Field(None, description=(
        "tokens=patch, an image item: gh * gw rows of the block's D floats, row-major, before the final norm, not "
        "normalised (with encoding_format=base64: all of them as one base64 string of little-endian float32)"))


class Usage(BaseModel):
    prompt_tokens: int = Field(description="the text items' tokens (with their start and end tokens) plus the "
                                           "image items' patches")
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: Usage
    model_version: str = Field(description="the version of the model that answered (not OpenAI's)")
    embedding_fingerprint: str | None = Field(None, description=(
        "the embedding space's fingerprint (not OpenAI's; vit_serve.fingerprint): the vectors, texts and images "
        "alike, compare only with vectors of the same fingerprint (POST /embed?normalize=true's, predict's files); "
        "null: unknown"))


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="when the version in service was loaded (Unix seconds)")
    owned_by: str = "vit-serve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(BaseModel):
    error: OpenAIErrorDetail


# An HTTP status -> OpenAI's error type and code (what its SDKs read beside the status).
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "server_error", 504: "server_error"}
ERROR_CODES = {401: "invalid_api_key", 404: "not_found", 413: "request_too_large", 415: "unsupported_media_type",
               429: "rate_limit_exceeded", 503: "unavailable", 504: "timeout"}


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error body for an answer of `status`."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": ERROR_CODES.get(status)}}


@dataclass(frozen=True)
class Item:
    """One input: text, an image's bytes, or an image's URL (exactly one is set)."""

    text: str | None = None
    image: bytes | None = None
    url: str | None = None


class InputError(ValueError):
    """An input that is not one: its message, and `param` (which item, as OpenAI's error names it)."""

    def __init__(self, message: str, param: str = "input") -> None:
        super().__init__(message)
        self.param = param


def _image_bytes(value: str, param: str, jina: bool) -> Item:
    """An image string: a data URI (or, from a Jina-style item, plain base64) -> its bytes; a URL as it is."""
    if URL.match(value):
        return Item(url=value)
    match = DATA_URI.match(value)
    if match is None and not jina:
        raise InputError(f"{param}: not a data:image/...;base64, URI", param)
    payload = value[match.end():] if match is not None else value
    try:
        return Item(image=base64.b64decode(payload, validate=True))
    except (binascii.Error, ValueError):
        raise InputError(f"{param}: the image is not valid base64", param) from None


def items_of(value: Any) -> list[Item]:
    """The request's `input` (as validated by `EmbeddingsRequest`) -> its items, in order; InputError for token
    ids, an empty list or an image that is not base64."""
    values = [value] if isinstance(value, str) else list(value)
    if not values:
        raise InputError("input is empty: send a string or a non-empty list")
    items = []
    for i, v in enumerate(values):
        param = f"input[{i}]" if not isinstance(value, str) else "input"
        if isinstance(v, int | list):
            raise InputError(f"{param}: token ids are not accepted here (the text tower has its own tokenizer): "
                             f"send the text", param)
        if isinstance(v, TextItem):
            items.append(Item(text=v.text))
        elif isinstance(v, ImageItem):
            items.append(_image_bytes(v.image, param, jina=True))
        elif DATA_URI.match(v) or v.startswith("data:image/"):
            items.append(_image_bytes(v, param, jina=False))
        else:
            items.append(Item(text=v))
    return items


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """A vector as the answer carries it: floats, or base64 of its little-endian float32 bytes (OpenAI's)."""
    if encoding_format == "base64":
        return base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector.astype(np.float32).tolist()
