"""Crash-safe training state: everything needed to continue a run exactly, written atomically.

The file is a plain `torch.save` of tensors, numbers, strings and lists, so it loads with
`torch.load(weights_only=True)`: RNG states are stored as tensors and lists, not numpy objects.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vit_serve.checkpoints.io import atomic_write


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state = {
        "python": list(random.getstate()[1]),  # version 3 Mersenne Twister: (3, tuple of 625 ints, None)
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(float, np_state[2:])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate((3, tuple(state["python"]), None))
    name, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, key.numpy().astype(np.uint32), int(pos), int(has_gauss), cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_state(path: str | Path, **state: Any) -> Path:
    """Write the training state atomically (a crash mid-write leaves the previous file intact)."""
    payload = {**state, "rng": rng_state()}
    return atomic_write(path, lambda tmp: torch.save(payload, tmp), overwrite=True)


def load_state(path: str | Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)
