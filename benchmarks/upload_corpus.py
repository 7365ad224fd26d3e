"""A corpus of realistic uploads, built from the photos scikit-image and matplotlib ship (nothing downloaded).

`build(folder)` writes the files and returns {name: path}; the same Pillow gives the same bytes, and files already
there are reused. The benchmarks import it as a sibling module (`python benchmarks/preprocess.py`); tests load
it by path. It lives here, not in the library, because it is benchmark input that tests check, not product code.

| name                    | what                                                                          |
|-------------------------|-------------------------------------------------------------------------------|
| phone_astronaut.jpg     | 12 MP (4032x3024) JPEG q90, 4:2:0, photo upscaled + sensor-like noise         |
| phone_mosaic_exif6.jpg  | 12 MP JPEG q90 stored landscape with EXIF orientation 6 (upright: 3024x4032), |
|                         | a mosaic of the photos at their native resolution (sharp, full-res detail)    |
| uhd_coffee.jpg          | 4K (3840x2160) JPEG q90                                                       |
| progressive_hopper.jpg  | progressive JPEG 2048x1536 q85                                                |
| screenshot.png          | 2560x1440 RGB PNG: flat UI panels, text, a photo                              |
| chelsea.webp            | 1600x1067 WebP q80                                                            |
| thumbnail.jpg           | 160x120 JPEG q85 (smaller than the model input: upscaled by both paths)       |
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

PHONE = (4032, 3024)  # (W, H) of a 12 MP phone camera
UHD = (3840, 2160)


def photos() -> dict[str, Image.Image]:
    """The real photos: scikit-image's astronaut, chelsea, coffee, rocket and matplotlib's grace_hopper (RGB)."""
    import skimage.data
    from matplotlib import cbook

    out = {n: Image.fromarray(getattr(skimage.data, n)()).convert("RGB")
           for n in ("astronaut", "chelsea", "coffee", "rocket")}
    with cbook.get_sample_data("grace_hopper.jpg") as f:
        out["grace_hopper"] = Image.open(f).convert("RGB")
    return out


def _upscaled(img: Image.Image, size: tuple[int, int], noise: float, seed: int) -> Image.Image:
    """Cover-resize to `size` (W, H), centre-cropped, plus Gaussian noise of `noise` levels (sensor-like grain)."""
    w, h = size
    s = max(w / img.width, h / img.height)
    big = img.resize((round(img.width * s), round(img.height * s)), Image.Resampling.BICUBIC)
    left, top = (big.width - w) // 2, (big.height - h) // 2
    a = np.asarray(big.crop((left, top, left + w, top + h)), dtype=np.float32)
    a += np.random.default_rng(seed).normal(0.0, noise, a.shape).astype(np.float32)
    return Image.fromarray(np.clip(a + 0.5, 0, 255).astype(np.uint8))


def _mosaic(ph: dict[str, Image.Image], size: tuple[int, int]) -> Image.Image:
    """Tiles of every photo at native resolution (and some at 2x), so that the file has full-resolution detail."""
    canvas = Image.new("RGB", size, (90, 90, 90))
    tiles = [p for p in ph.values()] + [p.resize((p.width * 2, p.height * 2), Image.Resampling.BICUBIC)
                                        for p in ph.values()]
    x = y = row = 0
    i = 0
    while y < size[1]:
        t = tiles[i % len(tiles)]
        canvas.paste(t, (x, y))
        row = max(row, t.height)
        x += t.width
        i += 1
        if x >= size[0]:
            x, y, row = 0, y + row, 0
    return canvas


def _screenshot(ph: dict[str, Image.Image]) -> Image.Image:
    img = Image.new("RGB", (2560, 1440), (245, 246, 248))
    d = ImageDraw.Draw(img)
    d.rectangle((0, 0, 2560, 64), fill=(32, 33, 36))
    d.rectangle((0, 64, 360, 1440), fill=(230, 232, 236))
    for i in range(24):
        d.text((24, 90 + 40 * i), f"Menu item {i:02d} - settings and preferences", fill=(20, 20, 20))
    for i in range(60):
        d.text((420, 100 + 22 * i), "The quick brown fox jumps over the lazy dog. 0123456789 " * 3,
               fill=(40, 40, 40))
    img.paste(ph["chelsea"].resize((902, 600), Image.Resampling.BICUBIC), (1560, 200))
    d.rectangle((1560, 860, 2462, 940), fill=(26, 115, 232))
    d.text((1600, 890), "Upload", fill=(255, 255, 255))
    return img


def _save(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def _exif(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


def _builders() -> dict[str, Callable[[dict[str, Image.Image]], bytes]]:
    return {
        "phone_astronaut.jpg": lambda ph: _save(_upscaled(ph["astronaut"], PHONE, 3.0, 1), "JPEG", quality=90),
        # A portrait phone shot: the sensor's landscape pixels, rotated for display by the EXIF tag.
        "phone_mosaic_exif6.jpg": lambda ph: _save(_mosaic(ph, (PHONE[1], PHONE[0])).transpose(
            Image.Transpose.ROTATE_90), "JPEG", quality=90, exif=_exif(6)),
        "uhd_coffee.jpg": lambda ph: _save(_upscaled(ph["coffee"], UHD, 2.0, 2), "JPEG", quality=90),
        "progressive_hopper.jpg": lambda ph: _save(_upscaled(ph["grace_hopper"], (2048, 1536), 2.0, 3), "JPEG",
                                                   quality=85, progressive=True),
        "screenshot.png": lambda ph: _save(_screenshot(ph), "PNG"),
        "chelsea.webp": lambda ph: _save(_upscaled(ph["chelsea"], (1600, 1067), 1.5, 4), "WEBP", quality=80),
        "thumbnail.jpg": lambda ph: _save(ph["astronaut"].resize((160, 120), Image.Resampling.LANCZOS), "JPEG",
                                          quality=85),
    }


NAMES: tuple[str, ...] = tuple(_builders())
PHONE_NAMES: tuple[str, ...] = tuple(n for n in NAMES if n.startswith("phone_"))


def build(folder: str | Path, names: tuple[str, ...] = NAMES,
          ph: dict[str, Image.Image] | None = None) -> dict[str, Path]:
    """Write the corpus (or the `names` asked for) into `folder`; returns {name: path}, in NAMES order. `ph`: the
    photos as `photos()` returns them, where scikit-image and matplotlib are not installed."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    builders = _builders()
    unknown = sorted(set(names) - set(builders))
    if unknown:
        raise ValueError(f"unknown corpus file(s) {', '.join(unknown)}; expected some of {', '.join(NAMES)}")
    out = {}
    for name in names:
        path = folder / name
        if not path.exists():
            ph = ph or photos()
            # A temporary name of this process's own: two test workers may build one cached corpus at once.
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(builders[name](ph))
            tmp.replace(path)
        out[name] = path
    return out
