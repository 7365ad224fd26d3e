"""The Redis store (`--store redis://HOST:PORT/DB`): crops shared by every replica of the gateway.

Each crop is one Redis string under `prefix + key` (key: "SLOT:CONTRACT", the slot an HMAC of the caller's
scope and the image id, `secret.StoreSecret.slot`): an 8-byte header (magic, width, height), the raw RGB bytes
(lossless, so the input tensor recomputed from it is exact) and a 32-byte seal, HMAC-SHA256 with the store secret
over the whole Redis key and the bytes before it. It is set with `SET ... PX ttl` and read with `GETEX ... PX
ttl`, which renews it as a hit renews the memory store's entries (Redis >= 6.2). An entry whose seal fails
(written by anything without the secret, or moved from another key) is a miss, counted by `rejected`
(`vit_serve_store_rejected_total`) and logged once; the upload is then decoded again and its sealed crop replaces
it. Raw rather than PNG: measured on a 224 x 224 photo crop, PNG level 1 is 89 KiB against 147 KiB
but costs 6.8 ms to encode and 5.0 ms to decode against 0.04 and 0.2 ms, and the read runs on the request's
critical path.

Bounds: the TTL is Redis's; a crop larger than `max_entry_bytes` is not stored (logged); `size` 0 keeps nothing,
as in the memory store. The count is not capped here: the total is the server's business, its `maxmemory`
with an evicting policy (e.g. `--maxmemory 256mb --maxmemory-policy volatile-lru`: every entry has a TTL).

A Redis that cannot be reached (down, refused, slower than `timeout_s`) never fails a classification: `put`
logs a warning (once per outage; again when it is back) and `get` is a miss; `find` (GET /explain?id=) raises
StoreUnavailableError, a 503. Calls run in the caller's thread; redis-py's client is thread-safe (a pool of
connections). The password comes from the URL or, so that it is in neither the URL nor the environment, from
`store_password_file` (`password`); messages name the URL without it (`stores.redacted`).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable

import redis
from PIL import Image
from redis.backoff import NoBackoff
from redis.retry import Retry

from vit_serve.serve.stores.base import StoreUnavailableError
from vit_serve.serve.stores.redaction import redacted
from vit_serve.serve.stores.secret import StoreSecret

log = logging.getLogger("vit_serve.serve")

PREFIX = "vit-serve:crop:"
# A 1024 x 1024 RGB crop is 3 MiB; larger ones are not worth a network hop (the upload is decoded again).
MAX_ENTRY_BYTES = 4 * 2**20


__all__ = ["HEADER", "MAGIC", "PREFIX", "RedisStore", "from_bytes", "redacted", "to_bytes"]

MAGIC = b"VSC2"  # vit-serve crop, layout 2 (sealed; layout 1 entries fail the seal and are ignored)
HEADER = struct.Struct(">4sHH")  # magic, width, height


def to_bytes(crop: Image.Image) -> bytes:
    """An RGB crop -> header + raw RGB bytes."""
    rgb = crop if crop.mode == "RGB" else crop.convert("RGB")
    return HEADER.pack(MAGIC, rgb.width, rgb.height) + rgb.tobytes()


def from_bytes(data: bytes) -> Image.Image:
    """`to_bytes`'s output -> the crop; ValueError for anything else."""
    if len(data) < HEADER.size:
        raise ValueError("too short")
    magic, width, height = HEADER.unpack_from(data)
    if magic != MAGIC or len(data) != HEADER.size + width * height * 3:
        raise ValueError("not a vit-serve crop")
    return Image.frombytes("RGB", (width, height), data[HEADER.size:])


class RedisStore:
    """key -> crop in Redis at `url`, each for `ttl_s` seconds after it was last stored or read, sealed with
    `secret`; `rejected` is called for each entry whose seal fails."""

    def __init__(self, url: str, size: int, ttl_s: float, secret: StoreSecret, max_entry_bytes: int = MAX_ENTRY_BYTES,
                 prefix: str = PREFIX, timeout_s: float = 0.5, password: str | None = None,
                 rejected: Callable[[], None] | None = None) -> None:
        self.url, self.size, self.max_entry_bytes, self.prefix = redacted(url), size, max_entry_bytes, prefix
        self.secret, self._rejected = secret, rejected
        self.ttl_ms = max(1, round(ttl_s * 1000))
        auth = {"password": password} if password is not None else {}
        # One retry without waiting: a pooled connection that a Redis restart closed is reopened once; a Redis
        # that is down answers at once rather than after redis-py's default backoff.
        try:
            self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                               retry=Retry(NoBackoff(), 1), **auth)
        except ValueError as e:
            raise ValueError(f"--store {self.url}: {redacted(str(e))}") from None
        self._reachable = True
        self._warned_seal = False

    def put(self, key: str, crop: Image.Image) -> None:
        if self.size == 0:
            return
        data = self.secret.seal(self.prefix + key, to_bytes(crop))
        if len(data) > self.max_entry_bytes:
            log.warning("image store %s: a %d x %d crop is %d bytes, over the %d-byte cap; not stored",
                        self.url, crop.width, crop.height, len(data), self.max_entry_bytes)
            return
        try:
            self.client.set(self.prefix + key, data, px=self.ttl_ms)
        except redis.RedisError as e:
            self._unreachable(e)
            return
        self._back()

    def get(self, key: str) -> Image.Image | None:
        try:
            return self.find(key)
        except StoreUnavailableError:
            return None

    def find(self, key: str) -> Image.Image | None:
        try:
            data = self.client.getex(self.prefix + key, px=self.ttl_ms)
        except redis.RedisError as e:
            self._unreachable(e)
            raise StoreUnavailableError(f"the image store ({self.url}) cannot be reached: {_one_line(e)}; "
                                        f"try again, or send the image with POST /explain",
                                        headers={"Retry-After": "1"}) from e
        self._back()
        if data is None:
            return None
        payload = self.secret.unseal(self.prefix + key, data)
        try:
            if payload is None:
                raise ValueError("its seal fails")
            return from_bytes(payload)
        except ValueError as e:  # not ours: written without the secret, or moved from another key
            self._reject(str(e))
            return None

    def close(self) -> None:
        self.client.close()

    def _reject(self, why: str) -> None:
        if self._rejected is not None:
            self._rejected()
        if not self._warned_seal:  # the key is not logged: it is made from an explain id
            self._warned_seal = True
            log.warning("image store %s: an entry is not a crop this gateway sealed (%s: written without the store "
                        "secret, or moved from another key); ignored, as are the next ones, counted in "
                        "vit_serve_store_rejected_total", self.url, why)

    def _unreachable(self, e: Exception) -> None:
        # One warning per outage: every request would log the same line.
        if self._reachable:
            self._reachable = False
            log.warning("image store %s cannot be reached: %s; GET /explain?id= answers 503 until it is back",
                        self.url, _one_line(e))

    def _back(self) -> None:
        if not self._reachable:
            self._reachable = True
            log.info("image store %s is reachable again", self.url)


def _one_line(e: Exception) -> str:
    return redacted(" ".join(str(e).split())) or type(e).__name__
