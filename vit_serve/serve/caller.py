"""Who is calling: the one identity of a request, verified once by the key check and carried in its ASGI scope.

The API key middleware (`security.ApiKeys`) reads the request's one key header, checks the key and puts the
verified `Identity` (its hash, its name, its priority level) in the scope (`IDENTITY`); everything that depends on
who is calling reads it from there and never from the headers again: the scope of the images a key classified
(`caller_scope`: explain ids are made from it, `stores.secret`), the label cache, the rate bucket and the payload
sampler's tenant. Without API keys there is one scope, `SHARED`, for every caller. A presented `sha256:HEX` is
never a key nor a scope (`keys.presented_hash`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from starlette.types import Scope

from vit_serve.serve.admission import ANONYMOUS, DEFAULT_PRIORITY, Caller
from vit_serve.serve.settings import SecuritySettings

SHARED = ""  # the scope of every caller when the gateway takes no keys
IDENTITY = "vit_serve.identity"  # where the verified Identity lives in an HTTP request's ASGI scope


@dataclass(frozen=True)
class Identity:
    """A request's verified caller: `scope`, its key's hash ("sha256:HEX"; `SHARED` without keys), the key's
    name (metrics, logs, the sampler's tenant; never the key) and its priority level."""

    scope: str = SHARED
    name: str = ANONYMOUS
    priority: int = DEFAULT_PRIORITY

    @property
    def caller(self) -> Caller:
        """The queue's view of it (`admission.Caller`)."""
        return Caller(self.name, self.priority)


ANYONE = Identity()  # the identity of every request when the gateway takes no keys


def keys_required(s: SecuritySettings) -> bool:
    """Whether the gateway takes API keys (`security.KeyRing.on`, from the settings alone)."""
    return bool(s.api_keys or s.admin_api_keys or s.api_keys_file or s.admin_api_keys_file)


def identity_of(scope: Scope) -> Identity | None:
    """The identity the key check verified for this HTTP request (None: it set none, e.g. keys are off)."""
    found = scope.get(IDENTITY)
    return found if isinstance(found, Identity) else None


async def caller_identity(request: Request) -> Identity:
    """The request's verified identity; `ANYONE` when the gateway takes no keys. A keyed gateway's route reached
    without a verified identity is refused (401), never given the shared scope."""
    found = identity_of(request.scope)
    if found is not None:
        return found
    if keys_required(request.app.state.gateway.settings.security):
        raise HTTPException(401, "an API key is needed: send Authorization: Bearer KEY or X-API-Key: KEY",
                            headers={"WWW-Authenticate": 'Bearer realm="vit-serve"'})
    return ANYONE


async def caller_scope(request: Request) -> str:
    """The request's scope: its verified key's hash when the gateway takes keys, else `SHARED`."""
    return (await caller_identity(request)).scope


ScopeDep = Annotated[str, Depends(caller_scope)]
IdentityDep = Annotated[Identity, Depends(caller_identity)]
