"""The running gateway: the repository of loaded models, the shared decode pool, image store and metrics of one
app, and the readiness that health routes report.

Threads: decoding / preprocessing / PNG encoding run in one small pool (`decode_workers`) shared by every model;
each loaded model version runs in its own model thread (loading, warm-up and every batch: one batch at a time
per version); the event loop only moves bytes and JSON. On CUDA (and `gpu_decode`), a version decodes JPEG
uploads in batches on the GPU (`gpu_decode`) and the others on the CPU pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from PIL import Image

from vit_serve.monitor import DriftReport
from vit_serve.runtime.spec import LoadSpec
from vit_serve.serve.errors import GatewayError, NotReadyError
from vit_serve.serve.metrics import GatewayMetrics
from vit_serve.serve.model_version import ModelVersion
from vit_serve.serve.repository import ModelRepository
from vit_serve.serve.settings import ServeSettings
from vit_serve.serve.stores import open_store
from vit_serve.serve.version_loader import VersionLoader

if TYPE_CHECKING:
    from vit_serve.runtime.payload_sampler import PayloadSampler

log = logging.getLogger("vit_serve.serve")
SAMPLE_ENCODE_WAIT_S = 10.0  # at a graceful stop, the longest wait for the last answers' crops to reach the sampler


class Gateway:
    """Everything one app serves with; created by `create_app`, started and stopped by its lifespan."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.metrics = GatewayMetrics()
        # memory, or Redis shared by every replica (stores/); entries failing their seal are counted
        self.store = open_store(settings, self.metrics.store_rejected.inc)
        self.decode_pool: ThreadPoolExecutor | None = None
        self.repository: ModelRepository | None = None
        self._pil_limit: int | None = None
        self.started = False
        # Graceful shutdown (vit_serve.serve.shutdown): `draining` turns the readiness probes 503 while every
        # request is still served; `closing` (the grace is over) refuses new requests, as `refuse_waiting` does
        # the waiting ones.
        self.draining = False
        self.closing = False
        # Drift gauges, read when /metrics is scraped (computed at most once per drift_refresh_s: monitoring).
        self.metrics.drift_reports = self.drift_reports
        # A sample of /classify requests kept for labelling (the lifespan opens it when sample_rate > 0).
        self.sampler: PayloadSampler | None = None
        # The crops of answered requests being encoded for the sampler (offered when done): stop() waits for them.
        self.pending_samples: set[asyncio.Future] = set()

    # ---- lifecycle -------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Scan the repository and load its models (a one-file repository that cannot be served raises: the
        server does not start); warm-ups run in the background."""
        # PIL's own decompression-bomb guard at the same cap as load_image's max_pixels check (which runs on the
        # header first); PIL warns above it and refuses above twice it.
        self._pil_limit = Image.MAX_IMAGE_PIXELS  # restored by stop(): other code in this process keeps its own
        Image.MAX_IMAGE_PIXELS = self.settings.max_pixels
        self.decode_pool = ThreadPoolExecutor(self.settings.decode_workers, thread_name_prefix="vit-serve-decode")
        s = self.settings
        if s.monitor.sample_rate > 0:
            from vit_serve.runtime.payload_sampler import PayloadSampler

            dropped = self.metrics.samples_dropped
            self.sampler = PayloadSampler(s.monitor.sampler_settings(),
                                          dropped=lambda reason, n: dropped.labels(reason).inc(n))
        loader = VersionLoader(LoadSpec.of(s), self.metrics, self.decode_pool, self.store, max_pixels=s.max_pixels,
                               gpu_decode=s.gpu_decode, label_limits=s.label_limits, monitoring=s.monitor)
        self.repository = ModelRepository(loader, s.repository, self.metrics.registry)
        await self.repository.start()
        self.started = True

    async def stop(self) -> None:
        if self.repository is not None:
            await self.repository.stop()
        if self.pending_samples:  # the last answers' crops, offered to the sampler before it closes
            await asyncio.wait(set(self.pending_samples), timeout=SAMPLE_ENCODE_WAIT_S)
            await asyncio.sleep(0)  # their done callbacks (the offers) run before the sampler is closed
        if self.decode_pool is not None:
            self.decode_pool.shutdown(wait=False, cancel_futures=True)
        self.store.close()
        if self.sampler is not None:  # after the models: the last answers' samples are offered; written in a
            sampler, self.sampler = self.sampler, None  # thread of its own, which close() waits for
            await asyncio.get_running_loop().run_in_executor(None, sampler.close)
        if self._pil_limit is not None:
            Image.MAX_IMAGE_PIXELS, self._pil_limit = self._pil_limit, None

    # ---- what routes ask --------------------------------------------------------------------------------

    def drift_reports(self) -> Iterator[tuple[str, str, DriftReport]]:
        """(model, version, its drift report) of every version in service whose answers are watched."""
        for v in self.repository.loaded() if self.repository is not None else []:
            if v.monitor is not None:
                yield v.name, str(v.version), v.monitor.scraped()  # at most once per drift_refresh_s

    def model(self, name: str | None = None, version: str | int | None = None,
              session: str | None = None) -> ModelVersion:
        """The loaded version a request is routed to (404 / 503 / 400 when there is none; `session`: the client's
        X-Session-Id, for sticky traffic splits); hold it with `with version.using():` for the request."""
        if self.closing:
            raise self.shutting_down()
        if self.repository is None:
            raise NotReadyError("the models are loading", headers={"Retry-After": "1"})
        return self.repository.get(name, version, session)

    def shutting_down(self) -> NotReadyError:
        """The answer to a request that the server will not run because it is stopping (503 + Retry-After)."""
        return NotReadyError("the server is shutting down; retry",
                             headers={"Retry-After": str(self.settings.limits.retry_after_s)})

    def refuse_waiting(self, error: GatewayError) -> int:
        """Answer `error` to every request waiting in a loaded version's queue (the running batches finish);
        how many there were (counted as rejected, reason "shutdown")."""
        refused = 0
        for v in self.repository.loaded() if self.repository is not None else []:
            n = v.runner.refuse_waiting(error)
            if n:
                v.metrics.rejected("shutdown").inc(n)
            refused += n
        return refused

    async def readiness(self) -> tuple[bool, str | None]:
        """(ready, why not): the default model (or, with none, every loaded model) is loaded, warmed up and its
        backend answers. A model of the repository that failed to load does not make the gateway unready."""
        if self.draining:
            return False, "draining"
        repo = self.repository
        if repo is None or not self.started:
            return False, "the models are loading"
        name = repo.default_name
        if name is not None:
            newest = repo.newest(name)
            if newest is None:
                return False, f"model {name!r} is not loaded: {repo.why_not(name)}"
            return await newest.readiness()
        loaded = repo.loaded()
        if not loaded:
            return False, "no model is loaded"
        answers = await asyncio.gather(*(v.readiness() for v in loaded))
        bad = [f"{v.label}: {why}" for v, (ok, why) in zip(loaded, answers, strict=True) if not ok]
        return (not bad), ("; ".join(bad) or None)

    async def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until ready (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while True:
            ok, why = await self.readiness()
            if ok:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"not ready after {timeout} s: {why}")
            await asyncio.sleep(0.02)
