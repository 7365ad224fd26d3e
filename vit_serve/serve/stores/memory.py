"""The in-process store (the default): this process's memory, so each replica knows only its own images.

Bounded by count (least recently used first out) and by age; safe to use from several threads. Nothing can fail,
so `find` is `get`. The crops never leave the process, so they are not sealed (nothing else can write them); the
ids and slots are the secret's, as with Redis.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from PIL import Image

from vit_serve.serve.stores.secret import StoreSecret


class MemoryStore:
    """id -> crop, at most `size` entries, each for `ttl_s` seconds after it was last stored or read."""

    def __init__(self, size: int, ttl_s: float, secret: StoreSecret) -> None:
        self.size = size
        self.ttl_s = ttl_s
        self.secret = secret
        self._items: OrderedDict[str, tuple[float, Image.Image]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def close(self) -> None:
        """Nothing to release: the crops go with the process."""

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

    find = get

    def _expire(self, now: float) -> None:
        # Entries are ordered by last use, and so by expiry time: expired ones are at the front.
        while self._items:
            key, (expires, _) = next(iter(self._items.items()))
            if expires > now:
                break
            del self._items[key]
