"""The accuracy gate a reduced precision passes at load: top-1 agreement and cosine to fp32 on a fixed set of real
images, judged against the precision's bounds (`vit_serve.accuracy_bounds`: the exporter's and the benchmarks'
too); a precision that misses them is refused with the numbers (`PrecisionRefusedError`) unless forced.

The images (`gate_images`) are scikit-image's sample photos and matplotlib's grace_hopper (whichever is
installed), each in `VIEWS` crops, preprocessed with the model's own contract: real photos, the same every
load. The cosine is of the logits and, where the graph gives one, of the embedding too (the smaller). Where the
model has an explain graph, its rollout maps' largest difference from fp32's is measured and reported beside.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from vit_serve.accuracy_bounds import AccuracyCheck, judge
from vit_serve.preprocess import PreprocessConfig

log = logging.getLogger("vit_serve.runtime")

SKIMAGE_PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "cat", "immunohistochemistry")
# Crops of each photo, (left, top, right, bottom) fractions: the whole, and four overlapping corners.
VIEWS = ((0.0, 0.0, 1.0, 1.0), (0.0, 0.0, 0.7, 0.7), (0.3, 0.0, 1.0, 0.7), (0.0, 0.3, 0.7, 1.0),
         (0.3, 0.3, 1.0, 1.0))
BATCH = 8  # images per run while measuring (bounded memory at any resolution)

# A run of the model: x [B, 3, H, W] -> (logits [B, K], embedding [B, D] or None).
Forward = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray | None]]


class PrecisionRefusedError(ValueError):
    """A precision that missed its accuracy bounds on the gate's images (the message holds the numbers)."""


@dataclass(frozen=True)
class GateResult:
    """The gate's `check` of a model's precision, whether it was `forced` (served although it missed), and the
    largest |difference| of its explain graph's rollout maps from fp32's on the same images (None: no explain
    graph; reported, not judged)."""

    check: AccuracyCheck
    forced: bool = False
    rollout_max_abs: float | None = None

    def to_dict(self) -> dict[str, object]:
        return {**self.check.to_dict(), "forced": self.forced, "rollout_max_abs": self.rollout_max_abs}


def rollout_difference(reference: Callable[[np.ndarray], np.ndarray], candidate: Callable[[np.ndarray], np.ndarray],
                       x: np.ndarray) -> float:
    """The largest |difference| between two explain graphs' rollout maps (x [B, 3, H, W] -> [B, gh, gw]) on `x`."""
    return max(float(np.abs(reference(x[i:i + BATCH]) - candidate(x[i:i + BATCH])).max())
               for i in range(0, len(x), BATCH))


def gate_photos() -> list[np.ndarray]:
    """The built-in photos as HWC uint8 RGB arrays; OSError when neither scikit-image nor matplotlib is there."""
    out: list[np.ndarray] = []
    try:
        import skimage.data

        for name in SKIMAGE_PHOTOS:
            img = np.asarray(getattr(skimage.data, name)())
            out.append(np.repeat(img[..., None], 3, -1) if img.ndim == 2 else img[..., :3])
    except ImportError:
        pass
    try:
        from matplotlib import cbook
        from PIL import Image

        with cbook.get_sample_data("grace_hopper.jpg") as f:
            out.append(np.asarray(Image.open(f).convert("RGB")))
    except ImportError:
        pass
    if not out:
        raise OSError("the accuracy gate needs real photos: install scikit-image (pip install 'vit-serve[openvino]') "
                      "or matplotlib, or serve the precision f32")
    return out


def gate_images(cfg: PreprocessConfig) -> np.ndarray:
    """The gate's fixed images [N, 3, H, W] float32, preprocessed with `cfg` (the model's contract)."""
    from PIL import Image

    from vit_serve.preprocess import preprocess

    rows = []
    for photo in gate_photos():
        h, w = photo.shape[:2]
        for left, top, right, bottom in VIEWS:
            view = photo[int(top * h):int(bottom * h), int(left * w):int(right * w)]
            crop = Image.fromarray(np.ascontiguousarray(view))
            rows.append(preprocess(crop, cfg).numpy())
    return np.stack(rows).astype(np.float32)


def _run(forward: Forward, x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    parts = [forward(x[i:i + BATCH]) for i in range(0, len(x), BATCH)]
    logits = np.concatenate([p[0] for p in parts]).astype(np.float64)
    emb = None if parts[0][1] is None else np.concatenate([p[1] for p in parts]).astype(np.float64)
    return logits, emb


def measure(precision: str, reference: Forward, candidate: Forward, x: np.ndarray) -> AccuracyCheck:
    """`candidate` (in `precision`) against `reference` (fp32) on the images `x`, judged against the precision's
    bounds (`accuracy_bounds.judge`)."""
    ref_logits, ref_emb = _run(reference, x)
    logits, emb = _run(candidate, x)
    embedding = (ref_emb, emb) if ref_emb is not None and emb is not None else None
    return judge(ref_logits, logits, precision, embedding)


def enforce(check: AccuracyCheck, model: str, force: bool, rollout_max_abs: float | None = None) -> GateResult:
    """`check` when it passed; PrecisionRefusedError with its numbers when it missed, unless `force` (then
    logged as a warning and marked forced). `rollout_max_abs`: the explain graph's difference, reported."""
    if check.ok:
        log.info("%s: accuracy gate passed, %s%s", model, check.describe(), "" if rollout_max_abs is None
                 else f"; rollout max |Δ| {rollout_max_abs:.2e}")
        return GateResult(check, rollout_max_abs=rollout_max_abs)
    if not force:
        raise PrecisionRefusedError(f"{model}: against fp32 on the real photos of the accuracy gate, "
                                    f"{check.describe()}: refused; serve it in f32 (precision f32), or force it "
                                    f"(force_precision)")
    log.warning("%s: accuracy gate missed, served as forced: %s", model, check.describe())
    return GateResult(check, forced=True, rollout_max_abs=rollout_max_abs)
