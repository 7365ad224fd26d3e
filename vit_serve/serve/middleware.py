"""Pure ASGI middleware (no per-request task or body copy): request ids, request metrics, the 500 boundary, the
body limit.

Order, outermost first: HangUp (hangup.py) -> RequestId -> CORS -> RequestMetrics -> ApiKeys (security.py) ->
ErrorBoundary -> BodyLimit -> FastAPI's exception handlers -> routes. RequestMetrics sits outside ApiKeys so that
the 401s it answers are counted too (before routing: endpoint "unmatched", like a 404 of an unknown path).
"""

from __future__ import annotations

import contextvars
import logging
import re
import time
import uuid

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vit_serve.serve.errors import BodyTooLargeError, body_limit_message, envelope
from vit_serve.serve.hangup import CLIENT_CLOSED, cancelled
from vit_serve.serve.metrics import GatewayMetrics

log = logging.getLogger("vit_serve.serve")
access = logging.getLogger("vit_serve.serve.access")

# The id of the request being served, for log records made while serving it (`RequestIdFilter`).
request_id: contextvars.ContextVar[str] = contextvars.ContextVar("vit_serve_request_id", default="-")
REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,128}$")  # visible ASCII, as load balancers and tracers make them


def loggable(text: str) -> str:
    """`text` (a request's path, as the client chose it) fit for one log line: every character that is not
    printable (CR, LF, NEL, U+2028, ESC, ...) becomes its Python escape and `\\` becomes `\\\\`, so that a
    percent-encoded line break in a URL cannot start a forged line nor colour a terminal."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(c if c.isprintable() and c != "\\" else c.encode("unicode_escape").decode("ascii")
                   for c in text)


class _Answer:
    """The status an app answers with, seen on its way out (500 until a response starts); `headers` are added
    to the response's."""

    def __init__(self, send: Send, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        self._send, self._headers = send, headers
        self.status = 500
        self.started = False

    def final(self, scope: Scope) -> int:
        """The status to log and count: 499 for a request whose client went away before its answer (`hangup`)."""
        return CLIENT_CLOSED if not self.started and cancelled(scope) else self.status

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status, self.started = message["status"], True
            if self._headers:
                message = {**message, "headers": [*message.get("headers", []), *self._headers]}
        await self._send(message)


class RequestId:
    """Echoes the client's `X-Request-ID` (visible ASCII, at most 128 characters; another is replaced), or makes
    one (uuid4 hex); every answer carries it, and one access line per request logs it with method, path (never
    the query string: it may carry an explain id), status and time."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"x-request-id"), "")
        rid = sent if REQUEST_ID.match(sent) else uuid.uuid4().hex
        token = request_id.set(rid)
        answer = _Answer(send, ((b"x-request-id", rid.encode()),))
        t0 = time.perf_counter()
        try:
            await self.app(scope, receive, answer.send)
        finally:
            access.info("%s %s %s %d %.1f ms", rid, loggable(scope["method"]), loggable(scope["path"]),
                        answer.final(scope),
                        (time.perf_counter() - t0) * 1e3)
            request_id.reset(token)


class QueryRedaction(logging.Filter):
    """Drops the query string from uvicorn's access lines ("GET /explain?... HTTP/1.1" 200 becomes "GET
    /explain?<redacted> ..."): it carries explain ids, which a log reader could use. The gateway's own access
    line (`RequestId`) logs the path alone."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        # uvicorn.access records: (client address, method, path with its query, HTTP version, status)
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], loggable(args[2].split("?", 1)[0]) + "?<redacted>", *args[3:])
        elif isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], loggable(args[2]), *args[3:])
        return True


class RequestIdFilter(logging.Filter):
    """Adds `record.request_id` (the request being served, "-" outside one) to log records."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


def _endpoint(scope: Scope) -> str:
    """The matched route's template ("/v2/models/{name}/infer"), so that labels stay few."""
    route = scope.get("route")
    return getattr(route, "path", None) or "unmatched"


class RequestMetrics:
    """Counts every HTTP answer by endpoint, method and status, and observes its latency."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        answer = _Answer(send)
        t0 = time.perf_counter()
        try:
            await self.app(scope, receive, answer.send)
        finally:
            endpoint = _endpoint(scope)
            self.metrics.requests.labels(endpoint, scope["method"], str(answer.final(scope))).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)


class ErrorBoundary:
    """Logs any exception a route did not turn into an answer and answers 500 with JSON (never a bare crash)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_started(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_started)
        except Exception:
            log.exception("unhandled error in %s %s", loggable(scope["method"]), loggable(scope["path"]))
            if started:
                raise
            body = envelope(scope).body("internal server error; the gateway logged it", 500)
            await JSONResponse(body, 500)(scope, receive, send)


class BodyLimit:
    """413 when the body exceeds `limit` bytes: from Content-Length before reading, and counted while reading
    (chunked uploads, lying headers)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                if value.isdigit() and int(value) > self.limit:
                    body = envelope(scope).body(body_limit_message(self.limit), 413)
                    await JSONResponse(body, 413, headers={"Connection": "close"})(scope, receive, send)
                    return
                break
        received = 0
        limit = self.limit

        async def receive_limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLargeError(limit)
            return message

        await self.app(scope, receive_limited, send)
