"""Retrieval embeddings of a request's texts and images in one space, L2-normalised: the one code path of the
routes that serve them to vector databases and their clients (Weaviate's /weaviate/.../vectorize, POST
/v1/embeddings), so that they answer the same vectors for the same inputs.

- Images go through the pipeline as POST /embed's do (`pipeline.answer`, one arrival each: the batcher batches them
  with everyone else's), their embedding normalised: the image tower's projected embedding, as open_clip's
  `encode_image` normalised.
- Texts go through the version's text tower (`runtime.text_tower.TextTower.submit_texts`: its thread and bounded
  queue, a chunk at a time, the request's level and deadline), normalised: open_clip's `encode_text` normalised. A
  text that does not fit the tower's context length is a 400, not truncated.
- One version answers every item of a request (a traffic split draws once), so that its vectors share a space.
- The items are bounded (`max_embedding_inputs`, 400 beyond); each beyond the first counts in the key's rate.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from starlette.requests import Request

from vit_serve.runtime.errors import ModelTimeoutError, QueueFullError
from vit_serve.serve import pipeline
from vit_serve.serve.admission import Admission, deadline_exceeded
from vit_serve.serve.deps import ModelChoice
from vit_serve.serve.errors import BadImageError, BadRequestError
from vit_serve.serve.labels import LabelCaller
from vit_serve.serve.model_version import ModelVersion
from vit_serve.serve.uploads import Upload

DATA_URI = re.compile(r"^data:image/[A-Za-z0-9.+-]+;base64,", re.IGNORECASE)


@dataclass(frozen=True)
class Embedded:
    """A request's vectors: the model and version that made them, the texts' [n, E] and the images' [m, E]
    (float32, L2-normalised, in the request's order; [0, E] when it had none)."""

    model: str
    version: str
    texts: np.ndarray
    images: np.ndarray


def image_bytes(value: str, what: str) -> bytes:
    """The bytes of a base64 image (standard alphabet, or a `data:image/...;base64,` URI); 400 naming `what`."""
    found = DATA_URI.match(value)
    data = value[found.end():] if found else value
    try:
        raw = base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError):
        raise BadRequestError(f"{what} is not base64 (an image's bytes in base64, or a data:image/...;base64, "
                              f"URI)") from None
    if not raw:
        raise BadImageError(f"{what} is empty")
    return raw


def check_count(n: int, limit: int) -> None:
    """400 when a request holds more than `limit` items (`max_embedding_inputs`)."""
    if n > limit:
        raise BadRequestError(f"{n} texts and images in one request, over the limit of {limit} "
                              f"(max_embedding_inputs)")


async def embed(request: Request, choice: ModelChoice, scope: str, admission: Admission, texts: Sequence[str],
                images: Sequence[bytes]) -> Embedded:
    """The request's texts and images through the one version `choice` names now (held until done): the texts in
    its text tower's thread and each image through the pipeline, all at once; the first error cancels the rest."""
    check_count(len(texts) + len(images), choice.gateway.settings.max_embedding_inputs)
    with choice.use() as mv:
        LabelCaller.of(request.app, scope).charge(len(texts) + len(images))  # the request itself took one
        pinned = ModelChoice(choice.gateway, mv.name, mv.version, choice.session)
        try:
            async with asyncio.TaskGroup() as tasks:
                text_task = tasks.create_task(text_vectors(mv, list(texts), admission)) if texts else None
                image_tasks = [tasks.create_task(_image_vector(request, pinned, scope, admission, data))
                               for data in images]
        except BaseExceptionGroup as group:  # the first error is the answer (the others were cancelled by it)
            raise _first(group) from None
        dim = mv.info.embedding_dim or (mv.text.manifest.embedding_dim if mv.text is not None else 0)
        text_out = text_task.result() if text_task is not None else np.zeros((0, dim), np.float32)
        image_out = (np.stack([t.result() for t in image_tasks]) if image_tasks
                     else np.zeros((0, dim), np.float32))
        return Embedded(mv.name, str(mv.version), text_out, image_out)


def _first(group: BaseExceptionGroup) -> BaseException:
    """The first error of a task group's, its own groups opened."""
    first = group.exceptions[0]
    return _first(first) if isinstance(first, BaseExceptionGroup) else first


async def _image_vector(request: Request, choice: ModelChoice, scope: str, admission: Admission,
                        data: bytes) -> np.ndarray:
    """One image's normalised embedding [E], as POST /embed?normalize=true answers it."""
    upload = Upload(data, hashlib.sha256(data).hexdigest())

    async def read() -> Upload:
        return upload

    done = await pipeline.answer(request, choice, scope, admission, pipeline.Ask("embed", normalize=True),
                                 read=read)
    assert done.answer.embedding is not None
    return np.asarray(done.answer.embedding, np.float32)


def text_tower_of(mv: ModelVersion):
    """The version's text tower, or 400 saying why it has none (or why its space is not the images')."""
    text = mv.text
    if text is None:
        why = (f"its text tower could not be loaded ({mv.text_error})" if mv.text_error else
               "it has no text tower (vit-export --text-tower writes NAME_text.onnx beside NAME.onnx; a CLIP or "
               "SigLIP checkpoint converted with vit-serve convert keeps its own)")
        raise BadRequestError(f"{mv.name} cannot embed texts: {why}")
    if mv.info.embedding_dim and mv.info.embedding_dim != text.manifest.embedding_dim:
        raise BadRequestError(f"{mv.name} cannot embed texts in its images' space: its image embedding has "
                              f"{mv.info.embedding_dim} dimensions, its text tower's {text.manifest.embedding_dim}")
    return text


async def text_vectors(mv: ModelVersion, texts: list[str], admission: Admission | None = None) -> np.ndarray:
    """Texts -> [n, E] float32, L2-normalised, in the version's text tower thread under the request's level and
    deadline (`admission`): 503 when its queue is full, 504 when the deadline passes, 400 for a text that does not
    fit the tower's context length (or has a word too long for its BPE)."""
    text = text_tower_of(mv)
    if admission is not None:
        admission.check(mv, "before its texts were encoded")
    priority = 1 if admission is None else admission.priority
    try:
        future = text.submit_texts(texts, priority, None if admission is None else admission.deadline)
    except QueueFullError:
        mv.metrics.rejected("queue_full").inc()
        raise
    left = None if admission is None else admission.remaining()
    t0 = time.perf_counter()
    try:  # cancelled with the request (a hang-up, its deadline): its chunks not run are skipped
        return await asyncio.wait_for(asyncio.wrap_future(future), None if left is None else max(left, 0.0))
    except (ModelTimeoutError, TimeoutError):
        mv.metrics.rejected("deadline").inc()
        raise deadline_exceeded(f"while its texts were encoded, {(time.perf_counter() - t0) * 1e3:.0f} ms "
                                f"in") from None
    except ValueError as e:  # TextTooLongError: refused, never truncated
        raise BadRequestError(f"texts: {e}") from None
