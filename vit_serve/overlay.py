"""Heat-map overlays for the serving path: colourise a patch-grid relevance map and blend it over the image.

Only PIL and numpy (torch tensors are accepted but not required): the server imports this module, and must not
need matplotlib. Two colour maps are built in: "jet" (the classic piecewise-linear MATLAB / matplotlib
definition) and "inferno" (matplotlib's 256-entry table, stored below as 768 bytes of hex).

The image given to :func:`overlay` is the model-input crop, i.e. what
``vit_serve.preprocess.resize_and_crop(load_image(src), cfg)`` returns: the [gh, gw] patch grid covers that
crop exactly (patch (i, j) is pixels [i*P, (i+1)*P) x [j*P, (j+1)*P)), so the upsampled map lies on it without
any offset. Overlaying onto the original, uncropped image would misplace the map.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image

__all__ = ["COLORMAPS", "colormap", "heatmap_image", "normalize", "overlay", "to_png"]

# matplotlib's "jet" (= MATLAB's classic jet): per channel, (x, value) breakpoints of a piecewise-linear ramp.
_JET_SEGMENTS: dict[str, tuple[tuple[float, float], ...]] = {
    "red": ((0.0, 0.0), (0.35, 0.0), (0.66, 1.0), (0.89, 1.0), (1.0, 0.5)),
    "green": ((0.0, 0.0), (0.125, 0.0), (0.375, 1.0), (0.64, 1.0), (0.91, 0.0), (1.0, 0.0)),
    "blue": ((0.0, 0.5), (0.11, 1.0), (0.34, 1.0), (0.65, 0.0), (1.0, 0.0)),
}

# matplotlib's "inferno", 256 RGB entries as uint8 (round(255 * value)), generated once with
# np.round(matplotlib.colormaps["inferno"](np.arange(256))[:, :3] * 255).astype(np.uint8).tobytes().hex().
_INFERNO_HEX = (
    "00000401000501010601010802010a02020c02020e03021004031204031405041706041907051b08051d09061f0a0722"
    "0b07240c08260d08290e092b10092d110a30120a32140b34150b37160b39180c3c190c3e1b0c411c0c431e0c451f0c48"
    "210c4a230c4c240c4f260c51280b53290b552b0b572d0b592f0a5b310a5c320a5e340a5f3609613809623909633b0964"
    "3d09653e0966400a67420a68440a68450a69470b6a490b6a4a0c6b4c0c6b4d0d6c4f0d6c510e6c520e6d540f6d550f6d"
    "57106e59106e5a116e5c126e5d126e5f136e61136e62146e64156e65156e67166e69166e6a176e6c186e6d186e6f196e"
    "71196e721a6e741a6e751b6e771c6d781c6d7a1d6d7c1d6d7d1e6d7f1e6c801f6c82206c84206b85216b87216b88226a"
    "8a226a8c23698d23698f24699025689225689326679526679727669827669a28659b29649d29649f2a63a02a63a22b62"
    "a32c61a52c60a62d60a82e5fa92e5eab2f5ead305dae305cb0315bb1325ab3325ab43359b63458b73557b93556ba3655"
    "bc3754bd3853bf3952c03a51c13a50c33b4fc43c4ec63d4dc73e4cc83f4bca404acb4149cc4248ce4347cf4446d04545"
    "d24644d34743d44842d54a41d74b3fd84c3ed94d3dda4e3cdb503bdd513ade5238df5337e05536e15635e25734e35933"
    "e45a31e55c30e65d2fe75e2ee8602de9612bea632aeb6429eb6628ec6726ed6925ee6a24ef6c23ef6e21f06f20f1711f"
    "f1731df2741cf3761bf37819f47918f57b17f57d15f67e14f68013f78212f78410f8850ff8870ef8890cf98b0bf98c0a"
    "f98e09fa9008fa9207fa9407fb9606fb9706fb9906fb9b06fb9d07fc9f07fca108fca309fca50afca60cfca80dfcaa0f"
    "fcac11fcae12fcb014fcb216fcb418fbb61afbb81dfbba1ffbbc21fbbe23fac026fac228fac42afac62df9c72ff9c932"
    "f9cb35f8cd37f8cf3af7d13df7d340f6d543f6d746f5d949f5db4cf4dd4ff4df53f4e156f3e35af3e55df2e661f2e865"
    "f2ea69f1ec6df1ed71f1ef75f1f179f2f27df2f482f3f586f3f68af4f88ef5f992f6fa96f8fb9af9fc9dfafda1fcffa4"
)


def _jet_table() -> np.ndarray:
    x = np.arange(256) / 255.0
    chans = [np.interp(x, *zip(*_JET_SEGMENTS[c], strict=True)) for c in ("red", "green", "blue")]
    return np.round(np.stack(chans, axis=-1) * 255).astype(np.uint8)


_TABLES: dict[str, np.ndarray] = {
    "jet": _jet_table(),
    "inferno": np.frombuffer(bytes.fromhex(_INFERNO_HEX), dtype=np.uint8).reshape(256, 3).copy(),
}
COLORMAPS: tuple[str, ...] = tuple(_TABLES)


def _table(name: str) -> np.ndarray:
    try:
        return _TABLES[name]
    except KeyError:
        raise ValueError(f"unknown colormap {name!r}; expected one of {', '.join(COLORMAPS)}") from None


def colormap(values: np.ndarray, name: str = "jet") -> np.ndarray:
    """Colourise values in [0, 1]: [...] float -> [..., 3] uint8 RGB.

    A 256-entry lookup table indexed as matplotlib does (index = floor(v * 256), clipped to 0..255), so the
    colours equal matplotlib's to rounding. Values outside [0, 1] are clipped; NaN maps to the lowest colour.
    """
    table = _table(name)
    v = np.nan_to_num(np.asarray(values, dtype=np.float64), nan=0.0, posinf=1.0, neginf=0.0)
    idx = np.clip(np.floor(v * 256.0), 0, 255).astype(np.intp)
    return table[idx]


def _as_map(heatmap: Any) -> np.ndarray:
    """A torch tensor or array [gh, gw] (or [1, gh, gw]) -> float64 numpy [gh, gw]."""
    if hasattr(heatmap, "detach"):  # torch.Tensor, without importing torch here
        heatmap = heatmap.detach().to("cpu").double().numpy()
    m = np.asarray(heatmap, dtype=np.float64)
    if m.ndim == 3 and m.shape[0] == 1:
        m = m[0]
    if m.ndim != 2 or m.size == 0:
        raise ValueError(f"heatmap must be a non-empty 2-D [gh, gw] map, got shape {tuple(m.shape)}")
    return m


def normalize(heatmap: Any) -> np.ndarray:
    """Min-max scale a map to [0, 1]: [gh, gw] (numpy or torch; [1, gh, gw] accepted) -> float64 [gh, gw].

    A constant map gives zeros; non-finite entries are ignored for the range and become 0.
    """
    m = _as_map(heatmap)
    finite = np.isfinite(m)
    if not finite.any():
        return np.zeros_like(m)
    lo, hi = m[finite].min(), m[finite].max()
    out = np.zeros_like(m)
    if hi > lo:
        out[finite] = (m[finite] - lo) / (hi - lo)
    return out


def _upsample(m: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """[gh, gw] in [0, 1] -> [H, W] for size (W, H): bilinear (half-pixel centres), as PIL mode "F"."""
    if (m.shape[1], m.shape[0]) == tuple(size):
        return m
    img = Image.fromarray(m.astype(np.float32)).resize(size, Image.Resampling.BILINEAR)
    return np.clip(np.asarray(img, dtype=np.float64), 0.0, 1.0)


def overlay(image: Image.Image, heatmap: Any, alpha: float = 0.5, colormap: str = "jet") -> Image.Image:
    """Blend a colourised relevance map over `image`: RGB PIL image of the image's size.

    image: the model-input crop (``resize_and_crop`` output, W x H), so that the patch grid maps onto it
    exactly. heatmap: [gh, gw] numpy array or torch tensor over the patch grid (any range; min-max
    normalised here), upsampled bilinearly to H x W. Each pixel is (1 - alpha) * image + alpha * colour;
    alpha = 0 returns the image's pixels unchanged.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    colours = _colourise(_upsample(normalize(heatmap), rgb.size), colormap).astype(np.float64)
    base = np.asarray(rgb, dtype=np.float64)
    out = np.rint((1.0 - alpha) * base + alpha * colours)
    return Image.fromarray(np.clip(out, 0, 255).astype(np.uint8))


_colourise = colormap  # `overlay` and `heatmap_image` take a parameter named colormap


def heatmap_image(heatmap: Any, size: tuple[int, int] | None = None, colormap: str = "jet") -> Image.Image:
    """The normalised map alone, colourised: RGB PIL image.

    heatmap: [gh, gw]. size: (width, height) as PIL's ``Image.size`` (e.g. ``crop.size``), upsampled
    bilinearly; None keeps one pixel per patch (gw x gh).
    """
    m = normalize(heatmap)
    if size is not None:
        m = _upsample(m, (int(size[0]), int(size[1])))
    return Image.fromarray(_colourise(m, colormap))


def to_png(image: Image.Image) -> bytes:
    """Encode a PIL image as PNG bytes."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
