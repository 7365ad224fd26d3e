"""Where recently classified images live, by id (sha256 of the uploaded bytes), for `GET /explain?id=...`.

What is kept is the model-input crop (`vit_serve.preprocess.resize_and_crop` output, uint8 RGB, H x W x 3 bytes):
the input tensor is recomputed from it exactly with `vit_serve.preprocess.to_tensor`, and the PNG overlay is
drawn on it. `--store` (`ServeSettings.store`) chooses the store:

- `memory` (the default): this process's memory (`memory.MemoryStore`); each replica knows only its own images.
- `redis://HOST:PORT/DB` (or `rediss://`, `unix://`): a Redis server shared by every replica
  (`redis.RedisStore`, the `redis` package), so that an image classified by one replica is explained by another.

A store is used from the decode threads (`get` / `put`) and for `GET /explain?id=` (`find`). A store that cannot
be reached never fails a classification: `put` logs a warning, `get` is a miss (the upload is decoded again);
`find` raises `StoreUnavailableError`, a 503 naming the store, since the image may well be there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from PIL import Image

from vit_serve.serve.errors import GatewayError

if TYPE_CHECKING:
    from vit_serve.serve.settings import ServeSettings

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


class StoreUnavailableError(GatewayError):
    """The store could not be asked (e.g. Redis is down): 503, since the image may well be there."""

    status = 503


class CropStore(Protocol):
    """Crops by key."""

    def get(self, key: str) -> Image.Image | None:
        """The crop, or None if unknown, expired, or the store cannot answer (the caller decodes again)."""
        ...

    def find(self, key: str) -> Image.Image | None:
        """The crop, or None if unknown or expired; raises StoreUnavailableError if the store cannot answer."""
        ...

    def put(self, key: str, crop: Image.Image) -> None:
        """Keep the crop (a store that cannot take it logs why; it never raises)."""
        ...

    def close(self) -> None:
        """Release connections (the gateway's stop)."""
        ...


class Namespaced:
    """A store seen through a namespace (keys "key:namespace"): one preprocessing contract's crops."""

    def __init__(self, store: CropStore, namespace: str) -> None:
        self._store, self.namespace = store, namespace

    def get(self, key: str) -> Image.Image | None:
        return self._store.get(f"{key}:{self.namespace}")

    def find(self, key: str) -> Image.Image | None:
        return self._store.find(f"{key}:{self.namespace}")

    def put(self, key: str, crop: Image.Image) -> None:
        self._store.put(f"{key}:{self.namespace}", crop)


def open_store(settings: ServeSettings) -> CropStore:
    """The store `settings.store` names, bounded by `store_size` and `store_ttl_s`; ValueError (one line) for a
    name that is neither `memory` nor a Redis URL, or a Redis URL without the `redis` package. Nothing is
    connected here: a Redis that is down at start-up is reported by the first request that needs it."""
    name = settings.store.strip()
    if name == "memory":
        from vit_serve.serve.stores.memory import MemoryStore

        return MemoryStore(settings.store_size, settings.store_ttl_s)
    if name.startswith(REDIS_SCHEMES):
        try:
            from vit_serve.serve.stores.redis import RedisStore
        except ImportError as e:
            raise ValueError(f"--store {name.split('://')[0]}://...: the redis package is not installed "
                             f"(pip install 'vit-serve[serve]'): {e}") from None
        return RedisStore(name, settings.store_size, settings.store_ttl_s)
    raise ValueError(f"--store / VIT_SERVE_STORE must be 'memory' or a Redis URL (redis://HOST:PORT/DB, "
                     f"rediss://..., unix://...), not {name!r}")
