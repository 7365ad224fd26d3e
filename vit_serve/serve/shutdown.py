"""Graceful shutdown of `vit-serve serve`: on SIGTERM (or SIGINT) every accepted request gets an answer.

1. drain (`shutdown_drain_s`): /readyz, /v2/health/ready and gRPC ServerReady answer 503 / false ("draining")
   while the server still accepts and answers everything, so that a load balancer (Kubernetes: the endpoints)
   stops sending before the listener closes;
2. grace (`shutdown_grace_s`): the listeners close (uvicorn stops accepting, gRPC `server.stop(grace)`); the
   requests queued and running go on and finish;
3. then the requests still waiting are answered 503 + Retry-After ("the server is shutting down; retry"), and so
   is any that reaches a queue or a route after that; the running batches finish within `MARGIN_S`, uvicorn's
   graceful timeout (grace + MARGIN_S) ends, and the lifespan stops the gateway.

A second signal skips what is left of the drain and the grace (the 503s go out at once); a third SIGINT is
uvicorn's forced exit. A clean drain exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import signal
from types import FrameType

import uvicorn
from fastapi import FastAPI

from vit_serve.serve.gateway import Gateway

log = logging.getLogger("vit_serve.serve")

# After the grace: time for the running batches to finish and the 503s to be written before uvicorn cancels what
# is left (its timeout_graceful_shutdown is grace + MARGIN_S). Kubernetes' terminationGracePeriodSeconds must
# cover preStop + drain + grace + MARGIN_S (deploy/k8s/deployment.yaml, checked by tests/deploy).
MARGIN_S = 5.0
REFUSE_EVERY_S = 0.05  # after the grace, how often the queues are emptied of what reached them since
ACCEPTED_WAIT_S = 0.5  # after the listener closes: time for a just-accepted connection to send its request


def graceful_timeout(grace_s: float) -> float:
    """uvicorn's timeout_graceful_shutdown for a grace of `grace_s` seconds."""
    return grace_s + MARGIN_S


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM / SIGINT starts the drain instead of closing the listener at once."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.app = app
        self.gateway: Gateway = app.state.gateway
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None
        self._hurry = asyncio.Event()  # a second signal: skip the rest of the drain and the grace

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            await super().serve(sockets)
        finally:
            if self._drain is not None:
                self._drain.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._drain

    async def shutdown(self, sockets: list | None = None) -> None:
        # uvicorn closes the listener and, at once, every connection with no request yet: one accepted just
        # before would lose the request it is sending. Close the listener first; the others a moment later.
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        await asyncio.sleep(ACCEPTED_WAIT_S)
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the main thread between bytecodes (uvicorn's signal.signal handler): hand over to the loop.
        if self._loop is None or not self.started or self.should_exit:
            return super().handle_exit(sig, frame)  # still starting, or already closing: uvicorn's own way
        # A fresh context: the signal may interrupt a request, whose request id must not tag the drain's lines.
        if self._drain is None:
            self._loop.call_soon_threadsafe(self._begin, signal.Signals(sig).name, context=contextvars.Context())
        else:
            self._loop.call_soon_threadsafe(self._hurry.set, context=contextvars.Context())

    def _begin(self, name: str) -> None:
        if self._drain is None:
            self._drain = asyncio.get_running_loop().create_task(self._shut_down(name), name="vit-serve-drain")

    async def _wait(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._hurry.wait(), seconds)

    async def _shut_down(self, name: str) -> None:
        s, gateway = self.gateway.settings, self.gateway
        gateway.draining = True
        log.info("%s: draining for %g s (readiness 503, still serving), then %g s for the requests in progress "
                 "(a second signal: now)", name, s.shutdown_drain_s, s.shutdown_grace_s)
        await self._wait(s.shutdown_drain_s)
        grpc = getattr(self.app.state, "grpc", None)
        if grpc is not None:  # stops taking calls now; the lifespan awaits the rest of this stop
            self.app.state.grpc_stopping = asyncio.get_running_loop().create_task(
                grpc.stop(graceful_timeout(s.shutdown_grace_s)), name="vit-serve-grpc-stop")
        self.should_exit = True  # uvicorn's main loop closes the listener and waits for the connections
        await self._wait(s.shutdown_grace_s)
        gateway.closing = True
        error = gateway.shutting_down()
        refused = gateway.refuse_waiting(error)
        log.info("the grace is over: %d waiting request(s) answered 503", refused)
        while True:  # requests decoded after this still reach a queue: answer them too (until serve() ends)
            await asyncio.sleep(REFUSE_EVERY_S)
            gateway.refuse_waiting(error)
