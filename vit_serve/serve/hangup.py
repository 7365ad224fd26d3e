"""Clients that hang up: an inference request whose client has gone is cancelled wherever it is.

Uvicorn tells an app that its client went away only through the ASGI `http.disconnect` message, which an app
sees only if it calls `receive()` again once the body is read, and Starlette's routes never do: without this, a
request whose client left is still decoded, queued and run, for nobody. `HangUp` runs each inference request
(`CANCELLABLE`: /classify, /embed, /explain and /v2 infer) in its own task and listens for
`http.disconnect` beside it (while the body is read, and after it until the answer is sent); when it comes the
request's task is cancelled: a decode not begun never starts (the decode pool's future is cancelled), the request
leaves its queue and any batch that has not started (`runtime.scheduling`), and a Triton call is cancelled (the Triton
backend's gRPC call is cancelled, its HTTP request closed). The request's `Admission` (made here, as the request
arrives) says where it was: `vit_serve_cancelled_total{stage, model, version}` counts it there, once (here, or
by the version's runner when it holds the request: `Ticket.caller_left`). Nothing is sent
to a client that has gone; the access line and the request counter say 499 (nginx's "client closed request").
A client that half-closes after a complete request (`shutdown(SHUT_WR)`) has not gone: under `vit-serve serve`
its EOF does not close the connection (`slow_clients`, which tells it from a socket closed entirely), so no
`http.disconnect` comes and it gets its answer.

Other routes (the repository API's load / unload above all, which must not stop half-way) are not watched.
"""

from __future__ import annotations

import asyncio
import re

from starlette._utils import get_route_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vit_serve.serve.admission import SCOPE_KEY, Admission
from vit_serve.serve.metrics import GatewayMetrics

CANCELLABLE = re.compile(r"^/(classify|embed|explain)$|^/v2/models/[^/]+(/versions/[^/]+)?/infer$")
CLIENT_CLOSED = 499  # the status logged and counted for a request whose client went away


def cancelled(scope: Scope) -> bool:
    """Whether this request's client went away (its answer was never sent)."""
    admission = scope.get(SCOPE_KEY)
    return admission is not None and admission.cancelled


class HangUp:
    """Pure ASGI middleware: makes each request's `Admission`; cancels an inference request whose client went
    away and counts it."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        admission = scope[SCOPE_KEY] = Admission()
        if not CANCELLABLE.match(get_route_path(scope)):
            await self.app(scope, receive, send)
            return
        await _Watch(self.app, self.metrics, admission, receive, send).run(scope)


class _Watch:
    """One watched request: its task, the disconnect listener, and whether its answer is complete."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, admission: Admission, receive: Receive,
                 send: Send) -> None:
        self.app, self.metrics, self.admission = app, metrics, admission
        self._receive, self._send = receive, send
        self.body_read = asyncio.Event()
        self.answered = False
        self.task: asyncio.Task[None] | None = None
        self.after_body: asyncio.Future[Message] | None = None  # the message the listener got (http.disconnect)

    async def run(self, scope: Scope) -> None:
        task = self.task = asyncio.ensure_future(self.app(scope, self.receive, self.send))
        listener: asyncio.Task[None] | None = None
        read = asyncio.ensure_future(self.body_read.wait())
        try:
            await asyncio.wait([task, read], return_when=asyncio.FIRST_COMPLETED)
            if not task.done():  # the body is read: listen for the client leaving while the answer is made
                listener = asyncio.ensure_future(self._listen())
                await asyncio.wait([task])
        except asyncio.CancelledError:  # the server itself stops this request (shutdown): pass it on
            task.cancel()
            raise
        finally:
            read.cancel()
            if listener is not None:
                listener.cancel()
        if task.cancelled() and self.admission.cancelled:
            return  # the client went away: nothing to answer
        task.result()  # the app's own exception or cancellation, if any

    async def receive(self) -> Message:
        if self.body_read.is_set():  # after the body: the listener's message (http.disconnect)
            if self.after_body is None:
                self.after_body = asyncio.get_running_loop().create_future()
            return await asyncio.shield(self.after_body)
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self._hung_up()
            raise asyncio.CancelledError  # the app stops reading here, as cancelled
        if not message.get("more_body", False):
            self.body_read.set()
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.answered = True
        await self._send(message)

    async def _listen(self) -> None:
        message = await self._receive()
        if self.after_body is None:
            self.after_body = asyncio.get_running_loop().create_future()
        if not self.after_body.done():
            self.after_body.set_result(message)
        if message["type"] == "http.disconnect" and not self.answered:
            self._hung_up()
            if self.task is not None:
                self.task.cancel()

    def _hung_up(self) -> None:
        if not self.answered:
            self.metrics.caller_left(self.admission)
