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
the API needs one), and, unless `open_probes` is off, health and readiness (Weaviate's /weaviate/.well-known/ready
and live among them), so that probes keep working when keys are switched on; with `open_weaviate`, a request to
/weaviate/ without a key goes on as anyone (Weaviate's multi2vec module sends none), one with a key is verified.
/metrics needs a key (a scraper without one uses `metrics_port`: vit_serve.serve.metrics_listener).

One request has one identity: it sends at most one key header (two X-API-Key, two Authorization, or one of each
are a 400 / INVALID_ARGUMENT, `presented_key`), the key is verified once (`KeyRing.identify`), and the verified
`caller.Identity` (the key's hash, the keys file's name and priority level, `keys.KeyEntry`) is what every later
step reads: the explain scope, the label cache, the rate bucket, the payload sampler's tenant, the request's
`Admission`. A presented `sha256:HEX` is never a key (`keys.presented_hash`). A key with a rate (`rate_limit`)
is refused 429 with `Retry-After` once its bucket is empty, and its answers carry the IETF draft's `RateLimit-*`
headers; a key with `max_concurrent_per_key` requests in flight is refused 429 too (`in_flight`). Only the
requests that run the model count (`rated`: /classify, /embed, /explain, /v1/embeddings, /v2 and /weaviate/'s
vectorize, not the probes or the page), in `vit_serve_key_requests_total{key,result}` by the key's name. Rates and
caps are per replica.

The key files are read again on SIGHUP and when they change (`KeyRing.refresh`), so that a key is revoked
without a restart; a file that cannot be read keeps the keys read before.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import signal
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette._utils import get_route_path  # the path Starlette's router matches routes on
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vit_serve.serve.admission import DEFAULT_PRIORITY, Caller, admission_of
from vit_serve.serve.caller import ANYONE, IDENTITY, SHARED, Identity
from vit_serve.serve.errors import BadRequestError, RateLimitedError, envelope
from vit_serve.serve.in_flight import RETRY_AFTER_S, InFlight
from vit_serve.serve.keys import (
    HASH_PREFIX,
    KeyEntry,
    default_name,
    file_stamp,
    key_hash,
    presented_hash,
    read_key_file,
)
from vit_serve.serve.rate_limit import KeyCounts, Rate, RateLimits, Verdict
from vit_serve.serve.schemas import json_bytes
from vit_serve.serve.settings import SecuritySettings, ServeSettings

if TYPE_CHECKING:
    from vit_serve.serve.metrics import GatewayMetrics

__all__ = ["ADMIN_PATH", "GRPC_ADMIN_METHODS", "GRPC_PROBE_METHODS", "HASH_PREFIX", "KEY_HEADERS", "PAGE_PATHS",
           "PROBE_PATHS", "RATED_PATHS", "REALM", "WEAVIATE", "ApiKeys", "KeyRing", "KeySet", "KeySources",
           "TwoKeysError", "key_hash", "middle_level", "presented_key", "rated", "read_key_file"]

log = logging.getLogger("vit_serve.serve")

REALM = 'Bearer realm="vit-serve"'
PAGE_PATHS = ("/", "/static/", "/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc", "/favicon.ico")
# /metrics is not one: it shows every key's name and traffic (an open scrape has its own port: metrics_listener).
PROBE_PATHS = ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready")
ADMIN_PATH = re.compile(r"^/v2/repository/models/[^/]+/(load|unload|traffic)$")
GRPC_ADMIN_METHODS = ("RepositoryModelLoad", "RepositoryModelUnload")
GRPC_PROBE_METHODS = ("ServerLive", "ServerReady", "ModelReady")
# with all of /v2 but its health probes: what rates count
RATED_PATHS = ("/classify", "/embed", "/explain", "/v1/embeddings")
WEAVIATE = "/weaviate/"  # Weaviate's multi2vec contract (routes.weaviate): its default model's and each model's
WEAVIATE_PROBE = re.compile(r"^/weaviate/(?:[^/]+/)?\.well-known/(?:ready|live)$")
WEAVIATE_RATED = re.compile(r"^/weaviate/(?:[^/]+/)?vectorize$")
KEY_HEADERS = ("authorization", "x-api-key")  # HTTP header names, and gRPC metadata keys
CHECK_EVERY_S = 1.0  # how often, at most, the key files are looked at for a change


def rated(path: str) -> bool:
    """Whether a request to `path` (as routed) counts against its key's rate."""
    if path in PROBE_PATHS:
        return False
    return path in RATED_PATHS or path == "/v2" or path.startswith("/v2/") or bool(WEAVIATE_RATED.match(path))


class TwoKeysError(BadRequestError):
    """More than one key header (400 / INVALID_ARGUMENT): a request has one identity, so it sends one key."""


def presented_key(headers: Iterable[tuple[str | bytes, str | bytes]]) -> str | None:
    """The key of a request's one `Authorization: Bearer KEY` or `X-API-Key: KEY` header (HTTP headers or gRPC
    metadata, as (name, value) pairs); None when neither is sent (or Authorization is not Bearer). More than one
    of them (two X-API-Key, two Authorization, or one of each) is a TwoKeysError: which one counts would otherwise
    depend on who reads them."""
    found: list[tuple[str, str]] = []
    for k, v in headers:
        name = (k.decode("latin-1") if isinstance(k, bytes) else k).lower()
        if name in KEY_HEADERS:
            found.append((name, v.decode("latin-1") if isinstance(v, bytes) else v))
    if len(found) > 1:
        raise TwoKeysError(f"{len(found)} API key headers: send one key, as either Authorization: Bearer KEY or "
                           f"X-API-Key: KEY, once")
    if not found:
        return None
    name, value = found[0]
    if name == "x-api-key":
        return value.strip() or None
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def middle_level(entries: Iterable[KeyEntry]) -> int:
    """The level of keys given no priority: the middle of the levels `entries` give, rounded toward the less
    urgent (a larger number); `DEFAULT_PRIORITY` when they give none."""
    levels = [e.priority for e in entries if e.priority is not None]
    return (min(levels) + max(levels) + 1) // 2 if levels else DEFAULT_PRIORITY


def _among(hashed: str, hashes: tuple[str, ...]) -> bool:
    """Whether `hashed` is one of `hashes`: every hash compared, in constant time each (no early exit to time)."""
    found = False
    for h in hashes:
        found |= hmac.compare_digest(hashed.encode(), h.encode())
    return found


@dataclass(frozen=True)
class KeySet:
    """The keys in use at one time: the hashes of the valid keys (admin keys among them) and of the admin keys,
    the Callers of the key files' entries (by hash), the level of the other keys, and the buckets of the keys
    with a rate."""

    keys: tuple[str, ...] = ()
    admin: tuple[str, ...] = ()
    callers: Mapping[str, Caller] = field(default_factory=dict)
    default_priority: int = DEFAULT_PRIORITY
    limits: RateLimits = field(default_factory=RateLimits)

    @classmethod
    def of(cls, keys: tuple[str, ...], admin: tuple[str, ...], entries: list[KeyEntry],
           default_priority: int | None = None, previous: RateLimits | None = None) -> KeySet:
        """The set whose key files' `entries` give names, levels and rates (the first entry of a key wins);
        `default_priority` None: `middle_level`. The buckets of `previous` whose rate is unchanged carry on (a
        reload refills no bucket)."""
        default = middle_level(entries) if default_priority is None else default_priority
        callers: dict[str, Caller] = {}
        rates: dict[str, Rate] = {}
        for e in entries:
            if e.hash in callers:
                continue
            callers[e.hash] = Caller(e.name, default if e.priority is None else e.priority)
            if e.rate is not None and e.burst is not None:
                rates[e.hash] = Rate(e.rate, e.burst)
        limits = RateLimits(rates)
        for h, bucket in (previous.buckets if previous is not None else {}).items():
            if h in limits.buckets and limits.buckets[h].rate == bucket.rate:
                limits.buckets[h] = bucket
        return cls(keys, admin, callers, default, limits)


@dataclass(frozen=True)
class KeySources:
    """Where a ring's keys come from: the settings' keys and admin keys (hashes already) and the key files."""

    keys: tuple[str, ...] = ()
    admin: tuple[str, ...] = ()
    keys_file: str | None = None
    admin_file: str | None = None
    default_priority: int | None = None

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(f for f in (self.keys_file, self.admin_file) if f)

    def stamps(self) -> tuple[tuple[int, int, int, int] | None, ...]:
        """What tells that a key file changed (`keys.file_stamp`), one per file."""
        return tuple(file_stamp(f) for f in self.files)

    def read(self, previous: RateLimits | None = None) -> KeySet:
        """The keys, the files read now (ValueError naming a file that cannot be read or a bad line)."""
        keys, admin = list(self.keys), list(self.admin)
        entries: list[KeyEntry] = []
        if self.keys_file:
            entries += (found := read_key_file(self.keys_file))
            keys += [e.hash for e in found]
        if self.admin_file:
            entries += (found := read_key_file(self.admin_file))
            admin += [e.hash for e in found]
        return KeySet.of(tuple(keys) + tuple(admin), tuple(admin), entries, self.default_priority, previous)


class KeyRing:
    """The gateway's keys (`current`, a KeySet, swapped whole when the key files change: `refresh`), whether the
    probes are open, whether any key may load / unload without admin keys, and the per-key count of requests in
    flight (`in_flight`). One ring per app, shared by HTTP and gRPC (one set of buckets and counts)."""

    def __init__(self, keys: Iterable[str] = (), admin: Iterable[str] = (), open_probes: bool = True,
                 any_key_admin: bool = False, *, keys_file: str | None = None, admin_file: str | None = None,
                 default_priority: int | None = None, max_in_flight: int = 0, open_weaviate: bool = False) -> None:
        self.sources = KeySources(tuple(keys), tuple(admin), keys_file, admin_file, default_priority)
        self.open_probes, self.any_key_admin, self.open_weaviate = open_probes, any_key_admin, open_weaviate
        self.in_flight = InFlight(max_in_flight)
        self._lock = threading.Lock()
        self._stamps = self.sources.stamps()  # before reading: a change while it is read is read next time
        self.current = self.sources.read()  # ValueError: a file that cannot be read
        self._checked = time.monotonic()

    @classmethod
    def from_settings(cls, s: SecuritySettings | ServeSettings, repository_api: bool = True) -> KeyRing:
        """The keys of the settings and of their key files (ValueError naming a file that cannot be read). With
        the repository API off (`repository_api`; a ServeSettings says it itself), its routes refuse every call
        themselves, saying so: no refusal here first."""
        if isinstance(s, ServeSettings):
            s, repository_api = s.security, s.repository.repository_api
        return cls(s.api_keys, s.admin_api_keys, s.open_probes, s.allow_any_key_admin or not repository_api,
                   keys_file=s.api_keys_file, admin_file=s.admin_api_keys_file,
                   default_priority=s.default_key_priority, max_in_flight=s.max_concurrent_per_key,
                   open_weaviate=s.open_weaviate)

    @property
    def on(self) -> bool:
        return bool(self.current.keys)

    @property
    def keys(self) -> tuple[str, ...]:
        return self.current.keys

    @property
    def admin(self) -> tuple[str, ...]:
        return self.current.admin

    @property
    def limits(self) -> RateLimits:
        return self.current.limits

    def refresh(self, force: bool = False) -> bool:
        """Read the key files again when they changed (looked at, at most, every `CHECK_EVERY_S`) or when `force`
        (SIGHUP); True when new keys are in use. A file that cannot be read, or holds a bad line, keeps the keys
        read before, and the error is logged (once per change)."""
        if not self.sources.files:
            return False
        with self._lock:
            now = time.monotonic()
            if not force and now - self._checked < CHECK_EVERY_S:
                return False
            self._checked, stamps = now, self.sources.stamps()
            if not force and stamps == self._stamps:
                return False
            self._stamps = stamps
        try:
            found = self.sources.read(self.current.limits)
        except ValueError as e:
            log.error("API keys not read again: %s; the keys read before stay in use", e)
            return False
        self.current = found
        log.info("API keys read again from %s: %d keys, %d of them admin keys", ", ".join(self.sources.files),
                 len(set(found.keys)), len(set(found.admin)))
        return True

    def identify(self, key: str | None) -> Identity | None:
        """The verified identity of a presented key (`presented_key`): its hash, name and level; `ANYONE` when
        keys are off; None when the key is missing or not valid (401). A presented "sha256:HEX" is not a key."""
        found = self.current
        if not found.keys:
            return ANYONE
        if key is None or key.startswith(HASH_PREFIX):
            return None
        hashed = presented_hash(key)
        if not _among(hashed, found.keys):
            return None
        caller = found.callers.get(hashed)
        if caller is None:
            return Identity(hashed, default_name(hashed), found.default_priority)
        return Identity(hashed, caller.name, caller.priority)

    def admits(self, identity: Identity, admin: bool = False) -> bool:
        """Whether a verified `identity` may do this: anything but load / unload (`admin`), which needs an admin
        key, or, without admin keys, `any_key_admin` (403: `refusal`)."""
        if not admin:
            return True
        found = self.current
        if found.admin:
            return identity.scope != SHARED and _among(identity.scope, found.admin)
        return self.any_key_admin

    def allows(self, key: str | None, admin: bool = False) -> bool | None:
        """True: allowed; None: no valid key (401); False: a valid key (or, with keys off, anyone) that may not do
        this (403)."""
        identity = self.identify(key)
        return None if identity is None else self.admits(identity, admin)

    def take(self, hashed: str) -> Verdict | None:
        """A request of the verified key whose hash is `hashed` against its rate (None: no rate)."""
        return None if hashed == SHARED else self.current.limits.take(hashed)

    def refusal(self) -> str:
        """The message of a 403 on load / unload."""
        if self.admin:
            return "loading and unloading models needs an admin key"
        return ("loading and unloading models is off: this gateway has no admin key (--admin-api-key); start it "
                "with --allow-any-key-admin to let any caller load and unload")

    def keyless(self, path: str) -> bool:
        """Whether a request to `path` without a key goes on as anyone (`open_weaviate`: /weaviate/, whose
        Weaviate module sends no key); one with a key is verified as anywhere else."""
        return self.open_weaviate and path.startswith(WEAVIATE)

    def is_open(self, path: str) -> bool:
        if path in PAGE_PATHS or path.startswith("/static/"):
            return True
        return self.open_probes and (path in PROBE_PATHS or bool(WEAVIATE_PROBE.match(path)))


def count_refusal(counts: KeyCounts | None, name: str, result: str) -> None:
    """Count a request of the key `name` refused for its number in flight (`result`: too_many_in_flight)."""
    if counts is not None:
        counts.counter.labels(name, result).inc()


class ApiKeys:
    """Pure ASGI middleware: the request's one key header read and its key verified, once: 400 for more than one
    key header, 401 / 403 before anything else runs for requests without the right key, 429 for a key with
    `max_concurrent_per_key` requests in flight or over its rate. The verified `caller.Identity` goes into the
    scope (`caller.IDENTITY`: the explain scope, the label cache, the sampler read it there) and its Caller to
    the request's Admission (`metrics`: the per-key counts). While the app runs (its lifespan), SIGHUP reads the
    key files again (`KeyRing.refresh`; only where the app runs in the main thread, as `vit-serve serve`)."""

    def __init__(self, app: ASGIApp, ring: KeyRing, metrics: GatewayMetrics | None = None) -> None:
        self.app, self.ring = app, ring
        self.counts = None if metrics is None else KeyCounts.on(metrics.registry)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path, ring = get_route_path(scope), self.ring
        admin = bool(ADMIN_PATH.match(path))
        if not admin and (not ring.on or ring.is_open(path)):
            await self.app(scope, receive, send)
            return
        ring.refresh()
        try:
            key = presented_key(scope["headers"])
        except TwoKeysError as e:
            await _answer(scope, send, 400, str(e), [])
            return
        if key is None and ring.keyless(path):
            scope[IDENTITY] = ANYONE  # the shared scope, no key's rate nor cap
            await self.app(scope, receive, send)
            return
        identity = ring.identify(key)
        if identity is None or not ring.admits(identity, admin):
            await self._refuse(scope, send, key, identity)
            return
        scope[IDENTITY] = identity
        admission_of(scope).identify(identity.caller)
        if not ring.on or not rated(path):
            await self.app(scope, receive, send)
            return
        if not ring.in_flight.enter(identity.scope):
            count_refusal(self.counts, identity.name, "too_many_in_flight")
            await _answer(scope, send, RateLimitedError.status, ring.in_flight.message(),
                          [("Retry-After", str(RETRY_AFTER_S))])
            return
        left = False

        def leave() -> None:
            nonlocal left
            if not left:
                left = True
                ring.in_flight.leave(identity.scope)

        async def answering(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                leave()  # answered: the key's next request may come at once, whatever runs after the answer
            await send(message)

        try:
            limit = ring.take(identity.scope)
            if self.counts is not None:
                self.counts.count(identity.name, limit is None or limit.allowed)
            if limit is not None and not limit.allowed:
                await _answer(scope, send, RateLimitedError.status, limit.message(), limit.headers())
                return
            await self.app(scope, receive, answering if limit is None else _with_headers(answering, limit.headers()))
        finally:
            leave()

    async def _refuse(self, scope: Scope, send: Send, key: str | None, identity: Identity | None) -> None:
        if identity is None:
            status, message = 401, ("an API key is needed: send Authorization: Bearer KEY or X-API-Key: KEY"
                                    if key is None else "the API key is not valid")
        else:
            status, message = 403, self.ring.refusal()
        await _answer(scope, send, status, message, [("WWW-Authenticate", REALM)] if status == 401 else [])

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app's lifespan, with SIGHUP reading the key files again while it runs."""
        hup, loop = getattr(signal, "SIGHUP", None), asyncio.get_running_loop()
        hooked = False
        if hup is not None and self.ring.sources.files and threading.current_thread() is threading.main_thread():
            try:
                loop.add_signal_handler(hup, self.ring.refresh, True)
                hooked = True
            except (NotImplementedError, RuntimeError, ValueError):  # a loop without signal handlers
                log.debug("SIGHUP cannot be handled here: the key files are read again when they change")
        try:
            await self.app(scope, receive, send)
        finally:
            if hooked:
                loop.remove_signal_handler(hup)


async def _answer(scope: Scope, send: Send, status: int, message: str, headers: list[tuple[str, str]]) -> None:
    """An error answer in the envelope of `scope`'s path, with `headers`."""
    body = json_bytes(envelope(scope).body(message, status))
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
