"""Class-name files shipped with the package (`imagenet1k.txt`, read by `imagenet1k_labels`); no modules."""

from __future__ import annotations

from functools import cache
from importlib import resources


@cache
def imagenet1k_labels() -> tuple[str, ...]:
    """The 1000 ImageNet-1k class names, in the standard index order (index 0 = "tench")."""
    text = resources.files(__package__).joinpath("imagenet1k.txt").read_text(encoding="utf-8")
    return tuple(line for line in text.splitlines() if line)


def default_labels(num_classes: int) -> list[str] | None:
    """ImageNet-1k names for a 1000-way head; None when the head's classes are unknown."""
    return list(imagenet1k_labels()) if num_classes == 1000 else None
