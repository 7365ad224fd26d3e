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

Each key is a `Caller` (`KeyRing.caller`): the keys file's name and priority level (`keys.KeyEntry`), handed to
the request's `Admission` once the key is allowed; a key with a rate (`rate_limit`) is refused 429 with
`Retry-After` once its bucket is empty, and its answers carry the IETF draft's `RateLimit-*` headers. Only the
requests that run the model count (`rated`: /classify, /embed, /explain and /v2, not the probes or the page),
in `vit_serve_key_requests_total{key,result}` by the key's name.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette._utils import get_route_path  # the path Starlette's router matches routes on
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vit_serve.serve.admission import Caller, admission_of
from vit_serve.serve.errors import RateLimitedError, envelope
from vit_serve.serve.keys import HASH_PREFIX, KeyEntry, key_hash, read_key_file
from vit_serve.serve.rate_limit import KeyCounts, Rate, RateLimits, Verdict
from vit_serve.serve.schemas import json_bytes
from vit_serve.serve.settings import SecuritySettings, ServeSettings

if TYPE_CHECKING:
    from vit_serve.serve.metrics import GatewayMetrics

__all__ = ["ADMIN_PATH", "GRPC_ADMIN_METHODS", "GRPC_PROBE_METHODS", "HASH_PREFIX", "PAGE_PATHS", "PROBE_PATHS",
           "RATED_PATHS", "REALM", "ApiKeys", "KeyRing", "key_hash", "presented_key", "rated", "read_key_file"]

REALM = 'Bearer realm="vit-serve"'
PAGE_PATHS = ("/", "/static/", "/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc", "/favicon.ico")
PROBE_PATHS = ("/healthz", "/readyz", "/metrics", "/v2/health/live", "/v2/health/ready")
ADMIN_PATH = re.compile(r"^/v2/repository/models/[^/]+/(load|unload|traffic)$")
GRPC_ADMIN_METHODS = ("RepositoryModelLoad", "RepositoryModelUnload")
GRPC_PROBE_METHODS = ("ServerLive", "ServerReady", "ModelReady")
RATED_PATHS = ("/classify", "/embed", "/explain")  # with all of /v2 but its health probes: what rates count


def rated(path: str) -> bool:
    """Whether a request to `path` (as routed) counts against its key's rate."""
    if path in PROBE_PATHS:
        return False
    return path in RATED_PATHS or path == "/v2" or path.startswith("/v2/")


@dataclass(frozen=True)
class KeyRing:
    """The hashes of the API keys and of the admin keys; the Callers of the keys files' entries (by hash) and the
    buckets of the keys with a rate (`limits`, shared by HTTP and gRPC: one ring per app)."""

    keys: tuple[str, ...] = ()
    admin: tuple[str, ...] = ()
    open_probes: bool = True
    any_key_admin: bool = False  # without admin keys: may any caller load / unload (allow_any_key_admin)?
    callers: Mapping[str, Caller] = field(default_factory=dict, compare=False)  # by hash; others: `KeyEntry.of`
    limits: RateLimits = field(default_factory=RateLimits, compare=False)

    @classmethod
    def from_settings(cls, s: SecuritySettings | ServeSettings, repository_api: bool = True) -> KeyRing:
        """The keys of the settings and of their key files (ValueError naming a file that cannot be read). With
        the repository API off (`repository_api`; a ServeSettings says it itself), its routes refuse every call
        themselves, saying so: no refusal here first."""
        if isinstance(s, ServeSettings):
            s, repository_api = s.security, s.repository.repository_api
        keys, admin = list(s.api_keys), list(s.admin_api_keys)  # hashed by the settings already
        entries: list[KeyEntry] = []
        if s.api_keys_file:
            entries += (found := read_key_file(s.api_keys_file))
            keys += [e.hash for e in found]
        if s.admin_api_keys_file:
            entries += (found := read_key_file(s.admin_api_keys_file))
            admin += [e.hash for e in found]
        any_key_admin = s.allow_any_key_admin or not repository_api
        return cls.of(tuple(keys) + tuple(admin), tuple(admin), s.open_probes, any_key_admin, entries)

    @classmethod
    def of(cls, keys: tuple[str, ...], admin: tuple[str, ...], open_probes: bool, any_key_admin: bool,
           entries: list[KeyEntry]) -> KeyRing:
        """A ring whose keys files' `entries` give names, levels and rates (the first entry of a key wins)."""
        callers: dict[str, Caller] = {}
        rates: dict[str, Rate] = {}
        for e in entries:
            if e.hash in callers:
                continue
            callers[e.hash] = Caller(e.name, e.priority)
            if e.rate is not None and e.burst is not None:
                rates[e.hash] = Rate(e.rate, e.burst)
        return cls(keys, admin, open_probes, any_key_admin, callers, RateLimits(rates))

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

    def caller(self, key: str | None) -> Caller:
        """The Caller of a presented key: its name and level (`keys.KeyEntry`); the anonymous caller when keys are
        off or the key is not valid."""
        if not self.on or not self._matches(key, self.keys):
            return Caller()
        hashed = key_hash(key or "")
        return self.callers.get(hashed) or Caller(KeyEntry.of(hashed).name)

    def take(self, key: str | None) -> Verdict | None:
        """A request of `key` against its rate (None: no rate; call once the key is allowed)."""
        if not self.on or key is None or key.startswith(HASH_PREFIX):
            return None
        return self.limits.take(key_hash(key))

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
    """Pure ASGI middleware: 401 / 403 before anything else runs for requests without the right key, 429 for a key
    over its rate; an allowed key's Caller goes to the request's Admission (`metrics`: the per-key counts)."""

    def __init__(self, app: ASGIApp, ring: KeyRing, metrics: GatewayMetrics | None = None) -> None:
        self.app, self.ring = app, ring
        self.counts = None if metrics is None else KeyCounts.on(metrics.registry)

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
        if not verdict:
            await self._refuse(scope, send, key, verdict)
            return
        if not self.ring.on or not rated(path):
            await self.app(scope, receive, send)
            return
        caller, limit = self.ring.caller(key), self.ring.take(key)
        if self.counts is not None:
            self.counts.count(caller.name, limit is None or limit.allowed)
        if limit is not None and not limit.allowed:
            await _answer(scope, send, RateLimitedError.status, limit.message(), limit.headers())
            return
        admission_of(scope).identify(caller)
        await self.app(scope, receive, send if limit is None else _with_headers(send, limit.headers()))

    async def _refuse(self, scope: Scope, send: Send, key: str | None, verdict: bool | None) -> None:
        if verdict is None:
            status, message = 401, ("an API key is needed: send Authorization: Bearer KEY or X-API-Key: KEY"
                                    if key is None else "the API key is not valid")
        else:
            status, message = 403, self.ring.refusal()
        await _answer(scope, send, status, message, [("WWW-Authenticate", REALM)] if status == 401 else [])


async def _answer(scope: Scope, send: Send, status: int, message: str, headers: list[tuple[str, str]]) -> None:
    """An error answer in the envelope of `scope`'s path, with `headers`."""
    body = json_bytes(envelope(scope).body(message))
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers)]})
    await send({"type": "http.response.body", "body": body})


def _with_headers(send: Send, headers: list[tuple[str, str]]) -> Send:
    """`send` with `headers` added to the answer's start."""
    extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *extra]}
        await send(message)

    return sending
