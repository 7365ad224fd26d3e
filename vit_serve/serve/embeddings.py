"""One POST /v1/embeddings request through a model version: its items (`openai_schema.Item`: texts and images, mixed)
-> L2-normalised vectors in the model's joint space, and the usage they count.

The version is chosen once the body is read (the model is named in it) and held for the whole request. Each image
is one arrival in the version's batcher, decoded by its contract and run as POST /embed runs it (the same task,
deadline, priority and queue, at most the decode window decoding at once), all of the request's images at once,
so that the batcher batches them with each other and with other requests; a batch never changes a row's vector.
The texts go to the text tower's thread as one job (`TextTower.submit_texts`), a chunk at a time under the
request's level and deadline, as a request's labels do. The first item that fails cancels the others. Bounds: at
most the version's images per request (`max_images_per_request`, by default its max_batch) items, each text within
the tower's context length; every item beyond the first counts in the key's rate, as a label's prompts do.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable
from dataclasses import dataclass

import numpy as np

from vit_serve.manifest import EMBEDDING
from vit_serve.runtime.errors import ModelTimeoutError, QueueFullError
from vit_serve.runtime.task import Task
from vit_serve.serve.admission import Admission, deadline_exceeded
from vit_serve.serve.deps import ModelChoice
from vit_serve.serve.errors import BadRequestError, RateLimitedError
from vit_serve.serve.model_version import ModelVersion
from vit_serve.serve.openai_schema import InputError, Item
from vit_serve.serve.rate_limit import RateLimits
from vit_serve.serve.v2_protocol import IMAGES_SETTING

# A text item's UTF-8 bytes per token of the tower's context length, at most: beyond, it cannot fit (and is not
# tokenized on the event loop to find out).
BYTES_PER_TOKEN = 64
URLS_OFF = "image URLs are not enabled on this server: send the image as a data:image/...;base64, URI"


class InputRefusedError(BadRequestError):
    """A 400 naming the item at fault (`param`: OpenAI's error field)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Embedded:
    """A request answered: by which version, its vectors [n, D] (normalised; D: `dimensions` when asked), and
    the tokens it counts (text tokens + image patches)."""

    model: str
    version: str
    vectors: np.ndarray
    prompt_tokens: int


def _param(items: list[Item], i: int) -> str:
    return "input" if len(items) == 1 else f"input[{i}]"


def check_items(mv: ModelVersion, items: list[Item], dimensions: int | None, max_items: int) -> list[int]:
    """400 for what `mv` cannot do with `items` (too many, a text without a text tower, an image URL, a text over
    the context length, `dimensions` without Matryoshka training); each text's token count."""
    if len(items) > max_items:
        raise InputRefusedError(f"{len(items)} items in one request, over the limit of {max_items} ({IMAGES_SETTING}, "
                           f"--max-images-per-request; by default the model's max_batch)", "input")
    if any(it.url is not None for it in items):
        raise InputRefusedError(URLS_OFF, _param(items, next(i for i, it in enumerate(items) if it.url)))
    if any(it.image is not None for it in items):
        mv.embed_task()
    texts = [(i, it.text) for i, it in enumerate(items) if it.text is not None]
    tokens = []
    if texts:
        text = mv.text
        if text is None:
            why = f"its text tower could not be loaded ({mv.text_error})" if mv.text_error else (
                "it has no text tower (vit-export --text-tower writes NAME_text.onnx beside NAME.onnx; a CLIP or "
                "SigLIP checkpoint converted by vit-serve convert keeps its own)")
            raise InputRefusedError(f"{mv.name} cannot embed text: {why}", _param(items, texts[0][0]))
        if mv.info.embedding_dim != text.manifest.embedding_dim:
            raise InputRefusedError(f"{mv.name} cannot embed text: its image embedding has "
                                    f"{mv.info.embedding_dim or 'no'} dimensions, its text tower's "
                                    f"{text.manifest.embedding_dim}: they are not one space")
        ctx = text.tokenizer.context_length
        for i, value in texts:
            tokens.append(_tokens(text, value, ctx, _param(items, i)))
    _check_dimensions(mv, dimensions)
    return tokens


def _tokens(text, value: str, ctx: int, param: str) -> int:
    from vit_serve.text.tokenizer import TextTooLongError

    try:
        if len(value.encode("utf-8")) > ctx * BYTES_PER_TOKEN:
            raise TextTooLongError(f"{value[:24]!r}... is over {ctx * BYTES_PER_TOKEN} UTF-8 bytes")
        return text.count_tokens(value)
    except TextTooLongError as e:
        raise InputRefusedError(f"{param}: {e} (the text tower's context length is {ctx} tokens)", param) from None
    except UnicodeEncodeError:
        raise InputRefusedError(f"{param}: not valid Unicode text", param) from None


def _check_dimensions(mv: ModelVersion, dimensions: int | None) -> None:
    if dimensions is None:
        return
    embedding = mv.info.embedding
    trained = embedding.matryoshka_dims if embedding is not None else None
    dim = mv.info.embedding_dim or (mv.text.manifest.embedding_dim if mv.text is not None else 0)
    if not trained:
        raise InputRefusedError(f"dimensions: {mv.name} was not trained for truncated (Matryoshka) embeddings, so its "
                           f"vectors keep all {dim} dimensions (its manifest declares no embedding.matryoshka_dims); "
                           f"omit dimensions", "dimensions")
    if not min(trained) <= dimensions <= dim:
        raise InputRefusedError(f"dimensions must be from {min(trained)} to {dim} ({mv.name}'s Matryoshka training: "
                           f"{', '.join(map(str, trained))}), got {dimensions}", "dimensions")


def charge(limits: RateLimits | None, scope: str, items: int) -> None:
    """Charge the items beyond the first to the key's bucket (the request itself took one); 429 when the bucket is
    already below zero."""
    if limits is None or items <= 1:
        return
    verdict = limits.take(scope, cost=items - 1, need=0)
    if verdict is not None and not verdict.allowed:
        raise RateLimitedError(f"this API key's rate limit is spent by the items of its embedding requests "
                               f"({verdict.rate.per_s:g} requests/s, one per item): retry in "
                               f"{verdict.retry_after_s} s", {"Retry-After": str(verdict.retry_after_s)})


async def embed_items(choice: ModelChoice, admission: Admission, items: list[Item], dimensions: int | None,
                      limits: RateLimits | None = None, scope: str = "") -> Embedded:
    """`items` through the version `choice` names (the module's order): their vectors in input order, normalised
    (and truncated to `dimensions`, renormalised)."""
    with choice.use() as mv:
        own = mv.runner.limits
        tokens = check_items(mv, items, dimensions, own.max_images_per_request or own.max_batch)
        images = [i for i, it in enumerate(items) if it.image is not None]
        task = dataclasses.replace(mv.embed_task(), max_patches=mv.patch_budget(None)) if images else None
        admission.check(mv)
        if task is not None:
            mv.runner.check_arrival(task, admission)
        charge(limits, scope, len(items))
        gate = asyncio.Semaphore(max(2, choice.gateway.settings.decode_workers))
        jobs: list[Awaitable[np.ndarray]] = [_image(mv, task, items[i].image, admission, gate)  # type: ignore[arg-type]
                                             for i in images]
        texts = [i for i, it in enumerate(items) if it.text is not None]
        if texts:
            jobs.append(_texts(mv, [items[i].text for i in texts], admission))  # type: ignore[misc]
        done = await _all(jobs)
        rows: list[np.ndarray | None] = [None] * len(items)
        for i, vector in zip(images, done, strict=False):
            rows[i] = vector
        if texts:
            for i, vector in zip(texts, done[-1], strict=True):
                rows[i] = vector
        patches = _patches(mv, task) * len(images)
        return Embedded(mv.name, str(mv.version), _normalised(np.stack(rows), dimensions), sum(tokens) + patches)


def _patches(mv: ModelVersion, task: Task | None) -> int:
    """The patches one image is (a NaFlex model: its budget)."""
    if task is None:
        return 0
    if task.max_patches is not None:
        return task.max_patches
    gh, gw = mv.info.grid
    return gh * gw


def _normalised(vectors: np.ndarray, dimensions: int | None) -> np.ndarray:
    v = vectors.astype(np.float32, copy=False)
    if dimensions is not None:
        v = v[:, :dimensions]
    norms = np.linalg.norm(v.astype(np.float64), axis=1, keepdims=True)
    return (v / np.maximum(norms, 1e-12)).astype(np.float32)


async def _all(jobs: list[Awaitable[np.ndarray]]) -> list[np.ndarray]:
    """Every job's result in order; the first failure cancels the others and is raised."""
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _image(mv: ModelVersion, task: Task, data: bytes, admission: Admission, gate: asyncio.Semaphore
                 ) -> np.ndarray:
    """One image through `mv` as POST /embed runs it: its own arrival, decoded, queued and batched; [E]."""
    with mv.arriving(admission.priority) as arrival:
        async with gate:
            admission.at("decode", mv)
            decoded = await (mv.decode(data, keep=False) if task.max_patches is None else
                             mv.decoder.decode_naflex(data, task.max_patches))
        result = await mv.infer(task, decoded.x, arrival, admission)
    if mv.monitor is not None:
        mv.monitor.observe(result.outputs)  # the drift window, as /embed's
    return result.outputs[EMBEDDING][0]


async def _texts(mv: ModelVersion, texts: list[str], admission: Admission) -> np.ndarray:
    """The texts through the text tower's thread under the request's level and deadline; [n, E]."""
    text = mv.text
    assert text is not None  # `check_items` checked it
    try:
        future = text.submit_texts(texts, admission.priority, admission.deadline)
    except QueueFullError:
        mv.metrics.rejected("queue_full").inc()
        raise
    left = admission.remaining()
    try:  # cancelled with the request (a hang-up, its deadline): its chunks not run are skipped
        return await asyncio.wait_for(asyncio.wrap_future(future), None if left is None else max(left, 0.0))
    except (ModelTimeoutError, TimeoutError):
        mv.metrics.rejected("deadline").inc()
        late = -(admission.remaining() or 0.0)
        raise deadline_exceeded(f"while its texts were encoded, {late * 1e3:.0f} ms after it") from None


def refuse(error: InputError) -> InputRefusedError:
    """An input that is not one (`openai_schema.items_of`) as its 400."""
    return InputRefusedError(str(error), error.param)
