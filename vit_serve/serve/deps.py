"""FastAPI dependencies: the app's Gateway, and the model version a request is routed to (`?model=&version=`).

Everything here runs on the event loop (async dependencies: FastAPI runs plain ones in a worker thread, where
holding a version would race the loop). A route with a body takes a `ModelChoice` and chooses the version once
the body is read, so that a slow upload never keeps a replaced version (and its weights) alive; a route without
one may take the version at once (`ModelDep`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Query, Request

from vit_serve.serve.gateway import Gateway
from vit_serve.serve.model_version import Announcement, ModelVersion


def get_gateway(request: Request) -> Gateway:
    return request.app.state.gateway


GatewayDep = Annotated[Gateway, Depends(get_gateway)]
ModelQuery = Annotated[str | None, Query(description="the model to ask (GET /models lists them; default: the "
                                                     "gateway's default model)")]
VersionQuery = Annotated[str | None, Query(description="its version (default: the newest in service)")]


@dataclass(frozen=True)
class ModelChoice:
    """The model and version a request names (None: the default model, its newest version in service), not yet
    resolved to a loaded version."""

    gateway: Gateway
    name: str | None = None
    version: str | int | None = None

    def announce(self, check: Callable[[ModelVersion], object] | None = None) -> Announcement:
        """Before the body is read: 404 / 400 / 503 now if nothing would answer (and `check`'s 400 for the version
        that would); that version counts the request as coming (`with choice.announce(): read the body`)."""
        mv = self.gateway.model(self.name, self.version)
        if check is not None:
            check(mv)
        return mv.announce()

    @contextlib.contextmanager
    def use(self) -> Iterator[ModelVersion]:
        """The version that answers, chosen now, held until the block ends (an unload waits for it, at most
        unload_grace_s)."""
        mv = self.gateway.model(self.name, self.version)
        with mv.using():
            yield mv


async def get_model_choice(gateway: GatewayDep, model: ModelQuery = None,
                           version: VersionQuery = None) -> ModelChoice:
    """`?model=&version=`, chosen among the versions in service later (`ModelChoice.use`)."""
    return ModelChoice(gateway, model, version)


ModelChoiceDep = Annotated[ModelChoice, Depends(get_model_choice)]


async def get_model(choice: ModelChoiceDep) -> AsyncIterator[ModelVersion]:
    """The version `?model=&version=` names, held for the whole request (routes without a body); 404 for an
    unknown one, 503 while it is not loaded."""
    with choice.use() as mv:
        yield mv


ModelDep = Annotated[ModelVersion, Depends(get_model)]
