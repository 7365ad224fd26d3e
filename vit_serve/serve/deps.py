"""FastAPI dependencies: the app's Gateway, and the model version a request is routed to (`?model=&version=`).

Everything here runs on the event loop (async dependencies: FastAPI runs plain ones in a worker thread, where
holding a version would race the loop). A route with a body takes a `ModelChoice`: the pipeline chooses the version
before the body is read and announces the request to it without holding it, then keeps it unless it left service
meanwhile (`pipeline`), so that a slow upload never keeps a replaced version (and its weights) alive; a route
without a body may take the version at once (`ModelDep`).

With a traffic split (`traffic`), a request naming no version is routed by its draw, sticky per `X-Session-Id`;
the version drawn when it is announced is the one that answers (unless it left service meanwhile).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Header, Query, Request

from vit_serve.serve.errors import NotFoundError
from vit_serve.serve.gateway import Gateway
from vit_serve.serve.model_version import ModelVersion


async def get_gateway(request: Request) -> Gateway:
    return request.app.state.gateway


GatewayDep = Annotated[Gateway, Depends(get_gateway)]
ModelQuery = Annotated[str | None, Query(description="the model to ask (GET /models lists them; default: the "
                                                     "gateway's default model)")]
VersionQuery = Annotated[str | None, Query(description="its version (default: the model's traffic split's draw, "
                                                       "else the newest in service)")]
SESSION_HEADER = "x-session-id"
SessionHeader = Annotated[str | None, Header(
    alias=SESSION_HEADER, description="the client's session: with a traffic split between versions, requests of "
    "one session go to one version (a stable hash of model and session)")]


@dataclass(frozen=True)
class ModelChoice:
    """The model and version a request names (None: the default model, its newest version in service), not yet
    resolved to a loaded version."""

    gateway: Gateway
    name: str | None = None
    version: str | int | None = None
    session: str | None = None  # X-Session-Id: the client's session, for sticky traffic splits
    # the version drawn by `choose` (a traffic split's random draw is made once per request)
    _drawn: list[int] = field(default_factory=list, compare=False, repr=False)

    def choose(self) -> ModelVersion:
        """The version that would answer now (one repository lookup: 404 / 400 / 503 when there is none); a
        traffic split's draw is kept for `again`."""
        mv = self.gateway.model(self.name, self.version, self.session)
        if self.version is None:
            self._drawn[:] = [mv.version]
        return mv

    def still_serves(self, mv: ModelVersion) -> bool:
        """Whether `mv`, chosen before the body was read, still serves the same name and version (no lookup, no
        new draw): one replaced or unloaded meanwhile does not. 503 when the gateway is stopping."""
        gateway = self.gateway
        if gateway.closing:
            raise gateway.shutting_down()
        repo = gateway.repository
        return repo is not None and repo.served.get(mv.name, {}).get(mv.version) is mv

    def again(self) -> ModelVersion:
        """The version that answers when the one chosen left service while the body was read: the same draw if it
        is still in service, else a new one (`use`)."""
        return self._resolve()

    def _resolve(self) -> ModelVersion:
        if self.version is None and self._drawn:
            try:
                return self.gateway.model(self.name, self._drawn[0], self.session)
            except NotFoundError:  # it left service while the body was read: draw again
                pass
        return self.gateway.model(self.name, self.version, self.session)

    @contextlib.contextmanager
    def use(self) -> Iterator[ModelVersion]:
        """The version that answers, chosen now (the one announced, if still in service), held until the block
        ends (an unload waits for it, at most unload_grace_s)."""
        mv = self._resolve()
        with mv.using():
            yield mv


async def get_model_choice(gateway: GatewayDep, model: ModelQuery = None,
                           version: VersionQuery = None, session: SessionHeader = None) -> ModelChoice:
    """`?model=&version=` and `X-Session-Id`, chosen among the versions in service later (`ModelChoice.use`)."""
    return ModelChoice(gateway, model, version, session or None)


ModelChoiceDep = Annotated[ModelChoice, Depends(get_model_choice)]


async def get_model(choice: ModelChoiceDep) -> AsyncIterator[ModelVersion]:
    """The version `?model=&version=` names, held for the whole request (routes without a body); 404 for an
    unknown one, 503 while it is not loaded."""
    with choice.use() as mv:
        yield mv


ModelDep = Annotated[ModelVersion, Depends(get_model)]
