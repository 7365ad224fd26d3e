"""One request through a model, whichever route asked: the one call every image route makes (`answer`; `answer_kept`
for an image kept earlier, GET /explain?id=), and its seam for requests whose inputs are tensors already, the Open
Inference Protocol's over HTTP /v2 and gRPC alike (`answer_tensors`: the transport reads and parses, `v2_model` says
what the request asks of the version and shapes the answer's outputs).

In order: announce the request to the version that would answer (one repository lookup, one arrival: the batcher
may wait for it; 404 / 400 / 503 / 504 before the body is read), read the body, keep that version unless it left
service meanwhile (then, and only then, choose again), decode (kept for GET /explain), infer, and post-process the
outputs into one typed answer (`runtime.postprocess.Answer`). What the request asks of the version (`Ask`) is
resolved against it once (`Job`: the task, the parsed `?labels=`; `v2_model.Wanted` for tensors). The hooks run
after the answer is made, in order (`answer_hooks`: `Server-Timing`, the payload sampler); the access line is the
middleware's, for every request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import numpy as np
from PIL import Image
from starlette.requests import Request

from vit_serve.manifest import EMBEDDING, LOGITS, OOD_SCORE
from vit_serve.runtime import postprocess
from vit_serve.runtime.backends.base import ModelInfo
from vit_serve.runtime.decode import Decoded
from vit_serve.runtime.postprocess import Answer, Ood, Shape
from vit_serve.runtime.scheduling import Arrival, Result
from vit_serve.runtime.task import Task
from vit_serve.serve import v2_model
from vit_serve.serve.admission import Admission
from vit_serve.serve.deps import ModelChoice
from vit_serve.serve.errors import BadRequestError, NotFoundError
from vit_serve.serve.labels import LabelCaller
from vit_serve.serve.model_version import ModelVersion
from vit_serve.serve.slow_clients import body_clock
from vit_serve.serve.uploads import Upload, read_image
from vit_serve.serve.v2_protocol import InferRequest, RequestBounds


@dataclass(frozen=True)
class Explain:
    """A map asked for: the method and its settings (None: the model's or the exported graph's). similarity: the
    image's cosine with `query` (or the zero-shot head's class `target`) over its patches, times the rollout when
    `times_rollout`."""

    method: Literal["rollout", "grad_rollout", "similarity"] = "rollout"
    head_fusion: str | None = None
    discard_ratio: float | None = None
    target: int | None = None
    query: tuple[float, ...] | None = None
    times_rollout: bool = False


@dataclass(frozen=True)
class Overlay:
    """The map drawn over the model-input crop as a PNG (POST /explain?format=png), `size` pixels on its longer
    side (None: the crop's)."""

    alpha: float = 0.5
    colormap: str = "jet"
    size: int | None = None


@dataclass(frozen=True)
class Ask:
    """What a request asks of the model, as its route parsed it: classify (`top_k` classes, by the model's head
    or among `labels`, zero-shot), embed (`normalize`d or not) or explain (`explain`, with an `overlay` or as
    numbers). `explain` with kind classify: POST /classify?explain=true."""

    kind: Literal["classify", "embed", "explain"] = "classify"
    top_k: int = 5
    labels: str | None = None
    explain: Explain | None = None
    normalize: bool = False
    overlay: Overlay | None = None
    max_patches: int | None = None  # ?max_patches= (NaFlex models; None: the model's own budget)
    layer: int | None = None  # /embed?tokens=patch: the block whose patch tokens (None: no tokens asked)
    max_floats: int = 0  # ... within this many floats (the gateway's max_patch_token_floats)
    abstain: bool = False  # ?labels=&abstain=true: "none of these" below `threshold` (None: the reference's)
    threshold: float | None = None


@dataclass(frozen=True)
class Job:
    """An `Ask` resolved against the version that answers: its task, and the request's labels parsed within that
    version's limits and tokenizer (None: no labels)."""

    task: Task
    labels: list[str] | None = None
    abstain: tuple[float, str] | None = None  # the abstention's threshold and where it came from


def resolve(ask: Ask, mv: ModelVersion) -> Job:
    """The job `ask` is for `mv`, or 400 / 422 saying why `mv` cannot do it."""
    budget = mv.patch_budget(ask.max_patches)
    if ask.labels is not None:
        task = mv.zero_shot_task()
        abstain = mv.abstain_threshold(ask.threshold) if ask.abstain else None
        return Job(dataclasses.replace(task, max_patches=budget), mv.parse_labels(ask.labels), abstain)
    if ask.abstain:
        raise BadRequestError("abstain=true needs labels= (zero-shot classes to abstain among)")
    if ask.explain is not None:
        e = ask.explain
        if budget is not None and e.method != "rollout":
            raise BadRequestError(f"method={e.method}: {mv.name} is a NaFlex model, explained by method=rollout only")
        if e.method == "similarity":
            return Job(mv.similarity_task(e.query, e.target, (e.head_fusion, e.discard_ratio) if e.times_rollout
                                          else None))
        task = mv.explain_task(e.method, e.head_fusion, e.discard_ratio, e.target)
        return Job(dataclasses.replace(task, max_patches=budget))
    if ask.layer is not None:
        if budget is not None:
            raise BadRequestError(f"tokens=patch: {mv.name} is a NaFlex model, whose patch tokens are not served")
        return Job(mv.patch_tokens_task(ask.layer, ask.max_floats))
    task = mv.embed_task() if ask.kind == "embed" else mv.classify_task()
    return Job(dataclasses.replace(task, max_patches=budget))


@dataclass(frozen=True)
class Timings:
    """Where one request's time went (ms): reading its body, waiting for a decode thread, decoding, queueing,
    inferring, the labels' text work (None: no labels) and all of it; the size of its batch."""

    read: float
    decode_wait: float
    decode: float
    queue: float
    infer: float
    text: float | None
    total: float
    batch_size: int

    def timing_ms(self) -> dict[str, float]:
        """The answer's `timing_ms` (schemas.Timing)."""
        return {"decode": self.decode, "queue": self.queue, "infer": self.infer, "total": self.total,
                "batch_size": self.batch_size}

    def server_timing(self) -> str:
        """The `Server-Timing` header's value."""
        parts = [("read", self.read), ("decode_wait", self.decode_wait), ("decode", self.decode),
                 ("queue", self.queue), ("infer", self.infer)]
        if self.text is not None:
            parts.append(("text", self.text))
        return ", ".join(f"{name};dur={ms:.3f}" for name, ms in (*parts, ("total", self.total)))


@dataclass(frozen=True)
class Answered:
    """One request answered: by which version (`info`: its model), the image's id for the caller and its crop,
    what was asked and resolved, the typed answer, the PNG overlay when one was asked for, and the timings."""

    model: str
    version: str
    info: ModelInfo
    image_id: str
    crop: Image.Image
    ask: Ask
    job: Job
    answer: Answer
    overlay: bytes | None
    timings: Timings


B = TypeVar("B")  # a request's body, as its route reads it
Hook = Callable[[Answered], None]  # run after the answer is made (it only schedules work)


@dataclass(frozen=True)
class _Run:
    """What the held part of a request has so far: the version, the job, the arrival, when it began."""

    mv: ModelVersion
    job: Job | None
    arrival: Arrival
    t0: float


async def answer(request: Request, choice: ModelChoice, scope: str, admission: Admission, ask: Ask,
                 hooks: Sequence[Hook] = ()) -> Answered:
    """The request's image through the version `choice` names, as `ask` asks (the module's order), then `hooks`.
    `admission` follows it through (its stage, for a client that hangs up; its deadline and level, for the
    queue)."""
    t0 = time.perf_counter()
    job_of = functools.partial(resolve, ask)
    clock = body_clock(request.scope)
    arrived, job = await _announce_and_read(choice, job_of, clock, admission, lambda: read_image(request))
    t_read = time.perf_counter()
    run = _keep_or_choose_again(arrived, job, choice, admission, job_of, t0)
    with run.mv.using(), run.arrival:
        admission.at("decode", run.mv)
        decoded = await decode_kept(run.mv, arrived.body, scope, run.job.task.max_patches if run.job else None)
        t_decoded = time.perf_counter()
        done = await _infer_and_answer(request, scope, admission, ask, run, decoded)
    wait_ms = max(0.0, (t_decoded - t_read) * 1e3 - decoded.decode_ms)
    return _finish(done, dataclasses.replace(done.timings, read=(t_read - t0) * 1e3, decode_wait=wait_ms), hooks)


@dataclass(frozen=True)
class Arrived(Generic[B]):
    """A request whose body is read: the version it was announced to and its arrival, handed on (None when that
    version is gone or was closed meanwhile), and the body."""

    claimed: tuple[ModelVersion, Arrival] | None
    body: B


async def _announce_and_read(choice: ModelChoice, job_of: Callable[[ModelVersion], Job] | None, clock: Any,
                             admission: Admission, read: Callable[[], Awaitable[B]]) -> tuple[Arrived[B], Job | None]:
    """Choose the version that would answer (one lookup) and resolve the job for it (`job_of`: 400 now), announce
    the request to it, then read the body (`clock`: its `slow_clients.BodyClock`; None: it counts as coming until
    read). While the body is read only the announcement (weak) holds that version, so that an unload frees it.
    With a job: 504 before the body is read when the deadline has passed or the work ahead leaves no time for
    it."""
    mv = choice.choose()
    job = job_of(mv) if job_of is not None else None
    announced = mv.announce(admission.priority)
    try:
        announced.heard_from(clock)  # a stalled upload stops counting as coming
        admission.at("read", mv)
        if job is not None:
            admission.check(mv)  # a deadline past on arrival
            mv.runner.check_arrival(job.task, admission)  # or one the work ahead leaves no time for
        del mv
        body = await read()
    except BaseException:
        announced.done()
        raise
    return Arrived(announced.claim(), body), job


def _keep_or_choose_again(arrived: Arrived, job: Job | None, choice: ModelChoice, admission: Admission,
                          resolve_for: Callable[[ModelVersion], Job] | None, t0: float) -> _Run:
    """The version announced to, with its arrival, while it still serves; else the version chosen now, its job
    resolved again for it (`resolve_for`) and a new arrival."""
    claimed = arrived.claimed
    try:
        if claimed is not None and choice.still_serves(claimed[0]):
            return _Run(claimed[0], job, claimed[1], t0)
    except BaseException:
        claimed[1].done()  # type: ignore[index]
        raise
    if claimed is not None:
        claimed[1].done()
    mv = choice.again()
    return _Run(mv, resolve_for(mv) if resolve_for is not None else None, mv.arriving(admission.priority), t0)


async def answer_kept(mv: ModelVersion, scope: str, admission: Admission, ask: Ask, image_id: str,
                      hooks: Sequence[Hook] = ()) -> Answered:
    """The image the caller sent earlier (its crop kept under `image_id`) through `mv` (held by the caller), as
    `ask` asks; 404 when it is not kept (any more)."""
    t0 = time.perf_counter()
    job = resolve(ask, mv)
    if job.task.max_patches is not None:
        raise BadRequestError(f"{mv.name} is a NaFlex model: its images are not kept, so GET /explain?id= has none "
                              f"to explain; POST /explain?max_patches= the image")
    slot = mv.decoder.secret.slot(scope, image_id)  # the caller's own: another key's id names another slot
    crop = await asyncio.get_running_loop().run_in_executor(mv.decoder.pool, mv.crop_of, slot)  # Redis: a round trip
    if crop is None:
        raise NotFoundError(f"no image with id {image_id} here for model {mv.name!r} (never sent to it, expired or "
                            f"evicted); send the image again with POST /explain (multipart field 'file' or a raw "
                            f"image/* body)")
    admission.check(mv)
    with mv.arriving(admission.priority) as arrival:
        admission.at("decode", mv)
        x = await mv.tensor_of(crop)
        done = await _infer_and_answer(None, scope, admission, ask, _Run(mv, job, arrival, t0),
                                       Decoded(image_id, crop, x, 0.0))
    return _finish(done, done.timings, hooks)


async def _infer_and_answer(request: Request | None, scope: str, admission: Admission, ask: Ask, run: _Run,
                            decoded: Decoded) -> Answered:
    """Infer, then post-process while the version is still held (the labels' text work, the OOD score, the
    overlay use it)."""
    mv, job = run.mv, run.job
    assert job is not None
    result = await mv.infer(job.task, decoded.x, run.arrival, admission)
    text_ms = None
    if job.labels is not None:
        assert request is not None and mv.text is not None
        who = LabelCaller.of(request.app, scope)  # its label cache and rate
        logits, text_ms = await mv.label_logits(job.labels, result.outputs[EMBEDDING], admission, who)
        made = postprocess.by_labels(logits[0], job.labels, ask.top_k, mv.text.scores)
        if job.abstain is not None:
            made = postprocess.abstain(made, *job.abstain)
    else:
        made = postprocess.answer(result.outputs, mv.info, _shape(ask, job), _ood(mv, ask, result))
    overlay = None
    if ask.overlay is not None and made.explanation is not None:
        overlay = await mv.overlay(decoded.crop, made.explanation.heat, ask.overlay.alpha, ask.overlay.colormap,
                                   ask.overlay.size)
    total = (time.perf_counter() - run.t0) * 1e3
    timings = Timings(0.0, 0.0, decoded.decode_ms, result.queue_ms, result.infer_ms, text_ms, total,
                      result.batch_size)
    return Answered(mv.name, str(mv.version), mv.info, decoded.id, decoded.crop, ask, job, made, overlay, timings)


def _shape(ask: Ask, job: Job) -> Shape:
    """What the answer to `ask` holds: /classify the top_k classes (and the map with explain=true), /explain the
    map and the 5 best classes when the pass gave logits, /embed the embedding."""
    method = ask.explain.method if ask.explain is not None else None
    if ask.kind == "embed":
        return Shape(embedding=True, normalize=ask.normalize, patch_tokens=ask.layer is not None)
    if ask.kind == "explain":
        return Shape(top_k=5, logits_optional=True, explain=method, rollout=job.task.rollout)
    return Shape(top_k=ask.top_k, explain=method, rollout=job.task.rollout)


def _ood(mv: ModelVersion, ask: Ask, result: Result) -> Ood | None:
    """The pass joins the version's drift window (classify and embed, not explain); /classify's answer carries
    the image's OOD verdict when the pass gave what the score needs."""
    monitor = mv.monitor
    if monitor is None or ask.kind == "explain":
        return None
    scores = monitor.observe(result.outputs)
    if ask.kind != "classify" or scores is None:
        return None
    return Ood(**monitor.answer(float(scores[0])))


def _finish(done: Answered, timings: Timings, hooks: Sequence[Hook]) -> Answered:
    """The answer with its final timings, handed to each hook in order."""
    done = dataclasses.replace(done, timings=timings)
    for hook in hooks:
        hook(done)
    return done


async def decode_kept(mv: ModelVersion, upload: Upload, scope: str, max_patches: int | None = None) -> Decoded:
    """The upload decoded (none if the caller sent it before: its crop is in the store) and kept for GET
    /explain, with the caller's id for it (`stores.secret`): another caller's identical upload neither finds
    this crop nor gets this id. `max_patches`: a NaFlex model's input of that budget instead, the whole image at
    its own aspect ratio (not kept)."""
    secret = mv.decoder.secret
    image = secret.image_id(scope, upload.sha256)
    if max_patches is not None:
        decoded = await mv.decoder.decode_naflex(upload.data, max_patches, image)
    else:
        decoded = await mv.decode(upload.data, secret.slot(scope, image))
    return dataclasses.replace(decoded, id=image)


# ---- tensors in, tensors out: the Open Inference Protocol (HTTP /v2, gRPC) ----------------------------------------


@dataclass(frozen=True)
class TensorRequest(Generic[B]):
    """How a transport hands the pipeline an Open Inference Protocol request: `read` its body (HTTP: the bytes;
    gRPC: the message, read already), `parse` it within the bounds of the version that answers, and `caller`:
    whose label cache and rate its labels use; `clock`: its body's (`slow_clients.BodyClock`; None: none)."""

    read: Callable[[], Awaitable[B]]
    parse: Callable[[B, RequestBounds], InferRequest]
    caller: Callable[[], Awaitable[LabelCaller]]
    clock: Any = None


@dataclass(frozen=True)
class TensorsAnswered:
    """One Open Inference Protocol request answered: by which version, the request as parsed, what it asked of
    that version, and the typed answer (`Answer.tensors`: each output asked for, every row)."""

    model: str
    version: str
    request: InferRequest
    wanted: v2_model.Wanted
    answer: Answer


async def answer_tensors(choice: ModelChoice, admission: Admission, source: TensorRequest[B]) -> TensorsAnswered:
    """The request `source` reads through the version `choice` names, in the module's order: announce, read, choose
    once (404 / 503 before the body is read); then on the held version parse it within its bounds (400), apply its
    `timeout` and `priority` to `admission` (504 now when its deadline has passed), resolve what it asks
    (`v2_model.resolve`), decode its input (`v2_model.pixels`), infer and post-process (`_infer_tensors`); a `text`
    input goes to the text tower instead (`v2_model.text_embeddings`)."""
    arrived, _ = await _announce_and_read(choice, None, source.clock, admission, source.read)
    run = _keep_or_choose_again(arrived, None, choice, admission, None, 0.0)
    mv, settings = run.mv, choice.gateway.settings
    with mv.using(), run.arrival:
        admission.at("decode", mv)
        req = source.parse(arrived.body, v2_model.request_bounds(mv, settings.limits))
        admission.v2_parameters(req.parameters, settings.priority_levels)  # timeout (µs), priority
        admission.check(mv)
        if v2_model.TEXT in req.inputs:  # texts, through the text tower
            wanted, answer = await v2_model.text_embeddings(mv, req, admission)
            return TensorsAnswered(mv.name, str(mv.version), req, wanted, answer)
        caller = await source.caller()
        wanted = v2_model.resolve(mv, req)
        x = await v2_model.pixels(mv, req.inputs, settings.decode_workers, wanted.tasks[0].max_patches)
        answer = await _infer_tensors(mv, wanted, x, run.arrival, admission, caller)
    return TensorsAnswered(mv.name, str(mv.version), req, wanted, answer)


async def _infer_tensors(mv: ModelVersion, wanted: v2_model.Wanted, x: np.ndarray, arrival: Arrival,
                         admission: Admission, caller: LabelCaller) -> Answer:
    """One pass per task (the arrival announced one request: the first pass takes it), then post-processed while
    the version is held: each image's OOD score joins the outputs (from the model's own logits or embedding,
    before labels replace them), the labels' logits replace the model's, and the answer keeps each output asked
    for, whole."""
    monitor = mv.monitor
    outputs: dict[str, np.ndarray] = {}
    for i, task in enumerate(wanted.tasks):
        outputs.update((await mv.infer(task, x, arrival if i == 0 else None, admission)).outputs)
    if monitor is not None:
        scores = monitor.observe(outputs)
        if scores is not None:
            outputs[OOD_SCORE] = scores.astype(np.float32)
    if wanted.labels is not None and EMBEDDING in outputs:
        outputs[LOGITS], _ = await mv.label_logits(wanted.labels, outputs[EMBEDDING], admission, caller)
    return postprocess.answer(outputs, mv.info, Shape(tensors=tuple(o["name"] for o in wanted.outputs)))
