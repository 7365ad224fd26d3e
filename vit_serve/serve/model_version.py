"""One loaded model version: its backend, its own model thread and runner, and what a request asks of it.

Routes get a `ModelVersion` from the repository and hold it (`using()`) for the whole request, so that a version
being unloaded (a newer one switched in, or an unload call) finishes the requests that were routed to it before
it is closed. Uploads are decoded in the gateway's shared decode pool with this version's own preprocessing
contract; the crop kept for `GET /explain` is stored under the image id and the contract (two models with
different resolutions keep different crops of the same upload).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import numpy as np
from PIL import Image

from vit_serve.explain import HEAD_FUSIONS
from vit_serve.serve.backends.base import Backend, ModelInfo, RemoteBackend
from vit_serve.serve.errors import BadRequestError, InvalidValueError
from vit_serve.serve.gpu_decode import GpuDecoder
from vit_serve.serve.images import Decoded, decode, decode_crop, image_id, input_tensor, overlay_png
from vit_serve.serve.inference import EMBED, Task
from vit_serve.serve.metrics import ModelMetrics
from vit_serve.serve.runner import Arrival, Result, Runner
from vit_serve.serve.stores import CropStore, Namespaced

log = logging.getLogger("vit_serve.serve")

State = Literal["LOADING", "READY", "UNLOADING"]


def contract_key(info: ModelInfo) -> str:
    """A short digest of the preprocessing contract: crops made with equal contracts are interchangeable."""
    text = json.dumps(info.preprocess.to_dict(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


class ModelVersion:
    """A version the gateway loaded (`repository.load_version` builds it)."""

    def __init__(self, name: str, version: int, backend: Backend, runner: Runner, thread: ThreadPoolExecutor,
                 metrics: ModelMetrics, pool: ThreadPoolExecutor, store: CropStore, max_pixels: int,
                 gpu: GpuDecoder | None, gpu_decode_off: str | None, fingerprint: str = "") -> None:
        self.name, self.version = name, version
        self.backend, self.runner, self.thread, self.metrics = backend, runner, thread, metrics
        self.pool, self.store, self.max_pixels = pool, store, max_pixels
        self.gpu, self.gpu_decode_off = gpu, gpu_decode_off
        self.fingerprint = fingerprint  # of the files it was loaded from (discovery.fingerprint)
        self.memory_bytes: int | None = None  # RSS it took to load and warm up
        self.state: State = "LOADING"
        self.warm = False
        self.error: str | None = None
        self.crops = Namespaced(store, contract_key(backend.info))  # this contract's crops
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._warmup: asyncio.Task[None] | None = None

    @property
    def info(self) -> ModelInfo:
        return self.backend.info

    @property
    def label(self) -> str:
        return f"{self.name} version {self.version}"

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

    async def warm_up(self) -> bool:
        """One batch through the model (in its thread); READY after it. False (and `error`) when it fails."""
        t0 = time.perf_counter()
        try:
            if isinstance(self.backend, RemoteBackend):
                await self.backend.warmup()
            else:
                await self.runner.call(self.backend.warmup)
        except Exception as e:
            self.error = f"warm-up failed: {' '.join(str(e).split()) or type(e).__name__}"
            log.warning("%s: %s", self.label, self.error)
            return False
        self.warm, self.error, self.state = True, None, "READY"
        self.metrics.ready.set(1)
        log.info("%s warmed up in %.2f s; ready", self.label, time.perf_counter() - t0)
        return True

    def warm_up_soon(self) -> None:
        """Warm up in the background (again, if an earlier warm-up failed)."""
        if self._warmup is None or self._warmup.done():
            self._warmup = asyncio.get_running_loop().create_task(self.warm_up())

    async def readiness(self) -> tuple[bool, str | None]:
        """(ready, why not): warmed up and the backend answers (`Backend.ready`)."""
        if not self.warm:
            if self.error and (self._warmup is None or self._warmup.done()):
                self.warm_up_soon()  # try again
            return False, self.error or "warming up"
        try:
            if isinstance(self.backend, RemoteBackend):
                ok = await self.backend.ready()
            else:
                ok = self.backend.ready()
        except Exception as e:
            ok, self.error = False, f"backend not ready: {e}"
        self.metrics.ready.set(int(ok))
        return ok, None if ok else (self.error or f"the {self.backend.name} backend is not ready")

    async def close(self, wait: bool = True) -> None:
        """Finish the requests holding this version (`wait`), then stop its runner, backend and thread."""
        self.state = "UNLOADING"
        if wait:
            await self._idle.wait()
        if self._warmup is not None:
            self._warmup.cancel()
        await self.runner.stop()
        try:
            if isinstance(self.backend, RemoteBackend):
                await self.backend.close()
            else:
                self.backend.close()
        except Exception:
            log.exception("closing %s", self.label)
        self.thread.shutdown(wait=False, cancel_futures=True)
        if self.gpu is not None:
            self.gpu.close()
            self.gpu = None
        self.metrics.remove()

    # ---- work ------------------------------------------------------------------------------------------

    def crop_of(self, image: str) -> Image.Image | None:
        """The model-input crop of an image classified earlier with this contract, or None (503 when the store
        cannot be reached: stores.StoreUnavailableError)."""
        return self.crops.find(image)

    async def decode(self, data: bytes, key: str | None = None, keep: bool = True) -> Decoded:
        """Upload bytes -> id, crop, x [1, 3, H, W], decoded once (none if the crop is in the store); keeps the
        crop for GET /explain. `key`: the bytes' sha256 hex when the upload reader has it already."""
        loop = asyncio.get_running_loop()
        cfg = self.info.preprocess
        if self.gpu is None:
            return await loop.run_in_executor(self.pool, decode, data, cfg, self.max_pixels,
                                              self.crops if keep else None, key)
        t0 = time.perf_counter()
        if not key and keep:
            key = await loop.run_in_executor(self.pool, image_id, data)
        crop = self.crops.get(key) if keep else None  # a store that cannot answer is a miss here
        if crop is None:
            crop = await self.gpu.crop(data)
            if crop is None:  # not for the GPU: the CPU path (and its 4xx answers)
                crop = await loop.run_in_executor(self.pool, decode_crop, data, cfg, self.max_pixels)
            if keep:
                self.crops.put(key, crop)
        x = await loop.run_in_executor(self.pool, input_tensor, crop, cfg)
        return Decoded(key or "", crop, x, (time.perf_counter() - t0) * 1e3)

    async def tensor_of(self, crop: Image.Image) -> np.ndarray:
        return await asyncio.get_running_loop().run_in_executor(self.pool, input_tensor, crop, self.info.preprocess)

    async def overlay(self, crop: Image.Image, heatmap: np.ndarray, alpha: float, colormap: str) -> bytes:
        return await asyncio.get_running_loop().run_in_executor(self.pool, overlay_png, crop, heatmap, alpha,
                                                                colormap)

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

    def embed_task(self) -> Task:
        """The Task for an embedding request, or 400 when the model has no embedding output."""
        if not self.info.embedding_dim:
            raise BadRequestError(f"{self.name} has no embedding output: re-export it with vit-export --outputs "
                                  f"logits,embedding (or serve its checkpoint with the torch backend)")
        return EMBED

    def arriving(self) -> Arrival:
        """Announce a request to the runner before reading and decoding it (`with version.arriving() as a:`)."""
        return self.runner.arriving()

    async def infer(self, task: Task, x: np.ndarray, arrival: Arrival | None = None) -> Result:
        """Run `task` on x [n, 3, H, W] through the runner."""
        try:
            return await self.runner.submit(task, x, arrival)
        except NotImplementedError as e:  # the backend cannot do this task
            raise BadRequestError(str(e)) from e
