"""What the routes that take an image (POST /classify, /embed, /explain) share: their documented errors and links,
and the request's deadline (`AdmissionDep`: `?timeout_ms=` / `X-Request-Timeout-Ms`). The request itself goes
through `pipeline`.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Query
from starlette.requests import Request

from vit_serve.serve.admission import Admission, admission_of
from vit_serve.serve.schemas import ErrorBody

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
    (checked once the version that would answer is known: `pipeline.answer`)."""
    admission = admission_of(request.scope)
    for value, what in ((timeout_ms, "timeout_ms"), (x_request_timeout_ms, "X-Request-Timeout-Ms")):
        admission.within_ms(value, what)  # 0: no deadline
    return admission


AdmissionDep = Annotated[Admission, Depends(get_admission)]

# ?max_patches= of a NaFlex model (SigLIP 2): bounded by the model's own budget in `pipeline.patch_budget`, so that
# the answer names the bound (422), and a fixed-size model says it is not one (400).
MaxPatchesQuery = Annotated[int | None, Query(description=(
    "NaFlex models (SigLIP 2) only: resize the whole image, keeping its aspect ratio, to at most this many "
    "patches (from 1 to the model's budget, GET /models; default: the model's budget)"))]
