"""A request's labels (POST /classify?labels=, the /v2 and gRPC `labels` parameter) on a version served with its text
tower: parsed within the gateway's limits and the tokenizer's context length (`parse_labels`, 400 beyond), then encoded
as the request's own work (`encode_labels`):

- the label cache is the caller's: keyed by its scope (`caller.caller_scope`, the hash of its verified key), so
  neither `Server-Timing: text` nor `vit_serve_label_cache_total` shows one caller another's cache hit;
- the prompts the text tower encodes (labels not cached x templates) count in the key's rate, one per prompt
  beyond the request itself (`LabelCaller.charge`; the bucket may go below zero: the key then waits);
- the text tower's thread runs them a chunk at a time (`runtime.text_tower`), most urgent level first; its queue
  is bounded (503 + Retry-After when full), a deadline that passes during the encoding is the image path's 504,
  and a client that hangs up cancels the chunks not yet run.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from vit_serve.runtime.errors import ModelTimeoutError, QueueFullError
from vit_serve.runtime.text_tower import SHARED_SCOPE, TextTower
from vit_serve.runtime.zero_shot import LabelLimits
from vit_serve.serve.admission import Admission, deadline_exceeded
from vit_serve.serve.errors import BadRequestError, RateLimitedError
from vit_serve.serve.metrics import ModelMetrics
from vit_serve.serve.rate_limit import RateLimits


class LabelVersion(Protocol):
    """What of a loaded version (`model_version.ModelVersion`) its requests with labels use."""

    text: TextTower | None
    label_limits: LabelLimits
    metrics: ModelMetrics


@dataclass(frozen=True)
class LabelCaller:
    """Who asks for labels: the cache scope (`caller.caller_scope`: its key's hash, or the shared scope without
    keys) and the keys' rate buckets its prompts are charged to (None: no rates)."""

    scope: str = SHARED_SCOPE
    limits: RateLimits | None = None

    @classmethod
    def of(cls, app: Any, scope: str) -> LabelCaller:
        """The caller of an HTTP request to `app` (its keys' rate buckets: `app.state.keyring`) in `scope`."""
        ring = getattr(app.state, "keyring", None)
        return cls(scope, None if ring is None else ring.limits)

    def charge(self, prompts: int) -> None:
        """Charge `prompts` encodings to the key's bucket (the request itself took one); 429 when the key's
        bucket is already below zero."""
        if self.limits is None or prompts <= 1:
            return
        verdict = self.limits.take(self.scope, cost=prompts - 1, need=0)
        if verdict is not None and not verdict.allowed:
            raise RateLimitedError(f"this API key's rate limit is spent by the prompts of its requests with labels "
                                   f"({verdict.rate.per_s:g} requests/s, one per prompt): retry in "
                                   f"{verdict.retry_after_s} s", {"Retry-After": str(verdict.retry_after_s)})


def parse_labels(mv: LabelVersion, value: str | list[str], what: str = "labels") -> list[str]:
    """A request's labels within the gateway's limits (count, UTF-8 bytes, labels x templates) and the text
    tower's tokenizer (tokens within its context length, words within its BPE limit); 400 naming `what`."""
    text = mv.text
    try:
        labels = mv.label_limits.parse(value, 1 if text is None else len(text.templates))
        if text is not None:
            text.check_labels(labels)
    except ValueError as e:
        raise BadRequestError(f"{what}: {e}") from None
    return labels


async def encode_labels(mv: LabelVersion, labels: list[str], image_embeds: np.ndarray,
                       admission: Admission | None = None, caller: LabelCaller | None = None
                       ) -> tuple[np.ndarray, float]:
    """Image embeddings [B, E] -> (zero-shot logits [B, n] over `labels`, ms spent): the caller's cached labels,
    the others encoded in the text tower's thread under the request's level and deadline (`admission`)."""
    text = mv.text
    assert text is not None  # `zero_shot_task` checked it
    caller = caller or LabelCaller()
    t0 = time.perf_counter()
    job = text.plan(labels, caller.scope)
    if job.todo:
        if admission is not None:
            admission.check(mv, "before its labels were encoded")
        caller.charge(job.prompts)
        priority = 1 if admission is None else admission.priority
        try:
            future = text.submit(job, priority, None if admission is None else admission.deadline)
        except QueueFullError:
            mv.metrics.rejected("queue_full").inc()
            raise
        left = None if admission is None else admission.remaining()
        try:  # cancelled with the request (a hang-up, its deadline): its chunks not run are skipped
            classes = await asyncio.wait_for(asyncio.wrap_future(future), None if left is None else max(left, 0.0))
        except (ModelTimeoutError, TimeoutError):
            mv.metrics.rejected("deadline").inc()
            late = -(admission.remaining() or 0.0) if admission is not None else 0.0
            raise deadline_exceeded(f"while its labels were encoded, {late * 1e3:.0f} ms after it") from None
        except ValueError as e:  # a prompt the tokenizer would truncate
            raise BadRequestError(f"labels: {e}") from None
    else:
        classes = np.stack([job.found[label] for label in labels])
    logits = text.logits(image_embeds, classes)
    mv.metrics.label_cache("hit").inc(job.hits)
    mv.metrics.label_cache("miss").inc(job.misses)
    return logits, (time.perf_counter() - t0) * 1e3
