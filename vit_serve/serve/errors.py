"""The gateway's answers to errors: one table (`STATUSES`) maps each error to its HTTP status, and
`GRPC_CODES` each HTTP status to its gRPC code; `install_error_handlers` renders them as JSON.

The runtime raises its own errors (`vit_serve.runtime.errors`, which know no protocol); the gateway raises the
classes below, one per answer, each a runtime error as well (a `GatewayError` takes `headers` as it always did).
Under /v2 (`V2`: the Open Inference Protocol's router group, routes.v2) and /weaviate/ errors answer
`{"error": message}`, the protocol's error body (and what Weaviate's module reads); under /v1 (OpenAI's embeddings
API, routes.openai) OpenAI's `{"error": {"message", "type", "param", "code"}}`; elsewhere FastAPI's `{"detail":
message}`: `envelope(scope)` chooses, for the exception handlers here and for the middleware that answers before
routing (the key check, the body limit). Anything unexpected is logged and answered 500 by `ErrorBoundary`
(middleware).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from starlette._utils import get_route_path
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope

from vit_serve.runtime import errors as runtime
from vit_serve.runtime.errors import BackendUnavailableError, ServingError
from vit_serve.serve.openai_schema import V1, error_body
from vit_serve.serve.schemas import StrictJSONResponse

if TYPE_CHECKING:
    import grpc

log = logging.getLogger("vit_serve.serve")
# What a client is told when the backend does not answer (the error itself names internal hosts and is logged):
# HTTP 503, gRPC UNAVAILABLE.
BACKEND_UNAVAILABLE = BackendUnavailableError.PUBLIC_MESSAGE


class _TableStatus:
    """A class attribute that reads the error's HTTP status from `STATUSES` (a subclass may set its own)."""

    def __get__(self, error: object, cls: type[BaseException]) -> int:
        return table_status(cls)


class GatewayError(ServingError):
    """A request the gateway answers with `status` and a one-line message (and `headers`: Retry-After only)."""

    status: Any = _TableStatus()

    def __init__(self, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message, retry_after=(headers or {}).get("Retry-After"))

    @property
    def headers(self) -> dict[str, str] | None:
        return error_headers(self)


class BadRequestError(GatewayError, runtime.InvalidInputError):
    pass


class ForbiddenError(GatewayError):
    """A call this gateway refuses whoever makes it: the repository API turned off (HTTP 403; a key that may not
    load or unload models is refused 403 by the key check)."""


class NotFoundError(GatewayError, runtime.NotFoundError):
    pass


class TooLargeError(GatewayError, runtime.TooLargeError):
    pass


class UnsupportedMediaError(GatewayError, runtime.UnsupportedMediaError):
    pass


class BadImageError(GatewayError, runtime.UnreadableImageError):
    pass


class InvalidValueError(GatewayError, runtime.InvalidValueError):
    """A well-formed request with an unusable value (FastAPI's own validation errors are 422 too)."""


class QueueFullError(GatewayError, runtime.QueueFullError):
    pass


class RateLimitedError(GatewayError):
    """An API key over its rate (`rate_limit`): 429 with Retry-After, gRPC RESOURCE_EXHAUSTED."""


class NotReadyError(GatewayError, runtime.NotReadyError):
    pass


class GatewayTimeoutError(GatewayError, runtime.ModelTimeoutError):
    """No answer within the gateway's own request timeout."""


# The one table: the HTTP status of each error, the first of its classes (most derived first) listed here.
STATUSES: dict[type[BaseException], int] = {
    runtime.InvalidInputError: 400,
    ForbiddenError: 403,
    runtime.NotFoundError: 404,
    runtime.TooLargeError: 413,
    runtime.UnsupportedMediaError: 415,
    runtime.UnreadableImageError: 422,
    runtime.InvalidValueError: 422,
    RateLimitedError: 429,
    runtime.NotReadyError: 503,
    runtime.QueueFullError: 503,
    runtime.BackendUnavailableError: 503,
    runtime.ModelTimeoutError: 504,
    ServingError: 400,  # any other refusal
}
# HTTP status -> gRPC status code (Triton's and KServe's choices); an unlisted 4xx: INVALID_ARGUMENT, 5xx: INTERNAL.
GRPC_CODES: dict[int, str] = {
    400: "INVALID_ARGUMENT",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    413: "RESOURCE_EXHAUSTED",
    415: "INVALID_ARGUMENT",
    422: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def table_status(cls: type[BaseException]) -> int:
    """The HTTP status `STATUSES` gives an error class (500 for anything that is no ServingError)."""
    return next((STATUSES[c] for c in cls.__mro__ if c in STATUSES), 500)


def http_status(error: BaseException) -> int:
    """The HTTP status the gateway answers `error` with: a GatewayError's `status` (the table's unless its class
    sets its own), else the table's."""
    return error.status if isinstance(error, GatewayError) else table_status(type(error))


def error_headers(error: ServingError) -> dict[str, str] | None:
    """The answer's headers: Retry-After when the error advises one."""
    return {"Retry-After": error.retry_after} if error.retry_after is not None else None


def grpc_status_code(status: int) -> grpc.StatusCode:
    """The gRPC code of an HTTP status the gateway answers (`GRPC_CODES`)."""
    import grpc

    name = GRPC_CODES.get(status, "INVALID_ARGUMENT" if status < 500 else "INTERNAL")
    return grpc.StatusCode[name]


def grpc_code(error: BaseException) -> grpc.StatusCode:
    """The gRPC code the gateway answers `error` with (its HTTP status's, `grpc_status_code`)."""
    return grpc_status_code(http_status(error))


def client_message(error: ServingError) -> str:
    """What the client is told; a backend that does not answer is logged here (its reason names hosts)."""
    if isinstance(error, BackendUnavailableError):
        log.warning("backend unavailable: %s", error)
    return error.message


class BodyTooLargeError(HTTPException):
    """Raised while the body is read (an HTTPException so that FastAPI's body parsing passes it through)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, body_limit_message(limit))


def body_limit_message(limit: int) -> str:
    return f"request body is larger than the limit of {limit} bytes ({limit / 2**20:.1f} MiB; VIT_SERVE_MAX_BODY_BYTES)"


V2 = "/v2"  # the Open Inference Protocol's sub-tree (routes.v2's router prefix), with its own error envelope
WEAVIATE = "/weaviate/"  # Weaviate's multi2vec contract (routes.weaviate): its module reads `{"error": message}`


@dataclass(frozen=True)
class Envelope:
    """How an error answer's JSON body carries its message: under `key` ("detail": FastAPI's, "error": the Open
    Inference Protocol's); `flat`: always one line of text (an HTTPException's detail, validation errors);
    `invalid_status`: the status of a body that fails validation."""

    key: str
    flat: bool
    invalid_status: int = 422

    def body(self, message: str, status: int = 400, param: str | None = None) -> dict[str, Any]:
        return {self.key: message}

    def http(self, detail: Any, status: int = 400) -> dict[str, Any]:
        """An HTTPException's detail (any JSON value FastAPI allows; its text when flat)."""
        return {self.key: str(detail) if self.flat else detail}

    def invalid(self, errors: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Validation errors: "loc: msg; ..." when flat, else FastAPI's list minus the echoed input (it may be a
        large or binary body)."""
        if self.flat:
            return {self.key: _flat(errors)}
        return {self.key: [{k: v for k, v in e.items() if k not in ("input", "ctx", "url")} for e in errors]}


def _flat(errors: Sequence[dict[str, Any]]) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors)


@dataclass(frozen=True)
class OpenAIEnvelope(Envelope):
    """OpenAI's error body, `{"error": {"message", "type", "param", "code"}}` (`openai_schema.error_body`); a body
    that fails validation is a 400, as OpenAI answers it."""

    def body(self, message: str, status: int = 400, param: str | None = None) -> dict[str, Any]:
        return error_body(message, status, param)

    def http(self, detail: Any, status: int = 400) -> dict[str, Any]:
        return error_body(str(detail), status)

    def invalid(self, errors: Sequence[dict[str, Any]]) -> dict[str, Any]:
        loc = [str(p) for p in errors[0]["loc"] if p != "body"] if errors else []
        return error_body(_flat(errors), 400, ".".join(loc) or None)


DETAIL = Envelope("detail", flat=False)
OPEN_INFERENCE = Envelope("error", flat=True)
OPENAI = OpenAIEnvelope("error", flat=True, invalid_status=400)


def envelope(scope: Scope) -> Envelope:
    """The envelope of an error answer to `scope`, by its routed path (--root-path and mounts left out): /v2's
    for anything under /v2 or /weaviate/ (Weaviate's module reads the same `{"error": message}`), routed or not
    (an unknown path there, a 413 before routing), OpenAI's under /v1, FastAPI's elsewhere."""
    path = get_route_path(scope)
    if path.startswith((V2, WEAVIATE)):
        return OPEN_INFERENCE
    return OPENAI if path == V1 or path.startswith(V1 + "/") else DETAIL


def install_error_handlers(app: FastAPI) -> None:
    """JSON answers for the runtime's and the gateway's errors, HTTPException and validation errors."""

    @app.exception_handler(ServingError)
    async def _serving(request: Request, exc: ServingError) -> StrictJSONResponse:
        status = http_status(exc)
        body = envelope(request.scope).body(client_message(exc), status, getattr(exc, "param", None))
        return StrictJSONResponse(body, status, headers=error_headers(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> StrictJSONResponse:
        body = envelope(request.scope).http(exc.detail, exc.status_code)
        return StrictJSONResponse(body, exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> StrictJSONResponse:
        chosen = envelope(request.scope)
        return StrictJSONResponse(chosen.invalid(exc.errors()), chosen.invalid_status)
