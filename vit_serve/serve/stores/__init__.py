"""Where recently classified images live, by id, for `GET /explain?id=...`.

What is kept is the model-input crop (`vit_serve.preprocess.resize_and_crop` output, uint8 RGB, H x W x 3 bytes):
the input tensor is recomputed from it exactly with `vit_serve.preprocess.to_tensor`, and the PNG overlay is
drawn on it. `--store` (`ServeSettings.store`) chooses the store:

- `memory` (the default): this process's memory (`memory.MemoryStore`); each replica knows only its own images.
- `redis://HOST:PORT/DB` (or `rediss://`, `unix://`): a Redis server shared by every replica
  (`redis.RedisStore`, the `redis` package), so that an image classified by one replica is explained by another.

Ids and keys come from the store secret (`secret.StoreSecret`): an id is the caller's own (an HMAC of the
caller's scope, `vit_serve.serve.caller`, and the upload's sha256), and an image is kept under a slot made from
the scope and the id, so that another API key's id is a 404, a repeated upload is a store hit only for the caller
who sent it first, and the store's keys name neither images nor callers. What Redis keeps is sealed (an HMAC over
the key and the bytes); an entry whose seal fails is ignored and counted (`vit_serve_store_rejected_total`).

A store is used from the decode threads (`get` / `put`) and for `GET /explain?id=` (`find`). A store that cannot
be reached never fails a classification: `put` logs a warning, `get` is a miss (the upload is decoded again);
`find` raises `StoreUnavailableError`, a 503 naming the store, since the image may well be there.

Modules:

- `base`: the store protocol (`CropStore`), `Namespaced`, `StoreUnavailableError`.
- `memory`: `MemoryStore`, this process's memory.
- `redis`: `RedisStore`, a Redis server shared by the replicas (entries sealed).
- `secret`: `StoreSecret`, the ids' and keys' secret.
- `redaction`: store URLs with their passwords hidden, for logs and errors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from vit_serve.runtime.password_file import read_password_file
from vit_serve.serve.stores.base import CropStore, Namespaced, StoreUnavailableError
from vit_serve.serve.stores.redaction import redacted, url_has_password
from vit_serve.serve.stores.secret import StoreSecret

if TYPE_CHECKING:
    from vit_serve.serve.settings import ServeSettings, StoreSettings

__all__ = ["REDIS_SCHEMES", "CropStore", "Namespaced", "StoreUnavailableError", "open_store", "redacted",
           "url_has_password"]

log = logging.getLogger("vit_serve.serve")

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def _rejected_default() -> None:
    """No counter (a store used on its own, e.g. in tests of the store)."""


def open_store(settings: StoreSettings | ServeSettings, rejected: Callable[[], None] = _rejected_default,
               shared_secret: bool = False) -> CropStore:
    """The store `settings.store` names, bounded by `store_size` and `store_ttl_s`, with the settings' store
    secret; `rejected` is called for each entry whose seal fails; `shared_secret`: a secret made by this process
    is carried to the other replicas (Ray Serve), so no warning that they cannot share it. A ServeSettings is
    taken for its `explain_store` group (and its engine: ray shares the secret). ValueError (one line) for a name
    that is neither `memory` nor a Redis URL, a Redis URL without the `redis` package, a secret or password file
    that cannot be read. Nothing is connected here: a Redis that is down at start-up is reported by the first
    request that needs it."""
    from vit_serve.serve.settings import ServeSettings  # here: the settings import this package's modules

    if isinstance(settings, ServeSettings):
        settings, shared_secret = settings.explain_store, shared_secret or settings.engine == "ray"
    name = settings.store.strip()
    secret = StoreSecret.from_settings(settings)
    if name == "memory":
        from vit_serve.serve.stores.memory import MemoryStore

        return MemoryStore(settings.store_size, settings.store_ttl_s, secret)
    if name.startswith(REDIS_SCHEMES):
        try:
            from vit_serve.serve.stores.redis import RedisStore
        except ImportError as e:
            raise ValueError(f"--store {name.split('://')[0]}://...: the redis package is not installed "
                             f"(pip install 'vit-serve[serve]'): {e}") from None
        password = _password(settings, name)
        if settings.store_secret_generated and not shared_secret:
            log.warning("image store %s: no VIT_SERVE_STORE_SECRET_FILE or VIT_SERVE_STORE_SECRET, so explain ids "
                        "are made with a secret of this process: other replicas cannot explain the images this "
                        "one classified (GET /explain?id= is 404 there); give every replica the same secret file",
                        redacted(name))
        return RedisStore(name, settings.store_size, settings.store_ttl_s, secret, password=password,
                          rejected=rejected)
    raise ValueError(f"--store / VIT_SERVE_STORE must be 'memory' or a Redis URL (redis://HOST:PORT/DB, "
                     f"rediss://..., unix://...), not {redacted(name)!r}")


def _password(settings: StoreSettings, url: str) -> str | None:
    """The Redis password of `store_password_file` (a Secret mount: one trailing newline dropped), or None."""
    path = settings.store_password_file
    if not path:
        return None
    if url_has_password(url):
        raise ValueError(f"--store-password-file / VIT_SERVE_STORE_PASSWORD_FILE is given and --store "
                         f"{redacted(url)} has a password too: give it one way (store_password_file)")
    return read_password_file(path, "--store-password-file / VIT_SERVE_STORE_PASSWORD_FILE")
