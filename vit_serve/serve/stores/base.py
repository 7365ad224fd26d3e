"""What every store is: the `CropStore` protocol, a store seen through a namespace (`Namespaced`), and the error
of a store that cannot answer (`StoreUnavailableError`)."""

from __future__ import annotations

from typing import Protocol

from PIL import Image

from vit_serve.serve.errors import GatewayError
from vit_serve.serve.stores.secret import StoreSecret


class StoreUnavailableError(GatewayError):
    """The store could not be asked (e.g. Redis is down): 503, since the image may well be there."""

    status = 503


class CropStore(Protocol):
    """Crops by key; `secret` makes the ids and keys (`secret.StoreSecret`)."""

    secret: StoreSecret

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
    """A store seen through a namespace (keys "slot:namespace"): one preprocessing contract's crops."""

    def __init__(self, store: CropStore, namespace: str) -> None:
        self._store, self.namespace = store, namespace

    def get(self, key: str) -> Image.Image | None:
        return self._store.get(f"{key}:{self.namespace}")

    def find(self, key: str) -> Image.Image | None:
        return self._store.find(f"{key}:{self.namespace}")

    def put(self, key: str, crop: Image.Image) -> None:
        self._store.put(f"{key}:{self.namespace}", crop)
