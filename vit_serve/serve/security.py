"""Who may call the gateway: API keys (HTTP headers, gRPC metadata) and the admin keys of the repository API.

A key is sent as `Authorization: Bearer KEY` or `X-API-Key: KEY` (over gRPC, the same names as metadata:
`authorization: Bearer KEY` or `x-api-key: KEY`). Keys are kept only as sha256 hashes (`keys.key_hash`; settings
accept `sha256:HEX` entries as hashes, so that a deployment need not hold the keys at all); a presented key is
hashed and compared with every stored hash in constant time (`hmac.compare_digest`), and keys are never logged.
A request without a valid key gets 401 with `WWW-Authenticate: Bearer realm="vit-serve"`; a valid key that is not
an admin key gets 403 on load / unload. Without admin keys, load / unload answer 403 naming the flag, unless
`allow_any_key_admin` (`--allow-any-key-admin`) lets any valid key (anyone, with no API key set) load and unload.

Paths are matched as Starlette routes them (`get_route_path`: the path without `root_path`), so that a gateway
under a proxy prefix (`--root-path /vit`) or mounted in another app guards the same routes as at `/`.

Open without a key: the web page and its files, the OpenAPI document and /docs (the page asks for a key when
the API needs one), and, unless `open_probes` is off, health, readiness and metrics, so that probes and
scrapers keep working when keys are switched on.
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass

from starlette._utils import get_route_path  # the path Starlette's router matches routes on
from starlette.types import ASGIApp, Receive, Scope, Send

from vit_serve.serve.errors import envelope
from vit_serve.serve.keys import HASH_PREFIX, key_hash, read_key_file
from vit_serve.serve.schemas import json_bytes
from vit_serve.serve.settings import SecuritySettings, ServeSettings

__all__ = ["ADMIN_PATH", "GRPC_ADMIN_METHODS", "GRPC_PROBE_METHODS", "HASH_PREFIX", "PAGE_PATHS", "PROBE_PATHS",
           "REALM", "ApiKeys", "KeyRing", "key_hash", "presented_key", "read_key_file"]

REALM = 'Bearer realm="vit-serve"'
PAGE_PATHS = ("/", "/static/", "/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc", "/favicon.ico")
PROBE_PATHS = ("/healthz", "/readyz", "/metrics", "/v2/health/live", "/v2/health/ready")
ADMIN_PATH = re.compile(r"^/v2/repository/models/[^/]+/(load|unload)$")
GRPC_ADMIN_METHODS = ("RepositoryModelLoad", "RepositoryModelUnload")
GRPC_PROBE_METHODS = ("ServerLive", "ServerReady", "ModelReady")


@dataclass(frozen=True)
class KeyRing:
    """The hashes of the API keys and of the admin keys."""

    keys: tuple[str, ...] = ()
    admin: tuple[str, ...] = ()
    open_probes: bool = True
    any_key_admin: bool = False  # without admin keys: may any caller load / unload (allow_any_key_admin)?

    @classmethod
    def from_settings(cls, s: SecuritySettings | ServeSettings, repository_api: bool = True) -> KeyRing:
        """The keys of the settings and of their key files (ValueError naming a file that cannot be read). With
        the repository API off (`repository_api`; a ServeSettings says it itself), its routes refuse every call
        themselves, saying so: no refusal here first."""
        if isinstance(s, ServeSettings):
            s, repository_api = s.security, s.repository.repository_api
        keys, admin = list(s.api_keys), list(s.admin_api_keys)  # hashed by the settings already
        if s.api_keys_file:
            keys += [key_hash(k) for k in read_key_file(s.api_keys_file)]
        if s.admin_api_keys_file:
            admin += [key_hash(k) for k in read_key_file(s.admin_api_keys_file)]
        any_key_admin = s.allow_any_key_admin or not repository_api
        return cls(tuple(keys) + tuple(admin), tuple(admin), s.open_probes, any_key_admin)

    @property
    def on(self) -> bool:
        return bool(self.keys)

    @staticmethod
    def _matches(key: str | None, hashes: tuple[str, ...]) -> bool:
        if key is None:
            return False
        presented = key_hash(key) if not key.startswith(HASH_PREFIX) else "-"  # a hash is not a key
        found = False
        for h in hashes:  # every hash compared, in constant time each: no early exit to time
            found |= hmac.compare_digest(presented.encode(), h.encode())
        return found

    def allows(self, key: str | None, admin: bool = False) -> bool | None:
        """True: allowed; None: no valid key (401); False: a valid key (or, with keys off, anyone) that may not do
        this (403: `refusal`)."""
        if self.on and not self._matches(key, self.keys):
            return None
        if not admin:
            return True
        return self._matches(key, self.admin) if self.admin else self.any_key_admin

    def refusal(self) -> str:
        """The message of a 403 on load / unload."""
        if self.admin:
            return "loading and unloading models needs an admin key"
        return ("loading and unloading models is off: this gateway has no admin key (--admin-api-key); start it "
                "with --allow-any-key-admin to let any caller load and unload")

    def is_open(self, path: str) -> bool:
        if path in PAGE_PATHS or path.startswith("/static/"):
            return True
        return self.open_probes and path in PROBE_PATHS


def presented_key(authorization: str | None, x_api_key: str | None) -> str | None:
    """The key of `Authorization: Bearer KEY` or `X-API-Key: KEY` (None when neither is sent)."""
    if x_api_key:
        return x_api_key.strip()
    if authorization:
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return None


class ApiKeys:
    """Pure ASGI middleware: 401 / 403 before anything else runs for requests without the right key."""

    def __init__(self, app: ASGIApp, ring: KeyRing) -> None:
        self.app, self.ring = app, ring

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = get_route_path(scope)
        admin = bool(ADMIN_PATH.match(path))
        if not admin and (not self.ring.on or self.ring.is_open(path)):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        key = presented_key(headers.get("authorization"), headers.get("x-api-key"))
        verdict = self.ring.allows(key, admin=admin)
        if verdict:
            await self.app(scope, receive, send)
            return
        if verdict is None:
            status, message = 401, ("an API key is needed: send Authorization: Bearer KEY or X-API-Key: KEY"
                                    if key is None else "the API key is not valid")
        else:
            status, message = 403, self.ring.refusal()
        body = json_bytes(envelope(scope).body(message))
        extra = [(b"www-authenticate", REALM.encode())] if status == 401 else []
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]})
        await send({"type": "http.response.body", "body": body})
