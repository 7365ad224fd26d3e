"""Memory handed back between the steps of an export, so that its peak is that of its largest step, not their sum.

A step's tensors and protos are freed when the last reference goes, but the C heap (glibc's malloc, which
onnx, protobuf, onnxruntime and PyTorch's small tensors allocate from) keeps freed chunks resident until a later
allocation reuses them; `release_memory` collects reference cycles and trims that heap.
"""

from __future__ import annotations

import ctypes
import gc
import sys


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018  (glibc only: musl has none)
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def release_memory() -> None:
    """Collect cycles, then (glibc) return the heap's free memory to the system."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
