"""Memory handed back between the steps of an export, so that its peak is that of its largest step, not their sum.

A step's tensors and protos are freed when the last reference goes, but the C heap (glibc's malloc, which
onnx, protobuf, onnxruntime and PyTorch's small tensors allocate from) keeps freed chunks resident until a later
allocation reuses them; `release_memory` collects reference cycles and trims that heap.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import sys
import threading
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


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


_depth = 0  # young_heap's nesting, process-wide as gc.freeze is
_depth_lock = threading.Lock()


@contextlib.contextmanager
def young_heap() -> Iterator[None]:
    """While inside, `release_memory` collects only what was made since entering: what lived before is frozen
    (`gc.freeze`). A full collection walks every tracked object, about 0.3 s once torch and onnx are imported,
    and an export collects about 30 times; the export's own garbage is all made inside. Nests."""
    global _depth
    with _depth_lock:
        if _depth == 0:
            gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _depth_lock:
            _depth -= 1
            if _depth == 0:
                gc.unfreeze()


def on_young_heap(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn` run inside `young_heap`."""
    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with young_heap():
            return fn(*args, **kwargs)
    return wrapper
