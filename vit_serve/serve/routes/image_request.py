"""What the routes that take an image (POST /classify, /embed, /explain) share: their documented errors and links,
the request's deadline (`AdmissionDep`: `?timeout_ms=` / `X-Request-Timeout-Ms`), and one upload through a model
(`infer_upload`: read -> choose the version -> decode, kept for GET /explain -> infer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Header, Query
from starlette.requests import Request

from vit_serve.runtime.decode import Decoded
from vit_serve.runtime.scheduling import Result
from vit_serve.runtime.task import Task
from vit_serve.serve.admission import Admission, admission_of
from vit_serve.serve.deps import ModelChoice
from vit_serve.serve.model_version import Announcement, ModelVersion
from vit_serve.serve.schemas import ErrorBody
from vit_serve.serve.slow_clients import body_clock
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
    429: {"model": ErrorBody, "description": "the API key is over its rate (Retry-After, RateLimit-* headers)"},
    503: {"model": ErrorBody, "description": "queue full or shed for more urgent requests (Retry-After), or the "
                                             "model is loading or unloaded"},
    504: {"model": ErrorBody, "description": "no answer within the request timeout, or the request's deadline "
                                             "(timeout_ms) passed or could not be met: it was not run"},
}


async def get_admission(
    request: Request,
    timeout_ms: Annotated[float | None, Query(ge=0, allow_inf_nan=False, description=(
        "answer within this many milliseconds of the request's arrival, or 504 without running it (the smaller "
        "of this and X-Request-Timeout-Ms); 0 is no deadline, as Triton's timeout 0"))] = None,
    x_request_timeout_ms: Annotated[float | None, Header(ge=0, allow_inf_nan=False, description=(
        "as timeout_ms (0: no deadline)"))] = None,
) -> Admission:
    """The request's Admission (`hangup.HangUp` made it; the key check named its caller) with its deadline
    (checked once the version that would answer is known: `infer_upload`)."""
    admission = admission_of(request.scope)
    for value, what in ((timeout_ms, "timeout_ms"), (x_request_timeout_ms, "X-Request-Timeout-Ms")):
        admission.within_ms(value, what)  # 0: no deadline
    return admission


AdmissionDep = Annotated[Admission, Depends(get_admission)]


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
async def infer_upload(request: Request, choice: ModelChoice, scope: str, task_of: Callable[[ModelVersion], Task],
                       admission: Admission) -> AsyncIterator[Inferred]:
    """Read the request's image, then run `task_of(version)` on it: 404 / 400 before the body is read (for the
    version that would answer), the version chosen once it is; the version is held until the block ends (an
    answer that still uses it, e.g. a PNG overlay, is made inside the block). `admission` follows it through
    (its stage, for a client that hangs up; its deadline and level, for the queue)."""
    with choice.announce(task_of, admission.priority) as announced:
        announced.heard_from(body_clock(request.scope))  # a stalled upload stops counting as coming
        admission.at("read", announced.version)
        admission.check(announced.version)  # a deadline past on arrival: 504 before the body is read
        _check_arrival(announced, task_of, admission)  # or one the work ahead leaves no time for
        upload = await read_image(request)
    t_read = time.perf_counter()
    with choice.use() as mv, mv.arriving(admission.priority) as arrival:
        admission.at("decode", mv)
        task = task_of(mv)
        decoded = await decode_kept(mv, upload, scope)
        t_decoded = time.perf_counter()
        result = await mv.infer(task, decoded.x, arrival, admission)
        yield Inferred(mv, task, decoded, result, t_read, t_decoded)


def _check_arrival(announced: Announcement, task_of: Callable[[ModelVersion], Task], admission: Admission) -> None:
    """The runner's `check_arrival` for the version announced to. A function of its own, so that no reference
    to the version outlives the call: while the body is read only the announcement (weak) holds it, and an
    unload frees it."""
    mv = announced.version
    if mv is not None:
        mv.runner.check_arrival(task_of(mv), admission)


async def decode_kept(mv: ModelVersion, upload: Upload, scope: str) -> Decoded:
    """The upload decoded (none if the caller sent it before: its crop is in the store) and kept for GET
    /explain, with the caller's id for it (`stores.secret`): another caller's identical upload neither finds
    this crop nor gets this id."""
    secret = mv.store.secret
    image = secret.image_id(scope, upload.sha256)
    decoded = await mv.decode(upload.data, secret.slot(scope, image))
    return dataclasses.replace(decoded, id=image)
