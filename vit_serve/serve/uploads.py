"""Reading the image out of a request: a multipart field `file`, or the raw body with `Content-Type: image/*`.

The body limit is enforced by `middleware.BodyLimit` (Content-Length up front, bytes counted while reading). The
bytes are hashed (sha256, the image's id) chunk by chunk as they are read, not in a second pass over the body.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from hashlib import sha256

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


CHUNK = 1 << 16  # reads of a multipart file (spooled by the form parser)


@dataclass(frozen=True)
class Upload:
    """The uploaded image: its bytes and their sha256 (hex), computed while they were read."""

    data: bytes
    sha256: str


async def _hashed(chunks: AsyncIterator[bytes]) -> Upload:
    h = sha256()
    parts = []
    async for chunk in chunks:
        if chunk:
            h.update(chunk)
            parts.append(chunk)
    return Upload(b"".join(parts), h.hexdigest())  # one part is returned as is, not copied


async def _file_chunks(part: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await part.read(CHUNK):
        yield chunk


def _acceptable(mime: str) -> bool:
    return mime.startswith("image/") or mime in ("application/octet-stream", "")


async def read_image(request: Request) -> Upload:
    """The uploaded image's bytes and sha256; 415 for other content types, 400 for a malformed form, 422 when empty."""
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
            upload = await _hashed(_file_chunks(part))
        finally:
            await form.close()
    elif mime and _acceptable(mime):
        upload = await _hashed(request.stream())
    else:
        raise UnsupportedMediaError(f"unsupported media type {mime or '(no Content-Type)'!r}; {HOW}")
    if not upload.data:
        raise BadImageError(f"the image is empty; {HOW}")
    return upload
