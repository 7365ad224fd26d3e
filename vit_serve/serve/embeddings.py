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
from typing import TypeVar

import numpy as np

from vit_serve.manifest import EMBEDDING
from vit_serve.runtime.errors import ModelTimeoutError, QueueFullError
from vit_serve.runtime.task import PATCH_TOKENS, Task
from vit_serve.serve import image_urls
from vit_serve.serve.admission import Admission, deadline_exceeded
from vit_serve.serve.deps import ModelChoice
from vit_serve.serve.errors import BadRequestError, RateLimitedError, TooLargeError
from vit_serve.serve.image_urls import UrlPolicy
from vit_serve.serve.model_version import ModelVersion
from vit_serve.serve.openai_schema import InputError, Item
from vit_serve.serve.rate_limit import RateLimits
from vit_serve.serve.v2_protocol import IMAGES_SETTING

T = TypeVar("T")

# A text item's UTF-8 bytes per token of the tower's context length, at most: beyond, it cannot fit (and is not
# tokenized on the event loop to find out).
BYTES_PER_TOKEN = 64
URLS_OFF = ("image URLs are not enabled on this server (image_url_hosts): send the image as a data:image/...;base64, "
            "URI")
FETCHES_AT_ONCE = 4  # image URLs of one request fetched at a time


class InputRefusedError(BadRequestError):
    """A 400 naming the item at fault (`param`: OpenAI's error field)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Embedded:
    """A request answered: by which version, its vectors [n, D] (normalised; D: `dimensions` when asked), the
    tokens it counts (text tokens + image patches) and the fingerprint of the space its vectors are in (texts and
    images alike: `vit_serve.fingerprint`; None: unknown)."""

    model: str
    version: str
    vectors: np.ndarray
    prompt_tokens: int
    fingerprint: str | None = None
    patch_tokens: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)  # item -> [gh * gw, D]
    layer: int | None = None  # the block they come from (tokens=patch)
    grid: tuple[int, int] | None = None  # and the patch grid


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


async def fetched(items: list[Item], policy: UrlPolicy, max_bytes: int) -> list[Item]:
    """The items, each image URL replaced by the image it names, fetched under `policy` (`image_urls`: the hosts,
    the SSRF guard, the size cap, the timeout), `FETCHES_AT_ONCE` at a time and at most `max_bytes` in all (413
    beyond: as if they had been sent in the body); unchanged when the policy fetches nothing (`check_items` then
    refuses them)."""
    urls = [i for i, it in enumerate(items) if it.url is not None]
    if not urls or not policy.on:
        return items
    gate, total = asyncio.Semaphore(FETCHES_AT_ONCE), 0

    async def one(i: int) -> bytes:
        nonlocal total
        param = _param(items, i)
        async with gate:
            try:
                data = await image_urls.fetch(items[i].url or "", policy, param)
            except image_urls.UrlRefusedError as e:
                raise InputRefusedError(str(e), param) from None
        total += len(data)
        if total > max_bytes:
            raise TooLargeError(f"{param}: the images fetched for this request are over {max_bytes} bytes in all "
                                f"(max_body_bytes)")
        return data

    found = dict(zip(urls, await _all([one(i) for i in urls]), strict=True))
    return [Item(image=found[i]) if i in found else it for i, it in enumerate(items)]


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


def _task(mv: ModelVersion, images: int, layer: int | None, max_floats: int) -> Task | None:
    """The images' task: /embed's, or with `layer` its patch tokens too (`max_floats` for them all)."""
    if not images:
        return None
    if layer is None:
        return dataclasses.replace(mv.embed_task(), max_patches=mv.patch_budget(None))
    if mv.patch_budget(None) is not None:
        raise InputRefusedError(f"tokens=patch: {mv.name} is a NaFlex model, whose patch tokens are not served",
                                "tokens")
    return mv.patch_tokens_task(layer, max_floats // images)


async def embed_items(choice: ModelChoice, admission: Admission, items: list[Item], dimensions: int | None,
                      limits: RateLimits | None = None, scope: str = "", layer: int | None = None,
                      max_floats: int = 0) -> Embedded:
    """`items` through the version `choice` names (the module's order): their vectors in input order, normalised
    (and truncated to `dimensions`, renormalised); with `layer`, each image's patch tokens of that block too (at
    most `max_floats` floats in all)."""
    with choice.use() as mv:
        own = mv.runner.limits
        tokens = check_items(mv, items, dimensions, own.max_images_per_request or own.max_batch)
        images = [i for i, it in enumerate(items) if it.image is not None]
        task = _task(mv, len(images), layer, max_floats)
        admission.check(mv)
        if task is not None:
            mv.runner.check_arrival(task, admission)
        charge(limits, scope, len(items))
        gate = asyncio.Semaphore(max(2, choice.gateway.settings.decode_workers))
        jobs: list[Awaitable[dict[str, np.ndarray] | np.ndarray]] = [_image(mv, task, items[i].image, admission, gate)  # type: ignore[arg-type]
                                             for i in images]
        texts = [i for i, it in enumerate(items) if it.text is not None]
        if texts:
            jobs.append(encode_texts(mv, [items[i].text for i in texts], admission))  # type: ignore[misc]
        done = await _all(jobs)
        rows: list[np.ndarray | None] = [None] * len(items)
        for i, outputs in zip(images, done, strict=False):
            rows[i] = outputs[EMBEDDING][0]
        if texts:
            for i, vector in zip(texts, done[-1], strict=True):
                rows[i] = vector
        patches = _patches(mv, task) * len(images)
        found = {i: outputs[PATCH_TOKENS][0] for i, outputs in zip(images, done, strict=False)
                 if PATCH_TOKENS in outputs}
        return Embedded(mv.name, str(mv.version), _normalised(np.stack(rows), dimensions), sum(tokens) + patches,
                        mv.info.embedding_fingerprint(True, dimensions), found,
                        task.layer if task is not None else None, mv.info.grid if found else None)


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


async def _all(jobs: list[Awaitable[T]]) -> list[T]:
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
                 ) -> dict[str, np.ndarray]:
    """One image through `mv` as POST /embed runs it: its own arrival, decoded, queued and batched; its outputs
    (embedding [1, E], and patch_tokens [1, gh * gw, D] with tokens=patch)."""
    with mv.arriving(admission.priority) as arrival:
        async with gate:
            admission.at("decode", mv)
            decoded = await (mv.decode(data, keep=False) if task.max_patches is None else
                             mv.decoder.decode_naflex(data, task.max_patches))
        result = await mv.infer(task, decoded.x, arrival, admission)
    if mv.monitor is not None:
        mv.monitor.observe(result.outputs)  # the drift window, as /embed's
    return result.outputs


async def encode_texts(mv: ModelVersion, texts: list[str], admission: Admission) -> np.ndarray:
    """The texts (checked by `check_items`) through the text tower's thread under the request's level and deadline;
    [n, E], not normalised."""
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
