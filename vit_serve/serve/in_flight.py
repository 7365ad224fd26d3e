"""The per-key cap on requests in flight (`max_concurrent_per_key`): how many requests of one verified key this
replica works on at once, so that one tenant's burst of slow requests cannot hold every connection and queue
slot. Beyond it a request is refused at once (HTTP 429 with `Retry-After`, gRPC RESOURCE_EXHAUSTED), before its
body is read; the count is per replica, as the rate limits are.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

RETRY_AFTER_S = 1  # a slot frees as soon as one of the key's requests is answered


@dataclass
class InFlight:
    """Requests in flight by key hash, at most `cap` each (0: no cap). `enter` / `leave` are atomic under a lock,
    so that the event loop and grpcio's threads may share one count."""

    cap: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def enter(self, hashed: str) -> bool:
        """Count a request of the key `hashed` in (True), or refuse it (False: `cap` already in flight)."""
        with self._lock:
            if self.cap and self.counts[hashed] >= self.cap:
                return False
            self.counts[hashed] += 1
            return True

    def leave(self, hashed: str) -> None:
        """A request `enter` let in is answered (or gone)."""
        with self._lock:
            self.counts[hashed] -= 1
            if self.counts[hashed] <= 0:
                del self.counts[hashed]

    def message(self) -> str:
        """The refusal's one line."""
        return (f"this API key already has {self.cap} requests in flight, the most one key may have at once on "
                f"this replica (max_concurrent_per_key): retry once one is answered")
