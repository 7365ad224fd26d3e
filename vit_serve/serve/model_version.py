"""One loaded model version: its backend, its own model thread and runner, and what a request asks of it.

The request pipeline (`serve.pipeline`) chooses a `ModelVersion` once, announces the request to it while its body is
read, and holds it (`using()`) from then to the end of the request, so that a version being unloaded (a newer one
switched in, or an unload call) finishes the requests that were routed to it before it is closed, waiting at most
`unload_grace_s` for them (those still unanswered then get 503). The announcement (`Announcement`) does not keep that
version alive: a version that leaves service while a body is read is chosen again once it is read.

Its phase (loading, ready, failed, draining, stopping, unloaded) is a `version_state.VersionStatus`, moved only here;
its uploads are decoded by its `version_decode.VersionDecoder` (its preprocessing contract, the crop store).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from PIL import Image

from vit_serve.explain import HEAD_FUSIONS
from vit_serve.monitor import abstain_threshold
from vit_serve.runtime import batch_curve
from vit_serve.runtime.backends.base import Backend, ModelInfo, RemoteBackend
from vit_serve.runtime.decode import Decoded
from vit_serve.runtime.scheduling import Arrival, Result, Runner
from vit_serve.runtime.scheduling.errors import NotReadyError as SchedulerNotReady
from vit_serve.runtime.task import CLASSIFY, EMBED, Task
from vit_serve.runtime.text_tower import TextTower
from vit_serve.runtime.zero_shot import LabelLimits
from vit_serve.serve.admission import DEFAULT_PRIORITY, Admission
from vit_serve.serve.errors import BadRequestError, InvalidValueError, NotReadyError
from vit_serve.serve.labels import LabelCaller, encode_labels, parse_labels
from vit_serve.serve.metrics import ModelMetrics
from vit_serve.serve.monitoring import VersionMonitor
from vit_serve.serve.version_decode import VersionDecoder
from vit_serve.serve.version_state import Phase, VersionStatus

log = logging.getLogger("vit_serve.serve")

class ModelVersion:
    """A version the gateway loaded (`version_loader.VersionLoader.load` builds it; `status` is its phase)."""

    def __init__(self, name: str, version: int, backend: Backend, runner: Runner, thread: ThreadPoolExecutor,
                 metrics: ModelMetrics, decoder: VersionDecoder, fingerprint: str = "", *,
                 label_limits: LabelLimits | None = None, monitor: VersionMonitor | None = None,
                 text: TextTower | None = None, text_error: str | None = None) -> None:
        self.name, self.version = name, version
        self.backend, self.runner, self.thread, self.metrics = backend, runner, thread, metrics
        self.decoder = decoder  # its uploads: the decode pool or the GPU, its contract's crops
        self.fingerprint = fingerprint  # of the files it was loaded from (discovery.fingerprint)
        self.memory_bytes: int | None = None  # RSS it took to load and warm up
        self.loaded_at = time.time()  # Unix seconds (GET /v1/models' `created`)
        self.status = VersionStatus(self.label)  # its phase: changed only by warm_up, warm_up_soon and close
        self.text = text  # its text tower (NAME_text.onnx beside it): POST /classify?labels=
        self.text_error = text_error  # why the text tower beside it could not be loaded
        self.label_limits = label_limits or LabelLimits()  # requests with labels
        # OOD scores and the drift window (`monitoring`; None: monitoring off, or a model without a reference)
        self.monitor = monitor
        # (task, x, result, admission) -> None: a copy of each answered request for shadow / canary comparison
        # (`traffic`); it only schedules work
        self.mirror: Callable[[Task, np.ndarray, Result, Admission | None], None] | None = None
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._warmup: asyncio.Task[None] | None = None
        self._announced: set[Arrival] = set()  # requests reading their bodies (`Announcement`)
        self._answering: set[asyncio.Future[Result]] = set()  # requests queued or in a batch (`infer`)
        self._grace_s = math.inf  # the unload grace it was closed with
        self._closed = asyncio.Event()

    @property
    def info(self) -> ModelInfo:
        return self.backend.info

    @property
    def label(self) -> str:
        return f"{self.name} version {self.version}"

    @property
    def contract(self) -> str:
        """Its preprocessing contract's digest: versions with equal ones take each other's inputs."""
        return self.decoder.contract

    @property
    def warm(self) -> bool:
        """Warmed up and in service (READY)."""
        return self.status.phase is Phase.READY

    @property
    def error(self) -> str | None:
        """Why its warm-up failed (kept while it is tried again), else None."""
        return self.status.reason or None

    # ---- lifetime --------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def using(self) -> Iterator[ModelVersion]:
        """Hold this version for one request: an unload waits until every holder has let go."""
        self._in_flight += 1
        self._idle.clear()
        try:
            yield self
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def announce(self, priority: int = DEFAULT_PRIORITY) -> Announcement:
        """Count a request (at level `priority`) whose body is being read as coming (the batcher may wait for it),
        without holding this version: it may be replaced and closed meanwhile, and the request then uses the
        version chosen after."""
        return Announcement(self, priority)

    async def warm_up(self) -> bool:
        """One batch through the model (in its thread); READY after it. False (FAILED, and `error`) when it fails,
        or when the version was closed meanwhile."""
        t0 = time.perf_counter()
        try:
            if isinstance(self.backend, RemoteBackend):
                await self.backend.warmup()
            else:
                await self.runner.call(self.backend.warmup)
            await self._measure_batch_curve()
        except Exception as e:
            if self.status.closing:
                return False
            self.status.move(Phase.FAILED, f"warm-up failed: {' '.join(str(e).split()) or type(e).__name__}")
            log.warning("%s: %s", self.label, self.error)
            return False
        if self.status.closing:  # unloaded while warming up: it never serves again
            return False
        self.status.move(Phase.READY)
        self.metrics.ready.set(1)
        log.info("%s warmed up in %.2f s; ready", self.label, time.perf_counter() - t0)
        return True

    async def _measure_batch_curve(self) -> None:
        """What batching buys this version's model (its batching runner's `use_curve`), measured in its thread."""
        runner, limits = self.runner, self.runner.limits
        if not runner.measures_curve:
            return
        image = np.zeros((1, 3, *self.info.resolution), np.float32)
        curve = await runner.call(batch_curve.measure, self.backend.classify, image, runner.max_batch,
                                  limits.batch_curve_budget_s)
        runner.use_curve(curve)  # type: ignore[union-attr]  # a runner that measures its curve batches
        log.info("%s: batch curve %s", self.label, curve.describe(limits.max_delay_ms))

    def warm_up_soon(self) -> None:
        """Warm up in the background (again, if an earlier warm-up failed: FAILED -> LOADING, its reason kept)."""
        if self._warmup is None or self._warmup.done():
            if self.status.phase is Phase.FAILED:
                self.status.move(Phase.LOADING)
            self._warmup = asyncio.get_running_loop().create_task(self.warm_up())

    async def readiness(self) -> tuple[bool, str | None]:
        """(ready, why not): warmed up and the backend answers (`Backend.ready`)."""
        if not self.warm:
            if self.status.phase is Phase.FAILED and (self._warmup is None or self._warmup.done()):
                self.warm_up_soon()  # try again
            return False, self.error or "warming up"
        why: str | None = None
        try:
            if isinstance(self.backend, RemoteBackend):
                ok = await self.backend.ready()
            else:
                ok = self.backend.ready()
        except Exception as e:
            ok, why = False, f"backend not ready: {e}"
        self.metrics.ready.set(int(ok))
        return ok, None if ok else (why or f"the {self.backend.name} backend is not ready")

    async def close(self, grace_s: float = 0.0) -> None:
        """Let the requests holding this version finish, waiting at most `grace_s` seconds (0: not at all), then
        stop its runner, backend and thread: the requests still queued or running then are answered 503. Closing
        a version already closing waits until it is closed."""
        if self.status.closing:
            await self._closed.wait()
            return
        self.status.move(Phase.DRAINING)
        self._grace_s = grace_s
        if grace_s > 0 and self._in_flight:
            try:
                await asyncio.wait_for(self._idle.wait(), None if math.isinf(grace_s) else grace_s)
            except TimeoutError:
                log.warning("%s: %d requests still in flight after the unload grace (%g s, "
                            "VIT_SERVE_UNLOAD_GRACE_S); answering them 503", self.label, self._in_flight, grace_s)
        if self._warmup is not None:
            self._warmup.cancel()
        for arrival in list(self._announced):  # requests still reading their bodies choose again afterwards
            arrival.done()
        self._announced.clear()
        self.status.move(Phase.STOPPING)
        for waiting in list(self._answering):  # queued or in the running batch: answered 503 (`infer`)
            waiting.cancel()
        await self.runner.stop()
        try:
            if isinstance(self.backend, RemoteBackend):
                await self.backend.close()
            else:
                self.backend.close()
        except Exception:
            log.exception("closing %s", self.label)
        self.thread.shutdown(wait=False, cancel_futures=True)
        if self.text is not None:
            self.text.close()
        self.decoder.close()
        self.metrics.remove()
        self.status.move(Phase.UNLOADED)
        self._closed.set()

    async def wait_closed(self) -> None:
        """Until `close` has finished (the runner, backend and thread stopped, the gauges handed over)."""
        await self._closed.wait()

    def _unloaded(self) -> NotReadyError:
        waited = "" if math.isinf(self._grace_s) else f" (it waited the unload grace, {self._grace_s:g} s, " \
                                                      f"VIT_SERVE_UNLOAD_GRACE_S)"
        return NotReadyError(f"{self.label} was unloaded before this request was answered{waited}; retry",
                             headers={"Retry-After": "1"})

    # ---- work ------------------------------------------------------------------------------------------

    def crop_of(self, slot: str) -> Image.Image | None:
        """The crop of an image decoded earlier with this contract, by its slot (`VersionDecoder.crop_of`)."""
        return self.decoder.crop_of(slot)

    async def decode(self, data: bytes, key: str | None = None, keep: bool = True) -> Decoded:
        """Upload bytes -> id, crop, x [1, 3, H, W], the crop kept under `key` (`VersionDecoder.decode`)."""
        return await self.decoder.decode(data, key, keep)

    async def tensor_of(self, crop: Image.Image) -> np.ndarray:
        return await self.decoder.tensor_of(crop)

    async def overlay(self, crop: Image.Image, heatmap: np.ndarray, alpha: float, colormap: str,
                      size: int | None = None) -> bytes:
        return await self.decoder.overlay(crop, heatmap, alpha, colormap, size)

    def explain_task(self, method: str, head_fusion: str | None, discard_ratio: float | None,
                     target: int | None = None) -> Task:
        """The Task for an explanation request, or 400 / 422 saying why this model cannot give it."""
        info, backend = self.info, self.backend
        if method == "grad_rollout":
            if not backend.supports_grad_rollout:
                raise BadRequestError(f"method=grad_rollout needs the torch backend (serve the checkpoint); "
                                      f"{self.name} runs on {backend.name}")
            if target is not None and not 0 <= target < info.num_classes:
                raise InvalidValueError(f"target {target} is not a class index (0..{info.num_classes - 1})")
            return Task("grad_rollout", target=target)
        if not info.explain:
            raise BadRequestError(f"the {backend.name} backend has no explain graph for {info.name} (vit-export writes "
                                  f"NAME_explain.onnx beside NAME.onnx)")
        if head_fusion is not None and head_fusion not in HEAD_FUSIONS:
            raise InvalidValueError(f"head_fusion must be one of {', '.join(HEAD_FUSIONS)}")
        try:
            return Task("explain", rollout=info.resolve_rollout(head_fusion, discard_ratio))
        except ValueError as e:
            raise BadRequestError(str(e)) from None

    def abstain_threshold(self, asked: float | None) -> tuple[float, str]:
        """Zero-shot abstention's threshold and its source: `asked` ("request"), else calibrated from the model's
        reference ("reference", `monitor.abstain_threshold`); 400 when there is neither."""
        if asked is not None:
            return asked, "request"
        ref = self.info.reference
        if ref is None or len(ref.confidences) == 0:
            raise BadRequestError(f"abstain=true: {self.name} has no reference to calibrate the threshold from "
                                  f"(vit-serve convert or vit-export --reference-images DIR); give threshold=")
        return abstain_threshold(ref), "reference"

    def needs_tokens(self, what: str) -> None:
        """400 naming `what` unless the version runs on the torch backend (or Ray's, running it), the one whose
        model gives its patch tokens (the exported graphs give none)."""
        if not self.backend.supports_grad_rollout:
            raise BadRequestError(f"{what} needs the torch backend (serve the checkpoint): the {self.backend.name} "
                                  f"backend's graphs give no patch tokens; {self.name} runs on it")

    def similarity_task(self, query: tuple[float, ...] | None, label: int | None,
                        rollout: tuple[str | None, float | None] | None) -> Task:
        """The Task of a similarity map (GET /explain?method=similarity) for `query` (a vector of the embedding's
        width) or the zero-shot head's class `label`, times the rollout with `rollout` (head fusion, discard
        ratio; None: not), or 400 / 422 saying why this model cannot give it."""
        info = self.info
        self.needs_tokens("method=similarity")
        if query is not None and len(query) != info.embedding_dim:
            raise BadRequestError(f"the query has {len(query)} dimensions, {self.name}'s embedding "
                                  f"{info.embedding_dim}: a query from another embedding space")
        settings = None
        if rollout is not None:
            try:
                settings = info.resolve_rollout(*rollout)
            except ValueError as e:
                raise BadRequestError(str(e)) from None
        return Task("similarity", rollout=settings, target=label, query=query)

    def patch_tokens_task(self, layer: int, max_floats: int) -> Task:
        """The Task of /embed?tokens=patch (block `layer`'s patch tokens), or 400 saying why this model cannot
        (another backend, a layer it does not have, more than `max_floats` floats)."""
        self.needs_tokens("tokens=patch")
        model = getattr(self.backend, "model", None)  # the torch backend's (Ray's runs elsewhere: checked there)
        if model is not None:
            depth, (gh, gw) = len(model.blocks), self.info.grid
            if not -depth <= layer < depth:
                raise BadRequestError(f"layer must be from {-depth} to {depth - 1} ({self.name} has {depth} "
                                      f"blocks), got {layer}")
            if gh * gw * model.cfg.embed_dim > max_floats:
                raise BadRequestError(f"tokens=patch: {gh} x {gw} patches x {model.cfg.embed_dim} floats = "
                                      f"{gh * gw * model.cfg.embed_dim:,} is more than this gateway answers "
                                      f"(VIT_SERVE_MAX_PATCH_TOKEN_FLOATS = {max_floats:,})")
            layer %= depth  # the answer names the block by its index
        return Task("patch_tokens", layer=layer)

    def patch_budget(self, asked: int | None, what: str = "max_patches") -> int | None:
        """A request's NaFlex patch budget (`what`: its name in the request): `asked` within the model's own, else
        the model's own; None for a fixed-size model asked for none. 400 when a fixed-size model is asked for one,
        422 out of bounds."""
        info = self.info
        limit = info.max_patches
        if limit is None:
            if asked is not None:
                raise BadRequestError(f"{what}: {info.name} is not a NaFlex model here (it takes fixed-size "
                                      f"{info.resolution[0]}x{info.resolution[1]} images on {info.backend or 'its'} "
                                      f"backend; NaFlex is a SigLIP 2 NaFlex checkpoint on the torch backend); omit "
                                      f"{what}")
            return None
        if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or not 1 <= asked <= limit):
            raise InvalidValueError(f"{what} must be an integer from 1 to {limit} (the model's patch budget), got "
                                    f"{asked!r}")
        return limit if asked is None else asked

    def classify_task(self) -> Task:
        """The Task of a /classify request: the embed task when the OOD score needs the embedding (`monitor`), so
        that one pass answers and scores it (and batches with /embed), else classify."""
        return CLASSIFY if self.monitor is None else self.monitor.task

    def embed_task(self) -> Task:
        """The Task for an embedding request, or 400 when the model has no embedding output."""
        if not self.info.embedding_dim:
            raise BadRequestError(f"{self.name} has no embedding output: re-export it with vit-export --outputs "
                                  f"logits,embedding (or serve its checkpoint with the torch backend)")
        return EMBED

    def parse_labels(self, value: str | list[str], what: str = "labels") -> list[str]:
        """A request's labels within the limits (`label_limits`) and its text tower's tokenizer; 400 naming
        `what` beyond them (`labels.parse_labels`)."""
        return parse_labels(self, value, what)

    def zero_shot_task(self) -> Task:
        """The Task of a request with labels (the image embedding, which the text tower's label embeddings are
        compared with), or 400 saying why this model cannot take labels."""
        if self.text is None:
            why = (f"its text tower could not be loaded ({self.text_error})" if self.text_error else
                   "it has no text tower (vit-export --text-tower writes NAME_text.onnx beside NAME.onnx)")
            raise BadRequestError(f"{self.name} cannot classify by labels: {why}")
        if self.info.embedding_dim != self.text.manifest.embedding_dim:
            raise BadRequestError(f"{self.name} cannot classify by labels: its image embedding has "
                                  f"{self.info.embedding_dim or 'no'} dimensions, its text tower's "
                                  f"{self.text.manifest.embedding_dim} (export it with vit-export --text-tower, "
                                  f"which adds the embedding output)")
        return EMBED

    async def label_logits(self, labels: list[str], image_embeds: np.ndarray, admission: Admission | None = None,
                           caller: LabelCaller | None = None) -> tuple[np.ndarray, float]:
        """Image embeddings [B, E] -> (zero-shot logits [B, n] over `labels`, ms spent): the caller's cached
        labels, the others encoded in the text tower's thread under the request's terms (`labels.encode_labels`)."""
        return await encode_labels(self, labels, image_embeds, admission, caller)

    def text_info(self) -> dict | None:
        """What clients need to know of the text tower (model metadata), None without one."""
        if self.text is None:
            return None
        m = self.text.manifest
        return {"scores": m.scores, "templates": list(m.templates), "embedding_dim": m.embedding_dim,
                "tokenizer": m.tokenizer.kind, "context_length": m.tokenizer.context_length}

    def arriving(self, priority: int = DEFAULT_PRIORITY) -> Arrival:
        """Announce a request (at level `priority`) to the runner before reading and decoding it (`with
        version.arriving() as a:`)."""
        return self.runner.arriving(priority)

    async def infer(self, task: Task, x: np.ndarray, arrival: Arrival | None = None,
                    admission: Admission | None = None) -> Result:
        """Run `task` on x [n, 3, H, W] through the runner (with the request's `admission`: its level and
        deadline); 503 once this version is unloaded. A primary answer is handed to `mirror` (shadow traffic and
        canary pairs, `traffic`), which schedules its own work and returns at once."""
        if self.status.stopped:
            if arrival is not None:
                arrival.done()
            raise self._unloaded()
        if admission is not None:
            admission.at("queue", self)
        waiting = asyncio.ensure_future(self.runner.submit(task, x, arrival, admission))
        self._answering.add(waiting)
        try:
            result = await waiting
        except NotImplementedError as e:  # the backend cannot do this task
            raise BadRequestError(str(e)) from e
        except (NotReadyError, SchedulerNotReady, asyncio.CancelledError):
            current = asyncio.current_task()
            if self.status.stopped and not (current is not None and current.cancelling()):  # cut by the unload, not
                raise self._unloaded() from None  # by the client going away
            raise
        finally:
            self._answering.discard(waiting)
        if self.mirror is not None and not (admission is not None and admission.shadow):
            try:
                self.mirror(task, x, result, admission)
            except Exception:  # a shadow's trouble is never the answer's
                log.exception("%s: mirroring a request", self.label)
        return result


class Announcement:
    """A request announced to a version's batcher (a `scheduling.Arrival`) while its body is read, holding neither the
    version nor its runner: the version keeps the arrival and ends it when closed. Use as `with ...:` around the
    read; the version that answers is chosen after it."""

    def __init__(self, version: ModelVersion, priority: int = DEFAULT_PRIORITY) -> None:
        arrival = version.arriving(priority)
        version._announced.add(arrival)
        self._version, self._arrival = weakref.ref(version), weakref.ref(arrival)

    @property
    def version(self) -> ModelVersion | None:
        """The version announced to (None once it is gone)."""
        return self._version()

    def heard_from(self, clock: Any) -> Announcement:
        """Count the request as coming only while its body's bytes keep coming: `clock.last` is when the latest
        came (`slow_clients.BodyClock`; None: always); a stalled upload makes no batch wait (`scheduling.Arrival`)."""
        arrival = self._arrival()
        if arrival is not None:
            arrival.heard_from(clock)
        return self

    def claim(self) -> tuple[ModelVersion, Arrival] | None:
        """The body is read: the version announced to and the request's arrival, handed on to decoding and the
        queue (one arrival per request; its body no longer stalls it), or None (and `done`) when the version is
        gone or was closed meanwhile (closing ended the arrival)."""
        version, arrival = self._version(), self._arrival()
        if version is None or arrival is None or arrival not in version._announced:
            self.done()
            return None
        version._announced.discard(arrival)
        arrival.heard_from(None)
        return version, arrival

    def done(self) -> None:
        version, arrival = self._version(), self._arrival()
        if arrival is not None:
            arrival.done()
            if version is not None:
                version._announced.discard(arrival)

    def __enter__(self) -> Announcement:
        return self

    def __exit__(self, *exc: object) -> None:
        self.done()
