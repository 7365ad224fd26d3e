"""The gateway's client errors: one exception per HTTP answer, rendered as JSON by `install_error_handlers`.

Routes under /v2 answer `{"error": message}` (the Open Inference Protocol's error body); the others answer
FastAPI's `{"detail": message}`. Anything unexpected is logged and answered 500 by `ErrorBoundary` (middleware).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from starlette._utils import get_route_path
from starlette.exceptions import HTTPException as StarletteHTTPException

from vit_serve.runtime.backends.base import BackendUnavailableError
from vit_serve.serve.schemas import StrictJSONResponse

log = logging.getLogger("vit_serve.serve")
# A backend that does not answer: its error names internal hosts (a Triton URL, a Ray deployment), so it is
# logged and the client gets this line (HTTP 503, gRPC UNAVAILABLE).
BACKEND_UNAVAILABLE = "the model's backend is unavailable; retry later"


class GatewayError(Exception):
    """A request the gateway answers with `status` and a one-line message."""

    status: int = 400

    def __init__(self, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers


class BadRequestError(GatewayError):
    status = 400


class ForbiddenError(GatewayError):
    status = 403


class NotFoundError(GatewayError):
    status = 404


class TooLargeError(GatewayError):
    status = 413


class UnsupportedMediaError(GatewayError):
    status = 415


class BadImageError(GatewayError):
    status = 422


class InvalidValueError(GatewayError):
    """A well-formed request with an unusable value (FastAPI's own validation errors are 422 too)."""

    status = 422


class QueueFullError(GatewayError):
    status = 503


class NotReadyError(GatewayError):
    status = 503


class GatewayTimeoutError(GatewayError):
    status = 504


class BodyTooLargeError(HTTPException):
    """Raised while the body is read (an HTTPException so that FastAPI's body parsing passes it through)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, body_limit_message(limit))


def body_limit_message(limit: int) -> str:
    return f"request body is larger than the limit of {limit} bytes ({limit / 2**20:.1f} MiB; VIT_SERVE_MAX_BODY_BYTES)"


def _body(request: Request, message: str) -> dict[str, str]:
    return {"error": message} if get_route_path(request.scope).startswith("/v2") else {"detail": message}


def install_error_handlers(app: FastAPI) -> None:
    """JSON answers for GatewayError, BackendUnavailableError, HTTPException and validation errors."""

    @app.exception_handler(GatewayError)
    async def _gateway(request: Request, exc: GatewayError) -> StrictJSONResponse:
        return StrictJSONResponse(_body(request, exc.message), exc.status, headers=exc.headers)

    @app.exception_handler(BackendUnavailableError)
    async def _unavailable(request: Request, exc: BackendUnavailableError) -> StrictJSONResponse:
        log.warning("backend unavailable: %s", exc)
        return StrictJSONResponse(_body(request, BACKEND_UNAVAILABLE), 503, headers={"Retry-After": "1"})

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> StrictJSONResponse:
        if get_route_path(request.scope).startswith("/v2"):
            return StrictJSONResponse({"error": str(exc.detail)}, exc.status_code, headers=exc.headers)
        return StrictJSONResponse({"detail": exc.detail}, exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> StrictJSONResponse:
        errors = exc.errors()
        if get_route_path(request.scope).startswith("/v2"):
            text = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors)
            return StrictJSONResponse({"error": text}, 422)
        # FastAPI's own shape, minus the echoed input (it may be a large or binary body).
        return StrictJSONResponse({"detail": [{k: v for k, v in e.items() if k not in ("input", "ctx", "url")}
                                        for e in errors]}, 422)
