"""Deterministic randomness, so that a resumed run draws exactly what an uninterrupted one would.

Per sample: sample i of epoch e always gets the same random crop, flip and RandAugment draw, wherever it is
processed (main process, a loader worker, another rank, a resumed run). Per optimizer step: dropout, drop-path,
Mixup / CutMix and MPP's corruption draw from torch's RNG seeded with (seed, rank, step), so every rank draws
its own masks, and a run resumed at step s (with any number of processes) continues with the same draws.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset


def step_seed(seed: int, rank: int, step: int) -> int:
    """The RNG seed of optimizer step `step` (0-based) on process `rank`: well mixed (numpy's SeedSequence),
    distinct across ranks and steps."""
    return int(np.random.SeedSequence((seed, rank, step)).generate_state(1, np.uint64)[0]) & (2**63 - 1)


def seed_step(seed: int, rank: int, step: int, device: torch.device) -> None:
    """Seed torch's CPU and CUDA generators (and XLA's, on an XLA device) for one optimizer step."""
    s = step_seed(seed, rank, step)
    torch.manual_seed(s)
    if device.type == "xla":
        from vit_serve.train import xla

        xla.manual_seed(s, device)


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
            # The CPU generator only (the transforms' device): torch.manual_seed also seeds every other device
            # type it knows of, which costs about 1 ms a sample, half of a small model's training step.
            torch.default_generator.manual_seed(seed)
            state = random.getstate()
            random.seed(seed)
            try:
                return self.transform(image), label
            finally:
                random.setstate(state)
