"""Rate limits per API key: a token bucket per key (`TokenBucket`), its verdict as the IETF draft's headers
(`Verdict.headers`: draft-ietf-httpapi-ratelimit-headers' `RateLimit-Limit`, `-Remaining`, `-Reset`, `-Policy`),
and the per-key counters of /metrics (`KeyCounts`, labelled by the key's name, never by the key).

A bucket holds up to `burst` tokens and gains `rate` a second; each request takes one, and a request that finds
less than one is refused (HTTP 429 with `Retry-After`, gRPC RESOURCE_EXHAUSTED with `retry-after` metadata). A
request with labels also takes one per prompt its text tower encodes beyond the first, which may leave the bucket
below zero (`TokenBucket.take`'s `cost`): the key's next requests wait until it has refilled. A bucket starts
full. The headers: `RateLimit-Limit` is the burst (the requests a full bucket holds), `RateLimit-Remaining` the
whole tokens left, `RateLimit-Reset` the seconds (rounded up) until the bucket is full again, and
`RateLimit-Policy: R;w=1;burst=B`. Only the requests that run the model count (`security.rated`).
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

from prometheus_client import CollectorRegistry, Counter

EPSILON = 1e-9  # float slack: a bucket refilled to 1.9999999999 of 2 tokens is full


def _ceil(seconds: float) -> int:
    return max(0, math.ceil(seconds - EPSILON))


@dataclass(frozen=True)
class Rate:
    """A key's limit: `per_s` requests a second on average, up to `burst` at once."""

    per_s: float
    burst: int

    @property
    def policy(self) -> str:
        return f"{self.per_s:g};w=1;burst={self.burst}"


@dataclass(frozen=True)
class Verdict:
    """One request's outcome against its key's bucket."""

    allowed: bool
    rate: Rate
    remaining: int  # whole tokens left after this request
    reset_s: int  # seconds (rounded up) until the bucket is full again
    retry_after_s: int | None = None  # refused: seconds (rounded up) until a token is back

    def headers(self) -> list[tuple[str, str]]:
        """The draft's headers (and Retry-After when refused), names as HTTP writes them."""
        out = [("RateLimit-Limit", str(self.rate.burst)), ("RateLimit-Remaining", str(self.remaining)),
               ("RateLimit-Reset", str(self.reset_s)), ("RateLimit-Policy", self.rate.policy)]
        if self.retry_after_s is not None:
            out.insert(0, ("Retry-After", str(self.retry_after_s)))
        return out

    def message(self) -> str:
        """The refusal's one line."""
        return (f"this API key's rate limit is spent ({self.rate.per_s:g} requests/s, bursts of {self.rate.burst}): "
                f"retry in {self.retry_after_s} s")


class TokenBucket:
    """A token bucket on `clock` (seconds; monotonic by default). `take` is atomic under a lock, so that the event
    loop and grpcio's threads may share one bucket."""

    def __init__(self, rate: Rate, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.clock = rate, clock
        self.tokens = float(rate.burst)
        self.updated = clock()
        self._lock = threading.Lock()

    def take(self, cost: float = 1.0, need: float = 1.0) -> Verdict:
        """Take `cost` tokens if the bucket holds `need` (a request: one of one): the Verdict, with the numbers
        after this request. A cost above what the bucket holds leaves it below zero (the text stage of a request
        with labels charges its prompts so, `need` 0: the key's next requests wait until it has refilled)."""
        per_s, burst = self.rate.per_s, self.rate.burst
        with self._lock:
            now = self.clock()
            self.tokens = min(float(burst), self.tokens + max(0.0, now - self.updated) * per_s)
            self.updated = now
            allowed = self.tokens >= need - EPSILON
            if allowed:
                left = self.tokens - cost
                self.tokens = left if left < -EPSILON else max(0.0, left)
            tokens = self.tokens
        retry = None if allowed else max(1, _ceil((need - tokens) / per_s))
        return Verdict(allowed, self.rate, max(0, math.floor(tokens + EPSILON)), _ceil((burst - tokens) / per_s),
                       retry)


class RateLimits:
    """One bucket per key hash that has a rate (the keys file's `rate=` / `burst=`); the others are not limited."""

    def __init__(self, rates: Mapping[str, Rate] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.buckets = {h: TokenBucket(r, clock) for h, r in (rates or {}).items()}

    def take(self, hashed: str, cost: float = 1.0, need: float = 1.0) -> Verdict | None:
        """The verdict for a request of the key whose hash is `hashed` (None: the key has no limit); `cost` and
        `need` as `TokenBucket.take`."""
        bucket = self.buckets.get(hashed)
        return None if bucket is None else bucket.take(cost, need)


class KeyCounts:
    """`vit_serve_key_requests_total{key,result}`: the requests of each key (by name) that count against rates,
    result accepted or rate_limited. One per registry (`on`), shared by the HTTP and gRPC key checks."""

    _made: ClassVar[weakref.WeakKeyDictionary[CollectorRegistry, KeyCounts]] = weakref.WeakKeyDictionary()
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, registry: CollectorRegistry) -> None:
        self.counter = Counter("vit_serve_key_requests", "requests by API key name (never the key) that count "
                               "against rate limits: accepted, rate_limited or too_many_in_flight (429 / "
                               "RESOURCE_EXHAUSTED)",
                               ["key", "result"], registry=registry)

    @classmethod
    def on(cls, registry: CollectorRegistry) -> KeyCounts:
        with cls._lock:
            found = cls._made.get(registry)
            if found is None:
                found = cls._made[registry] = cls(registry)
            return found

    def count(self, name: str, allowed: bool) -> None:
        self.counter.labels(name, "accepted" if allowed else "rate_limited").inc()
