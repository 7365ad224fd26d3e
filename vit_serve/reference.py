"""A model's reference (`vit_serve.monitor.Reference`) from images: a training run's data, or a folder.

Two disjoint sets are needed: one the Gaussian is fitted on, one that calibrates the OOD threshold and the drift
sample. A model scores the images it was trained on as more typical than new ones from the same distribution
(on the quickstart's digits model, the 95th percentile of its training images' scores flags 12% of the held-out
digits), so `vit-serve train` fits on a sample of the training set and calibrates on its validation split, and a
folder (`vit-export --reference-images`, `vit-serve convert --reference-images`) is split in two halves.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from vit_serve.model import VisionTransformer
from vit_serve.monitor import DEFAULT_QUANTILE, Reference, build_reference

MAX_FIT = 5000  # images the Gaussian is fitted on, at most
MAX_CALIBRATION = 2000
BATCH = 64
MIN_FOLDER_IMAGES = 8  # a folder of fewer cannot be split into a useful fit and calibration


def outputs_of(model: VisionTransformer, batches: Iterable[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """The model's (embeddings [N, E], logits [N, K]) over batches [B, 3, H, W], float32, from one pass each
    (`forward_embedding`: the same embedding the exports' "embedding" output gives)."""
    model.eval()
    device = next(model.parameters()).device
    embs, logits = [], []
    with torch.inference_mode():
        for x in batches:
            lo, e = model.forward_embedding(x.to(device, torch.float32))
            embs.append(e.float().cpu().numpy())
            logits.append(lo.float().cpu().numpy())
    if not embs:
        raise ValueError("a reference needs images; none were given")
    return np.concatenate(embs), np.concatenate(logits)


def _chunks(tensors: Sequence[torch.Tensor]) -> Iterable[torch.Tensor]:
    for i in range(0, len(tensors), BATCH):
        yield torch.stack(list(tensors[i:i + BATCH]))


def _sample(n: int, k: int, seed: int) -> np.ndarray:
    return np.arange(n) if n <= k else np.sort(np.random.default_rng(seed).choice(n, k, replace=False))


def reference_from_datasets(model: VisionTransformer, fit: torch.utils.data.Dataset,
                            calibration: torch.utils.data.Dataset | None, source: str, seed: int = 0,
                            quantile: float = DEFAULT_QUANTILE) -> Reference:
    """From datasets of (tensor [3, H, W], label) preprocessed for evaluation: fit on at most MAX_FIT of `fit`,
    calibrate on at most MAX_CALIBRATION of `calibration` (None: the half of the fit sample it was not fitted on)."""
    def tensors(ds: torch.utils.data.Dataset, idx: np.ndarray) -> list[torch.Tensor]:
        out = []
        for i in idx:
            item = ds[int(i)]
            if item is not None:  # a dataset may skip an unreadable file
                out.append(item[0])
        return out

    fit_idx = _sample(len(fit), MAX_FIT, seed)  # type: ignore[arg-type]
    if calibration is None:
        half = len(fit_idx) // 2
        fit_t = tensors(fit, fit_idx[:half])
        cal_t = tensors(fit, fit_idx[half:])
    else:
        fit_t = tensors(fit, fit_idx)
        cal_t = tensors(calibration, _sample(len(calibration), MAX_CALIBRATION, seed + 1))  # type: ignore[arg-type]
    return _build(model, fit_t, cal_t, source, seed, quantile)


def reference_from_folder(model: VisionTransformer, folder: str | os.PathLike, seed: int = 0,
                          quantile: float = DEFAULT_QUANTILE) -> Reference:
    """From the images directly in `folder` (preprocessed with the model's contract), shuffled with `seed` and
    split in halves: fit on one, calibrate on the other. ValueError for a folder of fewer than
    MIN_FOLDER_IMAGES readable images."""
    from vit_serve.data import find_images
    from vit_serve.preprocess import PreprocessConfig, preprocess

    files = find_images(folder)
    cfg = model.preprocess_cfg or PreprocessConfig(input_size=model.cfg.img_size)
    order = np.random.default_rng(seed).permutation(len(files))
    files = [files[i] for i in order[:MAX_FIT + MAX_CALIBRATION]]
    tensors = []
    for f in files:
        try:
            tensors.append(preprocess(f, cfg))
        except ValueError:  # an unreadable file is left out, as training's loaders do
            continue
    if len(tensors) < MIN_FOLDER_IMAGES:
        raise ValueError(f"{folder}: {len(tensors)} readable images; a reference needs at least "
                         f"{MIN_FOLDER_IMAGES} (half to fit, half to calibrate)")
    half = len(tensors) // 2
    return _build(model, tensors[:half], tensors[half:], f"{len(tensors)} images of {Path(folder).name}", seed,
                  quantile)


def _build(model: VisionTransformer, fit: Sequence[torch.Tensor], calibration: Sequence[torch.Tensor], source: str,
           seed: int, quantile: float) -> Reference:
    fit_e, fit_l = outputs_of(model, _chunks(fit))
    cal_e, cal_l = outputs_of(model, _chunks(calibration))
    return build_reference(fit_e, fit_l, cal_e, cal_l, quantile=quantile, scores=model.cfg.scores, source=source,
                           seed=seed)
