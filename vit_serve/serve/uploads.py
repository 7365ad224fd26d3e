"""Reading the image out of a request: a multipart field `file`, or the raw body with `Content-Type: image/*`.

The body limit is enforced by `middleware.BodyLimit` (Content-Length up front, bytes counted while reading).
"""

from __future__ import annotations

from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException
from starlette.requests import Request

from vit_serve.serve.errors import BadImageError, BadRequestError, InvalidValueError, UnsupportedMediaError

FIELD = "file"
HOW = f"send the image as multipart/form-data field '{FIELD}', or as the raw body with Content-Type image/*"

# The OpenAPI request body of every route that takes an image (shown in /docs).
IMAGE_REQUEST_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {FIELD: {"type": "string", "format": "binary", "description": "the image"}},
                    "required": [FIELD],
                }
            },
            "image/*": {"schema": {"type": "string", "format": "binary"}},
        },
    }
}


def _acceptable(mime: str) -> bool:
    return mime.startswith("image/") or mime in ("application/octet-stream", "")


async def read_image(request: Request) -> bytes:
    """The uploaded image's bytes; 415 for other content types, 400 for a malformed form, 422 when empty."""
    mime = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if mime == "multipart/form-data":
        try:
            form = await request.form(max_files=1, max_fields=16)
        except MultiPartException as e:
            raise BadRequestError(f"malformed multipart body: {e.message}") from e
        try:
            part = form.get(FIELD)
            if not isinstance(part, UploadFile):
                raise InvalidValueError(f"multipart field '{FIELD}' (a file) is missing; {HOW}")
            part_type = (part.content_type or "").split(";")[0].strip().lower()
            if not _acceptable(part_type):
                raise UnsupportedMediaError(f"unsupported media type {part_type!r} for field '{FIELD}'; {HOW}")
            data = await part.read()
        finally:
            await form.close()
    elif mime and _acceptable(mime):
        data = await request.body()
    else:
        raise UnsupportedMediaError(f"unsupported media type {mime or '(no Content-Type)'!r}; {HOW}")
    if not data:
        raise BadImageError(f"the image is empty; {HOW}")
    return data
