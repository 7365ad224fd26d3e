"""JPEG uploads decoded and resized on the GPU, for the gateway when it serves on CUDA.

nvJPEG decodes through `torchvision.io.decode_jpeg(list of byte tensors, device="cuda")`, one call for every
upload waiting (concurrent requests are decoded as one batch); the EXIF orientation is read from the header with
Pillow (no pixel decoded), and the contract's geometry (`vit_serve.preprocess.resized_size`: shortest edge or
squash, then the centre crop, zero-padded when smaller) runs on the GPU with torchvision's antialiased resize.
What comes back is the uint8 model-input crop, from which the gateway makes the input tensor and which it keeps
for `GET /explain`, as on the CPU path.

Every upload the GPU cannot take returns None and the gateway decodes it on the CPU path instead (`decode.decode`),
one image at a time and never failing the others: not a JPEG, a JPEG Pillow's header check refuses (size limits,
corrupt header: the CPU path then gives the proper 4xx before any decode), a colour mode other than RGB or grey
(CMYK), a resize filter torchvision cannot apply to tensors (lanczos, box, hamming), or an nvJPEG error.
`GpuDecoder.fallbacks` counts the reasons. Which decoder a model's uploads get is logged in one line when it
loads (`choose_decoder`: "decode: nvJPEG on cuda:0 (model m)", "decode: CPU, torchvision is not installed ...").

The pixels are close to the CPU path's, not identical: nvJPEG's IDCT and chroma upsampling are not libjpeg's, and
torchvision's resize is not Pillow's (the bound is measured in tests/serve/test_gpu_decode.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image

from vit_serve.preprocess import PreprocessConfig, exif_orientation, open_header, resized_size

log = logging.getLogger("vit_serve.serve")

JPEG_MAGIC = b"\xff\xd8\xff"
# torchvision resizes tensors with these filters (bilinear / bicubic antialiased, as Pillow's).
TENSOR_FILTERS = ("nearest", "bilinear", "bicubic")


def unavailable_reason(device: str, enabled: bool = True) -> str | None:
    """Why uploads cannot be decoded on the GPU for a model on ``device`` ("cpu", "cuda", "cuda:0"; anything else
    names where it runs), or None when they can."""
    if not enabled:
        return "gpu_decode is off (VIT_SERVE_GPU_DECODE=false)"
    if not device.startswith("cuda"):
        return f"the model runs on {device}, not CUDA"
    try:
        import torchvision.io  # noqa: F401
    except ImportError:
        return "torchvision is not installed (pip install torchvision)"
    if not torch.cuda.is_available():
        return "no CUDA device is available to PyTorch"
    return None


def decoder_line(device: str, off: str | None, model: str) -> str:
    """The one line saying which decoder `model`'s uploads get: nvJPEG on `device`, or the CPU and why (`off`)."""
    if off is not None:
        return f"decode: CPU, {off} (model {model})"
    if device == "cuda" and torch.cuda.is_available():
        device = f"cuda:{torch.cuda.current_device()}"
    return f"decode: nvJPEG on {device} (model {model})"


def choose_decoder(device: str, enabled: bool, model: str) -> str | None:
    """`unavailable_reason(device, enabled)`, with the decoder chosen logged in one line (`decoder_line`)."""
    off = unavailable_reason(device, enabled)
    log.info("%s", decoder_line(device, off, model))
    return off


def orient(img: torch.Tensor, orientation: int) -> torch.Tensor:
    """[C, H, W] stored pixels -> upright, for an EXIF orientation 1-8 (as `PIL.ImageOps.exif_transpose`)."""
    if orientation == 2:  # FLIP_LEFT_RIGHT
        return img.flip(-1)
    if orientation == 3:  # ROTATE_180
        return img.flip(-2, -1)
    if orientation == 4:  # FLIP_TOP_BOTTOM
        return img.flip(-2)
    if orientation == 5:  # TRANSPOSE
        return img.transpose(-2, -1)
    if orientation == 6:  # ROTATE_270 (clockwise by 90)
        return torch.rot90(img, -1, (-2, -1))
    if orientation == 7:  # TRANSVERSE
        return img.transpose(-2, -1).flip(-2, -1)
    if orientation == 8:  # ROTATE_90 (counter-clockwise by 90)
        return torch.rot90(img, 1, (-2, -1))
    return img


def resize_crop(img: torch.Tensor, cfg: PreprocessConfig) -> torch.Tensor:
    """uint8 [3, H, W] upright -> uint8 [3, *cfg.input_size]: the contract's resize (antialiased) and centre crop,
    on the tensor's device."""
    import torchvision.transforms.v2.functional as F

    size = resized_size((img.shape[-2], img.shape[-1]), cfg)
    if tuple(img.shape[-2:]) != size:
        img = F.resize(img, list(size), interpolation=F.InterpolationMode(cfg.interpolation), antialias=True)
    return F.center_crop(img, list(cfg.input_size))


def to_pil(crop: torch.Tensor) -> Image.Image:
    """uint8 [3, h, w] (any device) -> an RGB PIL image."""
    return Image.fromarray(np.ascontiguousarray(crop.permute(1, 2, 0).cpu().numpy()), "RGB")


class GpuDecoder:
    """Batched JPEG decode + resize on ``device`` (CUDA when serving; the CPU device works too, for tests)."""

    def __init__(self, cfg: PreprocessConfig, max_pixels: int | None, device: str = "cuda",
                 max_batch: int = 16, on_fallback: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.on_fallback = on_fallback  # e.g. the gateway's Prometheus counter
        self.max_pixels = max_pixels
        self.device = torch.device(device)
        self.max_batch = max_batch
        self.fallbacks: collections.Counter[str] = collections.Counter()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="vit-serve-gpu-decode")
        self._pending: list[tuple[bytes, asyncio.Future[Image.Image | None]]] = []
        self._draining = False
        self._drainer: asyncio.Task[None] | None = None
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    def _fallback(self, reason: str) -> None:
        self.fallbacks[reason] += 1
        if self.on_fallback is not None:
            self.on_fallback(reason)

    def _orientation(self, data: bytes) -> int | None:
        """The upload's EXIF orientation if the GPU can decode it, else None (reason counted)."""
        if not data.startswith(JPEG_MAGIC):
            self._fallback("not a JPEG")
            return None
        if self.cfg.interpolation not in TENSOR_FILTERS:
            self._fallback(f"interpolation {self.cfg.interpolation}")
            return None
        try:
            img = open_header(data, self.max_pixels)  # the size limits, before any pixel is decoded
        except Exception:  # the CPU path gives the proper 413 / 415 / 422
            self._fallback("header refused")
            return None
        if img.format != "JPEG" or img.mode not in ("RGB", "L"):
            self._fallback(f"JPEG mode {img.mode}")
            return None
        return exif_orientation(img)

    def _decode(self, tensors: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """nvJPEG on all of them at once; when that call fails, one by one, so that one bad file fails alone."""
        from torchvision.io import ImageReadMode, decode_jpeg

        try:
            with warnings.catch_warnings():  # torchvision 0.29 marks its decoders deprecated (for torchcodec)
                warnings.simplefilter("ignore", DeprecationWarning)
                return list(decode_jpeg(tensors, mode=ImageReadMode.RGB, device=self.device))
        except Exception:
            if len(tensors) == 1:
                self._fallback("decode_jpeg failed")
                return [None]
        out: list[torch.Tensor | None] = []
        for t in tensors:
            out.extend(self._decode([t]))
        return out

    def crops(self, datas: list[bytes]) -> list[Image.Image | None]:
        """The model-input crop of each upload, None for those the CPU path must decode. Never raises for an
        upload: every failure is that upload's None."""
        out: list[Image.Image | None] = [None] * len(datas)
        todo: list[tuple[int, int, torch.Tensor]] = []
        for i, data in enumerate(datas):
            orientation = self._orientation(data)
            if orientation is not None:
                with warnings.catch_warnings():  # read-only bytes; decode_jpeg never writes its input
                    warnings.simplefilter("ignore", UserWarning)
                    todo.append((i, orientation, torch.frombuffer(data, dtype=torch.uint8)))
        if not todo:
            return out
        ctx = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with torch.inference_mode(), ctx:
            decoded = self._decode([t for _, _, t in todo])
            for (i, orientation, _), img in zip(todo, decoded, strict=True):
                if img is None:
                    continue
                try:
                    out[i] = to_pil(resize_crop(orient(img, orientation), self.cfg))
                except Exception:
                    self._fallback("resize failed")
        return out

    async def crop(self, data: bytes) -> Image.Image | None:
        """`crops` for one upload, batched with every other upload waiting meanwhile (at most max_batch)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Image.Image | None] = loop.create_future()
        self._pending.append((data, fut))
        if not self._draining:
            self._draining = True
            self._drainer = loop.create_task(self._drain())  # a reference, so that it is not collected
        return await fut

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        batch: list[tuple[bytes, asyncio.Future[Image.Image | None]]] = []
        try:
            while self._pending:
                batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
                try:
                    results = await loop.run_in_executor(self._thread, self.crops, [d for d, _ in batch])
                except Exception:  # e.g. the GPU went away: every one of them takes the CPU path
                    self._fallback("batch failed")
                    results = [None] * len(batch)
                for (_, fut), crop in zip(batch, results, strict=True):
                    if not fut.done():
                        fut.set_result(crop)
        finally:  # cancelled (shutdown): nobody waits forever
            self._draining = False
            for _, fut in batch + self._pending:
                if not fut.done():
                    fut.set_result(None)
            self._pending = []
