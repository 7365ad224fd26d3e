"""Slow clients, at the connection: a header timeout, a body-read deadline, a connection cap, and an answer for a
client that half-closes after its request.

uvicorn (httptools or h11) has no timeout on a request's headers or body and accepts any number of connections: a
slowloris holds a connection for ever by trickling its headers, an upload that sends 4 bytes and stalls holds its
route (and, announced to the batcher, makes batches wait). And a client that half-closes its side
(`shutdown(SHUT_WR)`) after a complete request has its connection closed under it, like a client that hung up.

- `http_protocol(...)`: uvicorn's HTTP protocol (the one its "auto" picks) with
  - a header timeout: a connection that has not sent a request's complete headers within `header_timeout_s` of
    being opened, or of its previous answer, is closed;
  - a connection cap: beyond `max_connections` open connections (or requests in progress), a request is answered
    503 + Retry-After (uvicorn's `limit_concurrency` rule, with the gateway's JSON error body);
  - half-close: an EOF after a complete request keeps the connection open to write its answer (then it is
    closed). A client that closed its socket entirely sends the same EOF; to tell it apart, an interim
    `100 Continue` (which HTTP/1.1 clients must accept before any answer) is written: a closed socket answers it
    with a reset, and the request is then dropped as a hang-up (`hangup`: cancelled, logged 499). Over TLS, asyncio
    closes a half-closed connection itself: there it stays a hang-up.
- `BodyDeadline`: ASGI middleware: the whole body must arrive within `body_timeout_s` of the headers, else 408
  with a message (and the connection is closed); it notes when the latest bytes came (`BodyClock`), which the
  batcher reads to stop counting an upload that has stalled as coming (`scheduling.live_arrivals`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass
from typing import Any

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vit_serve.serve.errors import envelope
from vit_serve.serve.schemas import StrictJSONResponse

log = logging.getLogger("vit_serve.serve")

CLOCK_KEY = "vit_serve.body_clock"  # where a request's BodyClock lives in its ASGI scope
BUSY_RETRY_AFTER_S = 1  # Retry-After of a request refused by the connection cap
# After a half-close, how often the socket is checked for the reset a closed one answers the interim response with:
# a first look at once (a local client), then doubling up to a round trip across the world, then every second.
PROBE_FIRST_S, PROBE_MAX_S = 0.02, 1.0


class BodyTimeoutError(HTTPException):
    """Raised while the body is read (an HTTPException, as `errors.BodyTooLargeError`, so that FastAPI's body
    parsing passes it through): 408, and the connection is closed."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"the request body did not arrive within {timeout_s:g} s of its headers "
                              "(VIT_SERVE_BODY_TIMEOUT_S); send it faster, or a smaller one",
                         headers={"Connection": "close"})


@dataclass
class BodyClock:
    """When the latest bytes of a request's body came (`time.perf_counter()` seconds; its headers' time until
    then)."""

    last: float


def body_clock(scope: Scope) -> BodyClock | None:
    """The request's BodyClock (None outside `BodyDeadline`, e.g. an app without it)."""
    return scope.get(CLOCK_KEY)


class BodyDeadline:
    """Pure ASGI middleware: 408 (`BodyTimeoutError`, raised from `receive`) for a body not complete within
    `timeout_s` of the request's start, however it trickles; keeps the request's `BodyClock`."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        clock = scope[CLOCK_KEY] = BodyClock(time.perf_counter())
        deadline, timeout_s = clock.last + self.timeout_s, self.timeout_s
        complete = False

        async def receive_in_time() -> Message:
            nonlocal complete
            if complete:  # after the body: the disconnect listener (hangup) waits as long as it likes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), deadline - time.perf_counter())
            except TimeoutError:
                raise BodyTimeoutError(timeout_s) from None
            if message["type"] == "http.request":
                clock.last = time.perf_counter()
            complete = not message.get("more_body", False)
            return message

        await self.app(scope, receive_in_time, send)


async def _busy(scope: Scope, receive: Receive, send: Send) -> None:
    """The answer of a request over the connection cap (in place of the app, as uvicorn's own)."""
    message = "the server has too many connections open (VIT_SERVE_MAX_CONNECTIONS); retry later"
    body = envelope(scope).body(message, 503) if scope.get("type") == "http" else {"detail": message}
    await StrictJSONResponse(body, 503, headers={"Retry-After": str(BUSY_RETRY_AFTER_S), "Connection": "close"})(
        scope, receive, send)


class _Guard:
    """What `http_protocol` adds to uvicorn's HTTP protocol (httptools' or h11's, which share these names:
    `connections`, `tasks`, `app`, `cycle`, `transport`, `loop`, `on_response_complete`)."""

    header_timeout_s: float
    max_connections: int
    # uvicorn's attributes, for the type checker
    connections: set
    tasks: set
    app: Any
    cycle: Any
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop

    _header_timer: asyncio.TimerHandle | None = None
    _timed_cycle: Any = None  # the cycle current when the header timer was set: a new one means headers came
    _probe: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        over = len(self.connections) > self.max_connections or len(self.tasks) >= self.max_connections
        app = self.app
        if over:  # a request whose headers complete in this data goes to _busy (uvicorn reads `self.app` then)
            self.app = _busy
        try:
            super().data_received(data)  # type: ignore[misc]
        finally:
            self.app = app
        if self._header_timer is not None and self.cycle is not self._timed_cycle:
            self._stop_header_timer()

    def on_response_complete(self) -> None:
        waiting = not getattr(self, "pipeline", None)  # httptools: no request already read waits behind it
        super().on_response_complete()  # type: ignore[misc]
        if waiting and not self.transport.is_closing():
            self._await_headers()

    def eof_received(self) -> bool | None:
        cycle = self.cycle
        if cycle is None or cycle.response_complete or cycle.more_body or self.transport.is_closing() or \
                self.transport.get_extra_info("sslcontext") is not None:
            return super().eof_received()  # type: ignore[misc]  # no complete request waits: the transport closes
        cycle.keep_alive = False  # answer it, then close
        # An interim answer only before the answer has begun, and never to HTTP/1.0 (RFC 9110, 15.2): without it
        # a client that has gone is found when the answer is written.
        if not cycle.response_started and cycle.scope.get("http_version") == "1.1":
            cycle.waiting_for_100_continue = False  # this one is it
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self._check_reset(PROBE_FIRST_S)
        return True  # keep the transport open to write the answer

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None
        super().connection_lost(exc)  # type: ignore[misc]

    # ---- the header timeout ----------------------------------------------------------------------------

    def _await_headers(self) -> None:
        self._stop_header_timer()
        self._timed_cycle = self.cycle
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.cycle is self._timed_cycle and not self.transport.is_closing():
            log.info("closing a connection that sent no complete request headers within %g s "
                     "(VIT_SERVE_HEADER_TIMEOUT_S)", self.header_timeout_s)
            self.transport.close()

    # ---- after a half-close ----------------------------------------------------------------------------

    def _check_reset(self, after_s: float) -> None:
        self._probe = self.loop.call_later(after_s, self._reset_yet, after_s)

    def _reset_yet(self, after_s: float) -> None:
        """A socket closed entirely answers the interim response with a reset: then the client has gone (the
        transport is aborted: the request's `http.disconnect`, hangup's 499), else look again later."""
        self._probe = None
        cycle, sock = self.cycle, self.transport.get_extra_info("socket")
        if cycle is None or cycle.response_complete or self.transport.is_closing() or sock is None:
            return
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            self.transport.abort()
            return
        self._check_reset(min(PROBE_MAX_S, 2 * after_s))


def _base_protocol() -> type[asyncio.Protocol]:
    """uvicorn's "auto" choice: httptools' protocol where httptools is installed, else h11's."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


def http_protocol(header_timeout_s: float, max_connections: int,
                  base: type[asyncio.Protocol] | None = None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (`base`, default its "auto" one) with the header timeout, the connection cap
    and the half-close answer (`uvicorn.Config(http=...)`)."""
    base = base or _base_protocol()
    return type(f"Guarded{base.__name__}", (_Guard, base),
                {"header_timeout_s": header_timeout_s, "max_connections": max_connections})
