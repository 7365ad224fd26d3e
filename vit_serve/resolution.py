"""Resolutions as people write them: "384" (square) or "384x512" (height x width)."""

from __future__ import annotations

import re

_RESOLUTION = re.compile(r"\s*(\d+)\s*(?:[xX,]\s*(\d+)\s*)?")


def parse_resolution(text: str) -> tuple[int, int]:
    """"384" -> (384, 384); "384x512" (height x width) -> (384, 512). ValueError for anything else."""
    m = _RESOLUTION.fullmatch(text)
    if not m:
        raise ValueError(f"bad resolution {text!r}; use e.g. 384 or 384x512 (height x width)")
    h = int(m[1])
    return h, int(m[2]) if m[2] else h
