"""Recently classified images, by id (sha256 of the uploaded bytes), for `GET /explain?id=...`.

What is kept is the model-input crop (`vit_serve.preprocess.resize_and_crop` output, uint8 RGB, H x W x 3 bytes):
the input tensor is recomputed from it exactly with `vit_serve.preprocess.to_tensor`, and the PNG overlay is
drawn on it. Bounded by count (least recently used first out) and by age; safe to use from several threads.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Protocol

from PIL import Image


class ImageStore:
    """id -> crop, at most `size` entries, each for `ttl_s` seconds after it was last stored or read."""

    def __init__(self, size: int, ttl_s: float) -> None:
        self.size = size
        self.ttl_s = ttl_s
        self._items: OrderedDict[str, tuple[float, Image.Image]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, key: str, crop: Image.Image) -> None:
        if self.size == 0:
            return
        now = time.monotonic()
        with self._lock:
            self._items[key] = (now + self.ttl_s, crop)
            self._items.move_to_end(key)
            self._expire(now)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, key: str) -> Image.Image | None:
        """The crop, or None if unknown or expired (a hit renews its time)."""
        now = time.monotonic()
        with self._lock:
            entry = self._items.get(key)
            if entry is None:
                return None
            if entry[0] <= now:
                del self._items[key]
                return None
            self._items[key] = (now + self.ttl_s, entry[1])
            self._items.move_to_end(key)
            return entry[1]

    def _expire(self, now: float) -> None:
        # Entries are ordered by last use, and so by expiry time: expired ones are at the front.
        while self._items:
            key, (expires, _) = next(iter(self._items.items()))
            if expires > now:
                break
            del self._items[key]


class CropStore(Protocol):
    """What the decoder needs of a store: crops by key."""

    def get(self, key: str) -> Image.Image | None: ...

    def put(self, key: str, crop: Image.Image) -> None: ...


class Namespaced:
    """A store seen through a namespace (keys "key:namespace"): one preprocessing contract's crops."""

    def __init__(self, store: CropStore, namespace: str) -> None:
        self._store, self.namespace = store, namespace

    def get(self, key: str) -> Image.Image | None:
        return self._store.get(f"{key}:{self.namespace}")

    def put(self, key: str, crop: Image.Image) -> None:
        self._store.put(f"{key}:{self.namespace}", crop)
