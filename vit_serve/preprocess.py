"""Image -> tensor preprocessing and the preprocessing contract stored with the weights.

Everything a served model needs to turn an uploaded image into its input tensor lives here:

* :class:`PreprocessConfig` is the contract saved in checkpoint metadata (input size, normalisation,
  resize filter, crop percentage and crop mode).
* :func:`load_image` decodes bytes / paths / PIL images into an 8-bit RGB PIL image, defensively.
* :func:`resize_and_crop` and :func:`to_tensor` reproduce timm's eval transform bit-for-bit.
* :func:`preprocess` is the one function that chains them; :func:`preprocess_batch` stacks several.

Two decode paths, chosen by the contract's ``decode``: "exact" is timm's transform bit-for-bit; "fast" decodes
a JPEG at the smallest DCT scale that keeps :data:`FAST_HEADROOM` times the pixels the resize needs
(``Image.draft``), shrinks any image by an integer factor first (Pillow's ``reducing_gap``) and resizes only the
region the centre crop keeps. Geometry (resize size, crop window) is the exact path's.

Only PIL, numpy and torch are needed at runtime; timm/torchvision are used by the tests as the reference.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import re
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

if TYPE_CHECKING:  # torch is imported where a tensor is made: `import vit_serve` (and the CLI's parser) stay light
    import torch

__all__ = [
    "CROP_MODES",
    "DECODES",
    "FAST_HEADROOM",
    "FAST_REDUCING_GAP",
    "IMAGENET_DEFAULT_MEAN",
    "IMAGENET_DEFAULT_STD",
    "IMAGENET_INCEPTION_MEAN",
    "IMAGENET_INCEPTION_STD",
    "IMAGE_FORMATS",
    "INTERPOLATIONS",
    "ImageDecodeError",
    "ImageSource",
    "ImageTooLargeError",
    "PreprocessConfig",
    "draft_size",
    "exif_orientation",
    "load_image",
    "open_header",
    "preprocess",
    "preprocess_batch",
    "resize_and_crop",
    "resized_size",
    "to_tensor",
]

IMAGENET_DEFAULT_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_DEFAULT_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)
IMAGENET_INCEPTION_MEAN: tuple[float, float, float] = (0.5, 0.5, 0.5)
IMAGENET_INCEPTION_STD: tuple[float, float, float] = (0.5, 0.5, 0.5)

# Same name -> PIL filter mapping as timm's str_to_pil_interp / torchvision's pil_modes_mapping.
_PIL_FILTERS: dict[str, Image.Resampling] = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
    "box": Image.Resampling.BOX,
    "hamming": Image.Resampling.HAMMING,
}
INTERPOLATIONS: tuple[str, ...] = tuple(_PIL_FILTERS)
CROP_MODES: tuple[str, ...] = ("center", "squash")
DECODES: tuple[str, ...] = ("exact", "fast")
# Fast path: a JPEG is decoded at a DCT scale leaving at least FAST_HEADROOM x the resize's size, so the final
# filter still has real pixels to antialias from; any image is first shrunk by an integer factor (box average)
# only as far as FAST_REDUCING_GAP x the output size. Measured with benchmarks/preprocess.py on the upload
# corpus at 224: headroom 1.5 decodes a 12 MP JPEG at 1/8 (PSNR 45-48 dB against exact, ~7x faster); 2.0 at
# 1/4 (54 dB, ~4.5x: the 1/4-scale decode alone costs most of that); 1.0 gives 1/8 too but a 4K JPEG drops from
# 1/4 to 1/8 (44.5 dB instead of 53).
FAST_HEADROOM: float = 1.5
FAST_REDUCING_GAP: float = 3.0

ImageSource = Image.Image | bytes | bytearray | memoryview | str | os.PathLike[str]


class ImageDecodeError(ValueError):
    """The input could not be decoded as an image (corrupt, truncated, empty or not an image)."""


class ImageTooLargeError(ValueError):
    """The image has more pixels than allowed (``max_pixels`` or PIL's decompression-bomb limit); ``pixels``:
    its width x height where known."""

    def __init__(self, message: str, pixels: int | None = None) -> None:
        super().__init__(message)
        self.pixels = pixels


def _bomb_pixels(exc: BaseException) -> int | None:
    """The image's pixel count in PIL's decompression-bomb message ("Image size (N pixels) exceeds ...")."""
    found = re.search(r"\((\d+) pixels\)", str(exc))
    return int(found.group(1)) if found else None


# --------------------------------------------------------------------------------------------------------
# The contract
# --------------------------------------------------------------------------------------------------------


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


@dataclass(frozen=True)
class PreprocessConfig:
    """Preprocessing contract stored in checkpoint metadata.

    Attributes:
        input_size: model input (H, W) in pixels.
        mean, std: per-channel RGB normalisation applied to values in [0, 1].
        interpolation: PIL resize filter, one of :data:`INTERPOLATIONS`.
        crop_pct: fraction of the resized image kept by the centre crop, in (0, 1].
        crop_mode: "center" (resize the shorter side to size / crop_pct keeping aspect ratio, then
            centre-crop, as timm) or "squash" (resize each edge to size / crop_pct, then centre-crop).
        decode: "exact" (timm's transform, bit for bit) or "fast" (DCT-domain JPEG downscaling, integer
            reduction before the filter, resizing only the cropped region). Stored contracts without it are
            "exact".
    """

    input_size: tuple[int, int] = (224, 224)
    mean: tuple[float, float, float] = IMAGENET_INCEPTION_MEAN
    std: tuple[float, float, float] = IMAGENET_INCEPTION_STD
    interpolation: str = "bicubic"
    crop_pct: float = 0.9
    crop_mode: str = "center"
    decode: str = "exact"

    def __post_init__(self) -> None:
        # Coerce list inputs (e.g. from JSON) to tuples so the frozen config stays hashable.
        size = self.input_size
        if not isinstance(size, (tuple, list)) or len(size) != 2 or not all(_is_int(v) for v in size):
            raise ValueError(f"input_size must be a pair of integers (H, W), got {size!r}")
        if size[0] <= 0 or size[1] <= 0:
            raise ValueError(f"input_size must be positive, got {tuple(size)!r}")
        object.__setattr__(self, "input_size", (int(size[0]), int(size[1])))

        for name in ("mean", "std"):
            vals = getattr(self, name)
            if not isinstance(vals, (tuple, list)) or len(vals) != 3:
                raise ValueError(f"{name} must have exactly 3 values (one per RGB channel), got {vals!r}")
            if not all(_is_real(v) and math.isfinite(v) for v in vals):
                raise ValueError(f"{name} must contain finite numbers, got {vals!r}")
            object.__setattr__(self, name, tuple(float(v) for v in vals))
        if any(v <= 0 for v in self.std):
            raise ValueError(f"std values must be > 0, got {self.std!r}")

        if self.interpolation not in _PIL_FILTERS:
            raise ValueError(
                f"unknown interpolation {self.interpolation!r}; expected one of {', '.join(INTERPOLATIONS)}"
            )
        if not _is_real(self.crop_pct) or not (0.0 < self.crop_pct <= 1.0):
            raise ValueError(f"crop_pct must be a number in (0, 1], got {self.crop_pct!r}")
        object.__setattr__(self, "crop_pct", float(self.crop_pct))
        if self.crop_mode not in CROP_MODES:
            raise ValueError(f"unknown crop_mode {self.crop_mode!r}; expected one of {', '.join(CROP_MODES)}")
        if self.decode not in DECODES:
            raise ValueError(f"unknown decode {self.decode!r}; expected one of {', '.join(DECODES)}")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (tuples become lists)."""
        return {
            "input_size": list(self.input_size),
            "mean": list(self.mean),
            "std": list(self.std),
            "interpolation": self.interpolation,
            "crop_pct": self.crop_pct,
            "crop_mode": self.crop_mode,
            "decode": self.decode,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PreprocessConfig:
        """Build from a dict as written by :meth:`to_dict`; missing keys take defaults, unknown keys fail."""
        if not isinstance(d, Mapping):
            raise TypeError(f"PreprocessConfig.from_dict expects a mapping, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise ValueError(
                f"unknown PreprocessConfig key(s): {', '.join(unknown)}; expected a subset of {sorted(known)}"
            )
        return cls(**dict(d))

    def with_size(self, h: int, w: int) -> PreprocessConfig:
        """Copy of this config with ``input_size=(h, w)``."""
        return dataclasses.replace(self, input_size=(h, w))

    def with_decode(self, decode: str | None) -> PreprocessConfig:
        """Copy of this config with ``decode`` (None keeps this one's)."""
        return self if decode is None or decode == self.decode else dataclasses.replace(self, decode=decode)


# --------------------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------------------


def _one_line(exc: BaseException) -> str:
    msg = " ".join(str(exc).split())
    return msg or type(exc).__name__


def _check_pixels(img: Image.Image, max_pixels: int | None) -> None:
    if max_pixels is None:
        return
    w, h = img.size
    if w * h > max_pixels:
        raise ImageTooLargeError(f"image has {w * h} pixels ({w}x{h}), more than max_pixels={max_pixels}", w * h)


# The formats an encoded image is opened as (Pillow's `formats=`): photo and web formats. Others (EPS, which runs
# Ghostscript, and ICO, TGA, PCX, PSD, ...) are refused as unrecognized; PPM is Pillow's plugin for PPM, PGM, PBM.
IMAGE_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF", "PPM")


@contextmanager
def _pil_errors() -> Iterator[None]:
    """PIL's errors while opening or decoding pixels, raised as ours (MemoryError is left alone)."""
    try:
        yield
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageTooLargeError(_one_line(e), _bomb_pixels(e)) from e
    except UnidentifiedImageError as e:
        raise ImageDecodeError("cannot decode image: unrecognized or unsupported image format") from e
    except MemoryError:
        raise
    except Exception as e:  # PIL plugins raise a zoo of types (OSError, SyntaxError, struct.error, ...)
        raise ImageDecodeError(f"cannot decode image: {_one_line(e)}") from e


def _open(fp: Any, max_pixels: int | None, cfg: PreprocessConfig | None = None) -> Image.Image:
    """Open ``fp`` with PIL (header only) and check its size; with a "fast" ``cfg``, set a JPEG's DCT scale.

    Both size checks (``max_pixels`` and PIL's decompression-bomb limit, raised by ``Image.open``) see the
    header's full size: the draft, which shrinks ``img.size``, comes after them.
    """
    with _pil_errors():
        img = Image.open(fp, formats=IMAGE_FORMATS)
    _check_pixels(img, max_pixels)  # before any pixel data is decoded
    if cfg is not None and cfg.decode == "fast" and img.format == "JPEG":
        _draft(img, cfg)
    return img


def _load(img: Image.Image) -> Image.Image:
    """Force the pixel decode, with PIL's errors as ours."""
    with _pil_errors():
        img.load()
    return img


def _open_and_load(fp: Any, max_pixels: int | None, cfg: PreprocessConfig | None = None) -> Image.Image:
    return _load(_open(fp, max_pixels, cfg))


# What reading broken EXIF metadata raises; such metadata counts as no orientation.
_EXIF_ERRORS = (OSError, SyntaxError, ValueError, KeyError, IndexError, TypeError, struct.error)


def exif_orientation(img: Image.Image) -> int:
    """The EXIF orientation tag (1-8) of an opened image, 1 when absent or unreadable (read from the header)."""
    try:
        return int(img.getexif().get(0x0112, 1))
    except _EXIF_ERRORS:
        return 1


def open_header(data: bytes, max_pixels: int | None = None) -> Image.Image:
    """``data`` opened by PIL, header only (no pixel decoded), after the size checks :func:`load_image` makes;
    its errors are :func:`load_image`'s. For decoders other than PIL's (the gateway's GPU path)."""
    if not data:
        raise ImageDecodeError("cannot decode image: empty input")
    return _open(io.BytesIO(data), max_pixels)


def draft_size(size_hw: tuple[int, int], cfg: PreprocessConfig) -> tuple[int, int]:
    """The smallest (H, W) a decode of an image of ``size_hw`` (upright) may return on the fast path:
    :data:`FAST_HEADROOM` x what ``cfg``'s resize produces from it, never more than the image itself."""
    h_r, w_r = resized_size(size_hw, cfg)
    return min(size_hw[0], math.ceil(h_r * FAST_HEADROOM)), min(size_hw[1], math.ceil(w_r * FAST_HEADROOM))


def _draft(img: Image.Image, cfg: PreprocessConfig) -> None:
    """Ask libjpeg for the smallest 1/2, 1/4 or 1/8 scale that still covers :func:`draft_size`."""
    w, h = img.size
    transposed = exif_orientation(img) in (5, 6, 7, 8)  # stored sideways: the upright image is h x w
    need_h, need_w = draft_size((w, h) if transposed else (h, w), cfg)
    if transposed:
        need_h, need_w = need_w, need_h
    img.draft(None, (need_w, need_h))  # a no-op on multi-tile or already-configured images


def _exif_transpose(img: Image.Image) -> Image.Image:
    if exif_orientation(img) not in (2, 3, 4, 5, 6, 7, 8):
        return img  # ImageOps.exif_transpose would return a full-size copy
    try:
        out = ImageOps.exif_transpose(img)
    except _EXIF_ERRORS:
        # Broken EXIF metadata should not make otherwise-valid pixels unusable; treat as "no orientation".
        return img
    return img if out is None else out


def _composite_over_white(rgb: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """Straight-alpha composite over white: round((c * a + 255 * (255 - a)) / 255), all in uint8 range.

    uint16 is wide enough: c * a + 255 * (255 - a) + 127 <= 255 * 255 + 127 < 2**16.
    """
    a = alpha.astype(np.uint16)[..., None]
    out = rgb.astype(np.uint16)
    out *= a
    np.subtract(255, a, out=a)
    a *= 255
    out += a
    out += 127
    out //= 255
    return out.astype(np.uint8)


# Pixel conversions through numpy run on bands of about this many pixels, so that their temporaries (several
# bytes a pixel) stay small next to the image itself, whatever its size.
_BAND_PIXELS = 1 << 20


def _banded(img: Image.Image, fn: Callable[[Image.Image], np.ndarray]) -> Image.Image:
    """A new RGB image, ``fn`` (a band of ``img`` -> uint8 [h, w, 3]) applied to each band of rows."""
    w, h = img.size
    rows = max(1, _BAND_PIXELS // max(1, w))
    if rows >= h:
        return Image.fromarray(fn(img))
    out = Image.new("RGB", img.size)
    for top in range(0, h, rows):
        out.paste(Image.fromarray(fn(img.crop((0, top, w, min(h, top + rows))))), (0, top))
    return out


def _gray16(band: Image.Image) -> np.ndarray:
    a = np.asarray(band)
    a = np.clip(a, 0, 65535).astype(np.int32)
    a += 128
    a //= 257  # == round(a / 257); exact halves cannot occur
    return np.repeat(a.astype(np.uint8)[..., None], 3, axis=-1)


def _gray_float(band: Image.Image) -> np.ndarray:
    a = np.nan_to_num(np.asarray(band, dtype=np.float64), nan=0.0, posinf=255.0, neginf=0.0)
    g = np.rint(np.clip(a, 0.0, 255.0, out=a), out=a).astype(np.uint8)
    return np.repeat(g[..., None], 3, axis=-1)


def _premultiplied(band: Image.Image) -> np.ndarray:
    # Premultiplied alpha: over white, c_out = c_premult + (255 - a). PIL cannot convert "La" at all.
    a = np.asarray(band).astype(np.int32)
    colour = a[..., :-1] if band.mode == "RGBa" else np.repeat(a[..., :1], 3, axis=-1)
    return np.clip(colour + (255 - a[..., -1:]), 0, 255).astype(np.uint8)


def _transparent(band: Image.Image) -> np.ndarray:
    rgba = np.asarray(band if band.mode == "RGBA" else band.convert("RGBA"))
    return _composite_over_white(rgba[..., :3], rgba[..., 3])


def _to_rgb(img: Image.Image) -> Image.Image:
    """Convert any PIL mode to 8-bit RGB (see :func:`load_image` for the rules).

    Conversions through numpy go band by band (:func:`_banded`): the only full-size allocation is the result.
    """
    mode = img.mode
    if mode == "RGB" and not img.has_transparency_data:
        return img
    if mode in ("1", "L") and not img.has_transparency_data:
        return img.convert("RGB")
    if mode.startswith("I;16") or mode == "I":
        # PIL's convert("RGB") clips 16-bit values at 255; scale the 0..65535 range to 0..255 instead.
        return _banded(img, _gray16)
    if mode == "F":
        return _banded(img, _gray_float)
    if mode in ("La", "RGBa"):
        return _banded(img, _premultiplied)
    if img.has_transparency_data:
        # RGBA, LA, PA, P with transparency / RGBA palette, and L/RGB with a tRNS colour key.
        return _banded(img, _transparent)
    # P without transparency, CMYK, YCbCr, LAB, HSV, RGBX, ...
    try:
        return img.convert("RGB")
    except (ValueError, OSError) as e:
        reason = f"cannot convert mode {mode!r} to RGB ({_one_line(e)})"
        raise ImageDecodeError(f"cannot decode image: {reason}") from e


def load_image(
    src: ImageSource, max_pixels: int | None = None, *, cfg: PreprocessConfig | None = None
) -> Image.Image:
    """Decode ``src`` into an RGB PIL image with EXIF orientation applied.

    Args:
        src: a PIL image, encoded image bytes (``bytes``/``bytearray``/``memoryview``) or a file path.
            A path that cannot be opened raises the usual ``OSError`` (e.g. ``FileNotFoundError``).
        max_pixels: if given, images with width * height above it raise :class:`ImageTooLargeError`;
            for encoded input this is checked from the header, before any pixel data is decoded.
        cfg: the contract the image is decoded for. With ``cfg.decode == "fast"`` an encoded JPEG is decoded
            at a reduced DCT scale (at least :func:`draft_size`); otherwise (and for PIL images) at full size.

    Mode handling:
        * "RGB" is kept; "L" and "1" are replicated to 3 channels.
        * Anything with alpha ("RGBA", "LA", "PA", "La", "RGBa", "P" with transparency, L/RGB with a
          PNG tRNS key) is alpha-composited over a **white** background.
        * "P", "CMYK", "YCbCr", "LAB", "HSV", "RGBX" use PIL's ``convert("RGB")``.
        * 16-bit greyscale ("I;16", "I;16B", "I;16L", "I;16N") is scaled to 8 bits as round(v / 257);
          32-bit "I" is clipped to 0..65535 first (it normally holds 16-bit PNG data), then scaled alike.
        * "F" (float) is clipped to 0..255 and rounded (NaN -> 0).
        * Multi-frame images (GIF, APNG, TIFF) use their first frame; ICC profiles are ignored.

    Raises:
        ImageDecodeError: corrupt, truncated, empty or non-image input, or a format outside
            :data:`IMAGE_FORMATS` (one-line message).
        ImageTooLargeError: more than ``max_pixels`` pixels, or PIL's decompression-bomb limit hit.
        TypeError: ``src`` is of an unsupported type.
    """
    if max_pixels is not None and (not _is_int(max_pixels) or max_pixels <= 0):
        raise ValueError(f"max_pixels must be a positive integer or None, got {max_pixels!r}")

    if isinstance(src, Image.Image):
        _check_pixels(src, max_pixels)
        img = _load(src)  # a lazily opened image may still fail to decode here
    elif isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src)
        if not data:
            raise ImageDecodeError("cannot decode image: empty input")
        img = _open_and_load(io.BytesIO(data), max_pixels, cfg)
    elif isinstance(src, (str, os.PathLike)):
        # Open the file ourselves so a missing/unreadable path stays an OSError, not a decode error.
        with open(src, "rb") as f:
            return _to_rgb(_exif_transpose(_open_and_load(f, max_pixels, cfg)))
    else:
        raise TypeError(
            "image must be a PIL.Image.Image, bytes, bytearray, memoryview, str or os.PathLike, "
            f"got {type(src).__name__}"
        )

    # exif_transpose drops the orientation tag from its result, so applying it to an already
    # transposed PIL image is a no-op: bytes, path and Image.open(...) inputs all agree.
    img = _exif_transpose(img)
    return _to_rgb(img)


# --------------------------------------------------------------------------------------------------------
# Geometry (mirrors timm 1.0.31 transforms_imagenet_eval + torchvision's PIL code path)
# --------------------------------------------------------------------------------------------------------


def _resize_exact(img: Image.Image, size_hw: tuple[int, int], interpolation: str) -> Image.Image:
    # torchvision.transforms.functional.resize returns the input untouched when the size already matches.
    if (img.height, img.width) == tuple(size_hw):
        return img
    return img.resize((size_hw[1], size_hw[0]), _PIL_FILTERS[interpolation])


def _shorter_side_size(hw: tuple[int, int], short_target: int) -> tuple[int, int]:
    """torchvision ``_compute_resized_output_size`` for an int size (long side truncated with int())."""
    h, w = hw
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = short_target, int(short_target * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    return new_h, new_w


def _keep_ratio_size(hw: tuple[int, int], target_hw: tuple[int, int]) -> tuple[int, int]:
    """timm ``ResizeKeepRatio.get_params`` with longest=0 (shorter side fits), no randomness."""
    h, w = hw
    ratio = min(h / target_hw[0], w / target_hw[1])
    return round(h / ratio), round(w / ratio)  # Python's round-half-even, as timm


def resized_size(hw: tuple[int, int], cfg: PreprocessConfig) -> tuple[int, int]:
    """(H, W) of the resize before the centre crop, for an upright image of (H, W) ``hw`` (both decode paths).

    "center": scale = floor(size / crop_pct) per edge; if both scales are equal the shorter side is resized to
    it (torchvision ``Resize(int)``), otherwise timm's ``ResizeKeepRatio`` fits the shorter side.
    "squash": exactly the scale size.
    """
    size = cfg.input_size
    scale = (math.floor(size[0] / cfg.crop_pct), math.floor(size[1] / cfg.crop_pct))
    if cfg.crop_mode == "squash":
        return scale
    if scale[0] == scale[1]:
        return _shorter_side_size(hw, scale[0])
    return _keep_ratio_size(hw, scale)


def _center_crop(img: Image.Image, size_hw: tuple[int, int]) -> Image.Image:
    """torchvision ``center_crop`` on PIL: zero-pad when smaller than the crop, then crop."""
    crop_h, crop_w = size_hw
    h, w = img.height, img.width
    if crop_w > w or crop_h > h:
        pad_ltrb = (
            (crop_w - w) // 2 if crop_w > w else 0,
            (crop_h - h) // 2 if crop_h > h else 0,
            (crop_w - w + 1) // 2 if crop_w > w else 0,
            (crop_h - h + 1) // 2 if crop_h > h else 0,
        )
        img = ImageOps.expand(img, border=pad_ltrb, fill=0)
        h, w = img.height, img.width
        if crop_w == w and crop_h == h:
            return img
    top = round((h - crop_h) / 2.0)  # torchvision: int(round(...)), Python's round-half-even
    left = round((w - crop_w) / 2.0)
    return img.crop((left, top, left + crop_w, top + crop_h))


def resize_and_crop(img: Image.Image, cfg: PreprocessConfig) -> Image.Image:
    """Resize and centre-crop ``img`` to ``cfg.input_size`` (H, W); the mode stays that of ``img``.

    "exact" does what timm's eval transform does (see :func:`resized_size`, then torchvision ``CenterCrop``).
    "fast" keeps that geometry but filters only the window the crop keeps, after an integer box reduction
    (Pillow's ``reducing_gap``).
    """
    resized = resized_size((img.height, img.width), cfg)
    if cfg.decode == "fast":
        window = _crop_window(img, resized, cfg.input_size)
        if window is not None:
            return img.resize((cfg.input_size[1], cfg.input_size[0]), _PIL_FILTERS[cfg.interpolation],
                              box=window, reducing_gap=FAST_REDUCING_GAP)
    return _center_crop(_resize_exact(img, resized, cfg.interpolation), cfg.input_size)


def _crop_window(img: Image.Image, resized_hw: tuple[int, int], crop_hw: tuple[int, int]
                 ) -> tuple[float, float, float, float] | None:
    """The centre crop of a resize to ``resized_hw``, in ``img``'s pixel coordinates (None: it needs padding)."""
    (h_r, w_r), (crop_h, crop_w) = resized_hw, crop_hw
    if crop_h > h_r or crop_w > w_r:
        return None
    top, left = round((h_r - crop_h) / 2.0), round((w_r - crop_w) / 2.0)  # as _center_crop
    sy, sx = img.height / h_r, img.width / w_r
    return left * sx, top * sy, (left + crop_w) * sx, (top + crop_h) * sy


# --------------------------------------------------------------------------------------------------------
# Tensor conversion and the one entry point
# --------------------------------------------------------------------------------------------------------


def to_tensor(img: Image.Image, cfg: PreprocessConfig) -> torch.Tensor:
    """RGB PIL image -> float32 tensor [3, H, W], as torchvision ``ToTensor`` + ``Normalize``.

    Values are uint8 / 255 then (x - mean) / std, all in float32.
    """
    import torch

    if img.mode != "RGB":
        raise ValueError(f"to_tensor expects an RGB image, got mode {img.mode!r}; use load_image first")
    arr = np.array(img, dtype=np.uint8, copy=True)  # [H, W, 3]
    t = torch.from_numpy(arr).permute(2, 0, 1).contiguous().to(dtype=torch.float32).div(255)
    mean = torch.tensor(cfg.mean, dtype=torch.float32).view(-1, 1, 1)
    std = torch.tensor(cfg.std, dtype=torch.float32).view(-1, 1, 1)
    return t.sub_(mean).div_(std)


def preprocess(image: ImageSource, cfg: PreprocessConfig, max_pixels: int | None = None) -> torch.Tensor:
    """Decode, resize, crop and normalise one image into a float32 tensor of shape [3, H, W].

    ``(H, W) = cfg.input_size``. With ``cfg.decode == "exact"`` the result equals timm's
    ``create_transform(**resolve_data_config({}, pretrained_cfg=...))`` eval pipeline applied to the RGB image
    returned by :func:`load_image` (bit-identical on PIL's resize path); "fast" approximates it (see the module
    docstring). Errors are those of :func:`load_image`.
    """
    return to_tensor(resize_and_crop(load_image(image, max_pixels, cfg=cfg), cfg), cfg)


def preprocess_batch(
    images: Iterable[ImageSource], cfg: PreprocessConfig, max_pixels: int | None = None
) -> torch.Tensor:
    """:func:`preprocess` each image and stack: float32 tensor [B, 3, H, W] (B may be 0)."""
    import torch

    tensors = [preprocess(im, cfg, max_pixels) for im in images]
    if not tensors:
        return torch.empty((0, 3, *cfg.input_size), dtype=torch.float32)
    return torch.stack(tensors)
