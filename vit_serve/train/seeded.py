"""Per-sample deterministic augmentation: sample i of epoch e always gets the same random crop, flip and
RandAugment draw, wherever it is processed (main process, a loader worker, another rank, a resumed run)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset


class SeededTransform(Dataset):
    """Wraps a dataset that yields (raw image, label) or None, applying `transform` under a per-sample seed."""

    def __init__(self, base: Dataset, transform: Callable[[Any], torch.Tensor], seed: int) -> None:
        self.base, self.transform, self.seed, self.epoch = base, transform, seed, 0
        self.classes = getattr(base, "classes", None)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        item = self.base[index]
        if item is None:  # unreadable image: counted and dropped by the collate function
            return None
        image, label = item
        seed = (self.seed * 1_000_003 + self.epoch * 10_007 + index) % 2**63
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            state = random.getstate()
            random.seed(seed)
            try:
                return self.transform(image), label
            finally:
                random.setstate(state)
