"""Upload bytes -> model input, and rollout map -> PNG overlay: the CPU work the gateway runs in its decode pool.

Decoding and preprocessing are `vit_serve.preprocess`'s (`load_image`, then `resize_and_crop` and `to_tensor`,
the two halves of `preprocess`), so the served input equals `preprocess(image, cfg)` exactly, on the contract's
decode path (`cfg.decode`, "exact" or "fast"); the crop in the middle, from that one decode, is kept for
`GET /explain` and the overlay, and the input tensor is made from it (one decode per upload; none when the caller
has the crop already: the gateway keeps crops in its image store). On CUDA the crop may come from `gpu_decode`
instead. Decode failures become the runtime's errors here (`vit_serve.runtime.errors`).
"""

from __future__ import annotations

import hashlib
import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from PIL import Image, UnidentifiedImageError

from vit_serve.overlay import overlay
from vit_serve.preprocess import (
    IMAGE_FORMATS,
    ImageDecodeError,
    ImageTooLargeError,
    PreprocessConfig,
    load_image,
    resize_and_crop,
    to_tensor,
)
from vit_serve.runtime.errors import TooLargeError, UnreadableImageError, UnsupportedMediaError

# The 415's list of what uploads may be (`IMAGE_FORMATS`, the formats Pillow is allowed to open them as).
T = TypeVar("T")
ACCEPTED = ", ".join("PPM/PGM/PBM" if f == "PPM" else "WebP" if f == "WEBP" else f for f in IMAGE_FORMATS)


@dataclass(frozen=True)
class Decoded:
    """One upload, ready for the model: id (sha256 hex of the bytes; "" when nobody asked for it), crop (H x W RGB),
    x [1, 3, H, W] float32."""

    id: str
    crop: Image.Image
    x: np.ndarray
    decode_ms: float


def image_id(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def decode_crop(data: bytes, cfg: PreprocessConfig, max_pixels: int) -> Image.Image:
    """Encoded image -> the model-input crop (cfg.input_size, on cfg.decode's path); UnsupportedMediaError,
    UnreadableImageError or TooLargeError (`vit_serve.runtime.errors`) when it cannot be."""
    return _decoded(lambda: resize_and_crop(load_image(data, max_pixels=max_pixels, cfg=cfg), cfg), max_pixels)


def decode_naflex(data: bytes, cfg: PreprocessConfig, max_pixels: int, patch_size: int,
                  max_patches: int) -> np.ndarray:
    """Encoded image -> NaFlex input [1, 1 + max_patches, P*P*3] (`vit_serve.naflex.pack`): the whole image (no
    crop), resized keeping its aspect ratio to at most `max_patches` patches, normalised with cfg's mean and std
    (`naflex.batch_images`, transformers' Siglip2ImageProcessor); the errors of `decode_crop`."""
    rgb = _decoded(lambda: np.asarray(load_image(data, max_pixels=max_pixels)), max_pixels)
    return _naflex_input(rgb, cfg, patch_size, max_patches)


def decode_naflex_upload(data: bytes, cfg: PreprocessConfig, max_pixels: int, patch_size: int, max_patches: int,
                         key: str = "") -> Decoded:
    """`decode_naflex` for the gateway: a `Decoded` whose x is the NaFlex input and whose crop is the whole upload
    as decoded (a NaFlex model sees all of it: nothing is cropped)."""
    t0 = time.perf_counter()
    image = _decoded(lambda: load_image(data, max_pixels=max_pixels), max_pixels)
    x = _naflex_input(np.asarray(image), cfg, patch_size, max_patches)
    return Decoded(key, image, x, (time.perf_counter() - t0) * 1e3)


def _naflex_input(rgb: np.ndarray, cfg: PreprocessConfig, patch_size: int, max_patches: int) -> np.ndarray:
    from vit_serve import naflex  # torch: imported when a NaFlex model needs it

    return naflex.pack(naflex.batch_images([rgb], patch_size, max_patches, cfg.mean, cfg.std)).numpy()


def _decoded(load: Callable[[], T], max_pixels: int) -> T:
    """`load()`, its decode failures as the runtime's errors."""
    try:
        return load()
    except ImageTooLargeError as e:
        size = f"this one has {e.pixels} pixels" if e.pixels else "this one has more"
        raise TooLargeError(f"image too large: the limit is {max_pixels} pixels, width x height "
                            f"(VIT_SERVE_MAX_PIXELS); {size}") from e
    except ImageDecodeError as e:
        if isinstance(e.__cause__, UnidentifiedImageError):
            raise UnsupportedMediaError(f"not an image in a format vit-serve reads ({ACCEPTED})") from e
        raise UnreadableImageError(f"corrupt or truncated image: {e}") from e


def input_tensor(crop: Image.Image, cfg: PreprocessConfig) -> np.ndarray:
    """crop -> [1, 3, H, W] float32 (`vit_serve.preprocess.to_tensor`)."""
    return to_tensor(crop, cfg).numpy()[None]


def decode(data: bytes, cfg: PreprocessConfig, max_pixels: int, key: str = "",
           crop: Image.Image | None = None) -> Decoded:
    """Decode and preprocess one upload; `crop`: its crop when the caller has it already (an image store's), then
    nothing is decoded. `key`: the upload's id (`image_id`, or the caller's slot for it), carried into the
    result ("" when nobody needs it)."""
    t0 = time.perf_counter()
    if crop is None:
        crop = decode_crop(data, cfg, max_pixels)
    return Decoded(key, crop, input_tensor(crop, cfg), (time.perf_counter() - t0) * 1e3)


def display_size(crop_size: tuple[int, int], size: int) -> tuple[int, int]:
    """(W, H) of a picture of `crop_size` (W, H) whose longer side is `size` pixels, the aspect kept."""
    w, h = crop_size
    scale = size / max(w, h)
    return max(1, round(w * scale)), max(1, round(h * scale))


def overlay_png(crop: Image.Image, heatmap: np.ndarray, alpha: float, colormap: str,
                size: int | None = None) -> bytes:
    """The map [gh, gw] blended over the crop (`vit_serve.overlay`), as PNG bytes; `size`: the PNG's longer side
    in pixels (None: the crop's), scaled nearest-neighbour so each of the model's input pixels stays a sharp block
    (a 32 x 32 input is unreadable on a screen at its own size).

    zlib level 1: about 3x faster to encode than PIL's default level 6 for some 10% more bytes, which is the
    better trade on a request's critical path.
    """
    picture = overlay(crop, heatmap, alpha=alpha, colormap=colormap)
    if size is not None and size != max(picture.size):
        picture = picture.resize(display_size(picture.size, size), Image.Resampling.NEAREST)
    buf = io.BytesIO()
    picture.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()
