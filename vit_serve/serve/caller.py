"""Who is calling, as far as what they may see goes: the scope of a request.

The scope is the hash (`keys.key_hash`) of the API key the request presented, so that the images one key
classified are its own (explain ids are made from it: `stores.secret`); without API keys there is one scope,
shared by every caller. The API key middleware has checked the key before any route runs.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from vit_serve.serve.keys import key_hash
from vit_serve.serve.security import presented_key
from vit_serve.serve.settings import SecuritySettings

SHARED = ""  # the scope of every caller when the gateway takes no keys


def keys_required(s: SecuritySettings) -> bool:
    """Whether the gateway takes API keys (`security.KeyRing.on`, from the settings alone)."""
    return bool(s.api_keys or s.admin_api_keys or s.api_keys_file or s.admin_api_keys_file)


async def caller_scope(request: Request) -> str:
    """The request's scope: its key's hash when the gateway takes keys, else `SHARED`."""
    if not keys_required(request.app.state.gateway.settings.security):
        return SHARED
    key = presented_key(request.headers.get("authorization"), request.headers.get("x-api-key"))
    return key_hash(key) if key else SHARED


ScopeDep = Annotated[str, Depends(caller_scope)]
