"""FastAPI dependencies: the app's Gateway and its loaded backend, injected into routes with `Depends`."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from vit_serve.serve.backends.base import Backend
from vit_serve.serve.errors import NotReadyError
from vit_serve.serve.gateway import Gateway


def get_gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def get_backend(gateway: Annotated[Gateway, Depends(get_gateway)]) -> Backend:
    """The loaded backend; 503 while the model is still loading."""
    if gateway.backend is None:
        raise NotReadyError("the model is loading", headers={"Retry-After": "1"})
    return gateway.backend


GatewayDep = Annotated[Gateway, Depends(get_gateway)]
BackendDep = Annotated[Backend, Depends(get_backend)]
