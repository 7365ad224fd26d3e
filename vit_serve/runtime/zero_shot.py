"""Zero-shot classification over labels given at request time (POST /classify?labels=, the v2 `labels` parameter):
the labels parsed within their limits (`LabelLimits`, `parse_labels`) and logits made scores (softmax over the
labels for CLIP, the sigmoid of each for SigLIP). Pure functions, no I/O. The recipe itself (prompts, class
embeddings, logits) is `vit_serve.zeroshot`'s, shared with the heads `vit-serve convert --zero-shot` builds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_LABELS_SETTING = "VIT_SERVE_MAX_LABELS"
MAX_LABEL_CHARS_SETTING = "VIT_SERVE_MAX_LABEL_CHARS"
MAX_LABEL_BYTES_SETTING = "VIT_SERVE_MAX_LABEL_BYTES"
MAX_LABEL_PROMPTS_SETTING = "VIT_SERVE_MAX_LABEL_PROMPTS"


@dataclass(frozen=True)
class LabelLimits:
    """Requests with labels: at most `max_labels` labels of `max_label_bytes` UTF-8 bytes (and `max_label_chars`
    code points) each, and `max_label_prompts` labels x templates; each text tower caches the class embeddings of
    `cache_size` labels (LRU), encodes `chunk_size` prompts per run and holds `queue_size` requests (waiting or
    running). The gateway's settings of the same names (`chunk_size`: text_chunk_size, `queue_size`:
    text_queue_size)."""

    max_labels: int = 64
    max_label_chars: int = 100
    cache_size: int = 1024
    max_label_bytes: int = 256
    max_label_prompts: int = 8192
    # a ViT-B/32 text tower's peak above idle, 6 labels x 80 templates: 6 MB at 32, 318 MB at 64, 927 MB at 256,
    # in the same time (benchmarks/text_labels.py)
    chunk_size: int = 32
    queue_size: int = 16

    def parse(self, value: str | list[str], num_templates: int = 1) -> list[str]:
        """`parse_labels` within these limits (and labels x `num_templates` within max_label_prompts)."""
        labels = parse_labels(value, self.max_labels, self.max_label_chars, self.max_label_bytes)
        if len(labels) * num_templates > self.max_label_prompts:
            raise ValueError(f"{len(labels)} labels x {num_templates} templates = {len(labels) * num_templates} "
                             f"prompts, over the limit of {self.max_label_prompts} ({MAX_LABEL_PROMPTS_SETTING})")
        return labels


def label_scores(logits: np.ndarray, kind: str) -> np.ndarray:
    """Logits [..., n] -> scores: softmax over the last axis, or the sigmoid of each (float64)."""
    z = logits.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        if kind == "sigmoid":
            return 1.0 / (1.0 + np.exp(-z))
        p = np.exp(z - z.max(axis=-1, keepdims=True))
        return p / p.sum(axis=-1, keepdims=True)


def parse_labels(value: str | list[str], max_labels: int, max_chars: int, max_bytes: int | None = None) -> list[str]:
    """"cat, dog" or ["cat", "dog"] -> the labels (stripped, empty ones dropped; duplicates refused); ValueError
    naming the limit (`max_labels` labels, `max_bytes` UTF-8 bytes and `max_chars` code points each) or the
    fault."""
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        items = value
    else:
        raise ValueError("labels must be a comma-separated string or a list of strings")
    labels = [v.strip() for v in items if v.strip()]
    if not labels:
        raise ValueError("labels is empty: give at least one label (labels=cat,dog)")
    if len(labels) > max_labels:
        raise ValueError(f"{len(labels)} labels, over the limit of {max_labels} ({MAX_LABELS_SETTING})")
    for v in labels:
        try:
            size = len(v.encode("utf-8"))
        except UnicodeEncodeError:  # a lone surrogate (JSON's "\ud800")
            raise ValueError(f"label {v[:24]!r} is not valid Unicode text") from None
        if max_bytes is not None and size > max_bytes:
            raise ValueError(f"label {v[:24]!r}... has {size} UTF-8 bytes, over the limit of {max_bytes} "
                             f"({MAX_LABEL_BYTES_SETTING})")
    long = next((v for v in labels if len(v) > max_chars), None)
    if long is not None:
        raise ValueError(f"label {long[:24]!r}... has {len(long)} characters, over the limit of {max_chars} "
                         f"({MAX_LABEL_CHARS_SETTING})")
    seen: set[str] = set()
    for v in labels:
        if v in seen:
            raise ValueError(f"label {v!r} is given twice")
        seen.add(v)
    return labels
