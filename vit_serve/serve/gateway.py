"""The running gateway: backend, batcher, thread pools, image store and metrics of one app, and what routes ask
of them (decode an upload, run a task, turn logits into predictions).

Threads: decoding / preprocessing / PNG encoding run in a small pool (`decode_workers`); the model runs in one
dedicated thread (loading, warm-up and every batch), so it runs one batch at a time; the event loop only moves
bytes and JSON. On CUDA (and `gpu_decode`), JPEG uploads are decoded in batches on the GPU (`gpu_decode`, its own
thread) and the others on the CPU pool; `gpu_decode_off` says why the GPU does not decode, when it does not.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from PIL import Image

from vit_serve.explain import HEAD_FUSIONS
from vit_serve.serve.backends import create_backend
from vit_serve.serve.backends.base import Backend, ModelInfo
from vit_serve.serve.batcher import Arrival, Batcher, Result
from vit_serve.serve.errors import BadRequestError, InvalidValueError, NotReadyError
from vit_serve.serve.gpu_decode import GpuDecoder, unavailable_reason
from vit_serve.serve.images import Decoded, decode, decode_crop, image_id, input_tensor, overlay_png
from vit_serve.serve.inference import Task
from vit_serve.serve.metrics import GatewayMetrics
from vit_serve.serve.settings import ServeSettings
from vit_serve.serve.store import ImageStore

log = logging.getLogger("vit_serve.serve")


def top_k(logits: np.ndarray, k: int, info: ModelInfo) -> list[dict[str, Any]]:
    """logits [K] -> the k best classes as {"label", "index", "score" (softmax)}, best first (by logit: ties by
    index, NaN last). Non-finite logits give NaN scores, which the JSON encoder writes as null."""
    z = logits.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(z - z.max())
        p /= p.sum()
    best = np.argsort(-z, kind="stable")[:min(k, z.shape[0])]
    return [{"label": info.label(int(i)), "index": int(i), "score": float(p[i])} for i in best]


class Gateway:
    """Everything one app serves with; created by `create_app`, started and stopped by its lifespan."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.metrics = GatewayMetrics()
        self.store = ImageStore(settings.store_size, settings.store_ttl_s)
        self.backend: Backend | None = None
        self.batcher: Batcher | None = None
        self.decode_pool: ThreadPoolExecutor | None = None
        self.model_thread: ThreadPoolExecutor | None = None
        self.warm = False
        self.error: str | None = None
        self._warmup: asyncio.Task[None] | None = None
        self._pil_limit: int | None = None
        self.gpu: GpuDecoder | None = None
        self.gpu_decode_off: str | None = "the model is not loaded"

    # ---- lifecycle -------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model (errors propagate: the server does not start), then warm it up in the background."""
        # PIL's own decompression-bomb guard at the same cap as load_image's max_pixels check (which runs on the
        # header first); PIL warns above it and refuses above twice it.
        self._pil_limit = Image.MAX_IMAGE_PIXELS  # restored by stop(): other code in this process keeps its own
        Image.MAX_IMAGE_PIXELS = self.settings.max_pixels
        self.decode_pool = ThreadPoolExecutor(self.settings.decode_workers, thread_name_prefix="vit-serve-decode")
        self.model_thread = ThreadPoolExecutor(1, thread_name_prefix="vit-serve-model")
        loop = asyncio.get_running_loop()
        self.backend = await loop.run_in_executor(self.model_thread, create_backend, self.settings)
        info = self.backend.info
        log.info("loaded %s (%s backend): %dx%d, %d classes, explain=%s", info.name, self.backend.name,
                 *info.resolution, info.num_classes, info.explain)
        self._start_gpu_decode()
        self.batcher = Batcher(self.backend, self.settings, self.metrics, self.model_thread)
        self.batcher.start()
        self._warmup = loop.create_task(self._warm_up())

    def _model_device(self) -> str:
        """Where the model runs: "cpu", "cuda[:i]", or (a remote server) the backend's name."""
        backend = self.backend
        assert backend is not None
        extra = backend.info.extra
        if "device" in extra:  # torch
            return str(extra["device"])
        if "providers" in extra:  # onnxruntime
            return "cuda" if "CUDAExecutionProvider" in extra["providers"] else "cpu"
        return "cuda" if backend.name == "tensorrt" else f"the {backend.name} server"

    def _count_gpu_fallback(self, reason: str) -> None:
        self.metrics.gpu_decode_fallbacks.labels(reason).inc()

    def _start_gpu_decode(self) -> None:
        device = self._model_device()
        self.gpu_decode_off = unavailable_reason(device, self.settings.gpu_decode)
        if self.gpu_decode_off is None:
            assert self.backend is not None
            self.gpu = GpuDecoder(self.backend.info.preprocess, self.settings.max_pixels, device,
                                  self.settings.max_batch, self._count_gpu_fallback)
            log.info("decoding JPEG uploads on %s (nvJPEG)", self.gpu.device)
        else:
            log.info("decoding uploads on the CPU: %s", self.gpu_decode_off)

    async def _warm_up(self) -> None:
        assert self.batcher is not None and self.backend is not None
        t0 = time.perf_counter()
        try:
            await self.batcher.call(self.backend.warmup)
        except Exception as e:
            self.error = f"warm-up failed: {' '.join(str(e).split()) or type(e).__name__}"
            log.warning("%s", self.error)
            return
        self.warm, self.error = True, None
        self.metrics.ready.set(1)
        log.info("warmed up in %.2f s; ready", time.perf_counter() - t0)

    async def stop(self) -> None:
        if self._warmup is not None:
            self._warmup.cancel()
        if self.batcher is not None:
            await self.batcher.stop()
        if self.backend is not None:
            try:
                self.backend.close()
            except Exception:
                log.exception("closing the backend")
        for pool in (self.decode_pool, self.model_thread):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        if self.gpu is not None:
            self.gpu.close()
            self.gpu = None
        self.metrics.ready.set(0)
        if self._pil_limit is not None:
            Image.MAX_IMAGE_PIXELS, self._pil_limit = self._pil_limit, None

    async def readiness(self) -> tuple[bool, str | None]:
        """(ready, why not): loaded, warmed up, and the backend answers (`Backend.ready`)."""
        if self.backend is None:
            return False, "the model is loading"
        if not self.warm:
            if self.error and self._warmup is not None and self._warmup.done():
                self._warmup = asyncio.get_running_loop().create_task(self._warm_up())  # try again
            return False, self.error or "warming up"
        try:
            ok = await asyncio.get_running_loop().run_in_executor(None, self.backend.ready)
        except Exception as e:
            ok, self.error = False, f"backend not ready: {e}"
        self.metrics.ready.set(int(ok))
        return ok, None if ok else (self.error or f"the {self.backend.name} backend is not ready")

    async def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until ready (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while not (await self.readiness())[0]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"not ready after {timeout} s: {self.error or 'warming up'}")
            await asyncio.sleep(0.02)

    # ---- work ------------------------------------------------------------------------------------------

    @property
    def info(self) -> ModelInfo:
        if self.backend is None:
            raise NotReadyError("the model is loading")
        return self.backend.info

    async def decode(self, data: bytes, key: str | None = None, keep: bool = True) -> Decoded:
        """Upload bytes -> id, crop, x [1, 3, H, W], decoded once (none if the crop is in the store); keeps the
        crop for GET /explain. `key`: the bytes' sha256 hex when the upload reader has it already."""
        loop = asyncio.get_running_loop()
        cfg, store = self.info.preprocess, self.store if keep else None
        if self.gpu is None:
            return await loop.run_in_executor(self.decode_pool, decode, data, cfg, self.settings.max_pixels, store,
                                              key)
        t0 = time.perf_counter()
        if not key and store is not None:
            key = await loop.run_in_executor(self.decode_pool, image_id, data)
        crop = store.get(key) if store is not None else None
        if crop is None:
            crop = await self.gpu.crop(data)
            if crop is None:  # not for the GPU: the CPU path (and its 4xx answers)
                crop = await loop.run_in_executor(self.decode_pool, decode_crop, data, cfg, self.settings.max_pixels)
            if store is not None:
                store.put(key, crop)
        x = await loop.run_in_executor(self.decode_pool, input_tensor, crop, cfg)
        return Decoded(key or "", crop, x, (time.perf_counter() - t0) * 1e3)

    async def tensor_of(self, crop: Image.Image) -> np.ndarray:
        return await asyncio.get_running_loop().run_in_executor(
            self.decode_pool, input_tensor, crop, self.info.preprocess)

    async def overlay(self, crop: Image.Image, heatmap: np.ndarray, alpha: float, colormap: str) -> bytes:
        return await asyncio.get_running_loop().run_in_executor(
            self.decode_pool, overlay_png, crop, heatmap, alpha, colormap)

    def explain_task(self, method: str, head_fusion: str | None, discard_ratio: float | None,
                     target: int | None = None) -> Task:
        """The Task for an explanation request, or 400 / 422 saying why this server cannot give it."""
        info, backend = self.info, self.backend
        assert backend is not None
        if method == "grad_rollout":
            if not backend.supports_grad_rollout:
                raise BadRequestError(f"method=grad_rollout needs the torch backend (serve the checkpoint); "
                                      f"this server runs {backend.name}")
            if target is not None and not 0 <= target < info.num_classes:
                raise InvalidValueError(f"target {target} is not a class index (0..{info.num_classes - 1})")
            return Task("grad_rollout", target=target)
        if not info.explain:
            raise BadRequestError(f"the {backend.name} backend has no explain graph for {info.name} (vit-export writes "
                                  f"NAME_explain.onnx beside NAME.onnx)")
        if head_fusion is not None and head_fusion not in HEAD_FUSIONS:
            raise InvalidValueError(f"head_fusion must be one of {', '.join(HEAD_FUSIONS)}")
        why = info.rollout_mismatch(head_fusion, discard_ratio)
        if why:
            raise BadRequestError(why)
        hf, dr = info.rollout_settings(head_fusion, discard_ratio)
        return Task("explain", head_fusion=hf, discard_ratio=dr)

    def arriving(self) -> Arrival:
        """Announce a request to the batcher before reading and decoding it (`with gateway.arriving() as a:`)."""
        if self.batcher is None:
            raise NotReadyError("the model is loading")
        return self.batcher.arriving()

    async def infer(self, task: Task, x: np.ndarray, arrival: Arrival | None = None) -> Result:
        """Run `task` on x [n, 3, H, W] through the batcher."""
        if self.batcher is None:
            raise NotReadyError("the model is loading")
        try:
            return await self.batcher.submit(task, x, arrival)
        except NotImplementedError as e:  # the backend cannot do this task
            raise BadRequestError(str(e)) from e
