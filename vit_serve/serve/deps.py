"""FastAPI dependencies: the app's Gateway, and the model version a request is routed to (`?model=&version=`),
held for the whole request so that an unload lets it finish."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Query, Request

from vit_serve.serve.gateway import Gateway
from vit_serve.serve.model_version import ModelVersion


def get_gateway(request: Request) -> Gateway:
    return request.app.state.gateway


GatewayDep = Annotated[Gateway, Depends(get_gateway)]


def get_model(
    gateway: GatewayDep,
    model: Annotated[str | None, Query(description="the model to ask (GET /models lists them; default: the "
                                                   "gateway's default model)")] = None,
    version: Annotated[str | None, Query(description="its version (default: the newest in service)")] = None,
) -> Iterator[ModelVersion]:
    """The version `?model=&version=` names; 404 for an unknown one, 503 while it is not loaded."""
    mv = gateway.model(model, version)
    with mv.using():
        yield mv


ModelDep = Annotated[ModelVersion, Depends(get_model)]
