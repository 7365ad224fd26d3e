"""What the routes that take an image (POST /classify, /embed, /explain) share: their documented errors and links,
and one upload through a model (`infer_upload`: read -> choose the version -> decode, kept for GET /explain ->
infer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.requests import Request

from vit_serve.runtime.decode import Decoded
from vit_serve.runtime.task import Task
from vit_serve.serve.deps import ModelChoice
from vit_serve.serve.model_version import ModelVersion
from vit_serve.serve.runner import Result
from vit_serve.serve.schemas import ErrorBody
from vit_serve.serve.uploads import Upload, read_image

# The OpenAPI link to GET /explain of the image just answered: its id, and the model and version that answered.
BY_ID = {"id": "$response.body#/id", "model": "$response.body#/model", "version": "$response.body#/version"}

ERRORS = {
    400: {"model": ErrorBody, "description": "malformed multipart body, several models and none named, or "
                                             "explain=true for a model without an explain graph"},
    404: {"model": ErrorBody, "description": "unknown model or version (?model=, ?version=)"},
    413: {"model": ErrorBody, "description": "body over the size limit, or image over the pixel limit"},
    415: {"model": ErrorBody, "description": "not an image (or not a format PIL reads)"},
    422: {"description": "corrupt / truncated / empty image, or bad query parameters"},
    503: {"model": ErrorBody, "description": "queue full (Retry-After), or the model is loading or unloaded"},
    504: {"model": ErrorBody, "description": "no answer within the request timeout"},
}


@dataclass(frozen=True)
class Inferred:
    """One upload answered by a version: the version (held while the `infer_upload` block runs), the task it
    ran, the upload decoded (with the caller's id for it), the runner's result, and when the body was read and
    the image decoded (`time.perf_counter()` seconds)."""

    mv: ModelVersion
    task: Task
    decoded: Decoded
    result: Result
    t_read: float
    t_decoded: float


@contextlib.asynccontextmanager
async def infer_upload(request: Request, choice: ModelChoice, scope: str,
                       task_of: Callable[[ModelVersion], Task]) -> AsyncIterator[Inferred]:
    """Read the request's image, then run `task_of(version)` on it: 404 / 400 before the body is read (for the
    version that would answer), the version chosen once it is; the version is held until the block ends (an
    answer that still uses it, e.g. a PNG overlay, is made inside the block)."""
    with choice.announce(task_of):
        upload = await read_image(request)
    t_read = time.perf_counter()
    with choice.use() as mv, mv.arriving() as arrival:
        task = task_of(mv)
        decoded = await decode_kept(mv, upload, scope)
        t_decoded = time.perf_counter()
        result = await mv.infer(task, decoded.x, arrival)
        yield Inferred(mv, task, decoded, result, t_read, t_decoded)


async def decode_kept(mv: ModelVersion, upload: Upload, scope: str) -> Decoded:
    """The upload decoded (none if the caller sent it before: its crop is in the store) and kept for GET
    /explain, with the caller's id for it (`stores.secret`): another caller's identical upload neither finds
    this crop nor gets this id."""
    secret = mv.store.secret
    image = secret.image_id(scope, upload.sha256)
    decoded = await mv.decode(upload.data, secret.slot(scope, image))
    return dataclasses.replace(decoded, id=image)
