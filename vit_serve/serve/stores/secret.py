"""The store secret: the key that makes explain ids and seals what the store keeps (HMAC-SHA256).

- An image's id is `HMAC(secret, caller scope || sha256 of the upload)`: the caller's own (another API key gets
  another id for the same file) and not computable by anyone without the secret, so neither an id nor a 200 / 404
  says whether someone uploaded a given file.
- An entry lives under its *slot*, `HMAC(secret, caller scope || id)`: an id presented by another caller names
  another slot (404), and the store's keys say nothing of the images or the callers.
- An entry that leaves the process (Redis) is sealed: `HMAC(secret, its key || its bytes)` is stored with it and
  checked on every read, so an entry written or moved by anyone without the secret is ignored.

The secret is `store_secret_file` or `store_secret` (VIT_SERVE_STORE_SECRET_FILE / VIT_SERVE_STORE_SECRET), the
same on every replica. Without either, the settings take this process's own (`process_secret`, made once): the
gateways of one process, and the Ray Serve replicas a process starts (the settings carry it to them), share it;
other replicas do not (their ids are 404 here), which the gateway says in one warning line at start when the
store is shared (Redis).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from pydantic import SecretStr

# Shorter secrets are refused: the ids and seals are only as strong as the secret.
MIN_SECRET_BYTES = 16
TAG_BYTES = 32  # HMAC-SHA256
_SEP = b"\x00"


@functools.cache
def process_secret() -> str:
    """This process's random secret, made on first use (what the settings take when none is given)."""
    return secrets.token_hex(32)


class SecretSettings(Protocol):
    """Where the secret comes from: `vit_serve.serve.settings.StoreSettings` (which imports this module, hence a
    protocol rather than the class)."""

    store_secret_file: str | None
    store_secret: SecretStr | None

    @property
    def store_secret_generated(self) -> bool: ...


@dataclass(frozen=True)
class StoreSecret:
    """The secret's derived keys, one per use (ids, slots, seals), so that no output of one is valid as another."""

    _ids: bytes = field(repr=False)
    _slots: bytes = field(repr=False)
    _seals: bytes = field(repr=False)

    @classmethod
    def of(cls, secret: bytes) -> StoreSecret:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the store secret is {len(secret)} bytes; it needs at least {MIN_SECRET_BYTES} "
                             f"(e.g. openssl rand -hex 32)")

        def derive(use: bytes) -> bytes:
            return hmac.new(secret, b"vit-serve store " + use, hashlib.sha256).digest()

        return cls(derive(b"id"), derive(b"slot"), derive(b"seal"))

    @classmethod
    def from_settings(cls, s: SecretSettings) -> StoreSecret:
        """`store_secret_file` (its bytes, trailing whitespace stripped) or `store_secret`; ValueError (one line,
        naming the file, never the secret) when it cannot be read or is too short."""
        if s.store_secret_file:
            if s.store_secret is not None and not s.store_secret_generated:
                raise ValueError("--store-secret-file / VIT_SERVE_STORE_SECRET_FILE and VIT_SERVE_STORE_SECRET are "
                                 "both given: give the store secret one way")
            try:
                secret = Path(s.store_secret_file).read_bytes().rstrip()
            except OSError as e:
                raise ValueError(f"--store-secret-file / VIT_SERVE_STORE_SECRET_FILE: cannot read "
                                 f"{s.store_secret_file}: {e.strerror or e}") from None
            where = s.store_secret_file
        else:
            secret = s.store_secret.get_secret_value().encode() if s.store_secret else b""
            where = "VIT_SERVE_STORE_SECRET"
        try:
            return cls.of(secret)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def image_id(self, scope: str, sha256: str) -> str:
        """The id a caller (`scope`) gets for an upload (`sha256`: hex of its bytes): 64 hex digits."""
        return hmac.new(self._ids, scope.encode() + _SEP + sha256.encode(), hashlib.sha256).hexdigest()

    def slot(self, scope: str, image_id: str) -> str:
        """Where the caller's image `image_id` is kept (the store's key, before the contract)."""
        return hmac.new(self._slots, scope.encode() + _SEP + image_id.encode(), hashlib.sha256).hexdigest()

    def _tag(self, key: str, payload: bytes) -> bytes:
        k = key.encode()
        return hmac.new(self._seals, len(k).to_bytes(4, "big") + k + payload, hashlib.sha256).digest()

    def seal(self, key: str, payload: bytes) -> bytes:
        """`payload` with its tag, for storing under `key` (the tag covers both)."""
        return payload + self._tag(key, payload)

    def unseal(self, key: str, data: bytes) -> bytes | None:
        """The payload of `seal(key, payload)`; None when `data` was not sealed under `key` with this secret."""
        if len(data) < TAG_BYTES:
            return None
        payload, tag = data[:-TAG_BYTES], data[-TAG_BYTES:]
        return payload if hmac.compare_digest(tag, self._tag(key, payload)) else None
