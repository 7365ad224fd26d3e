"""The calling thread's alternate signal stack, kept across a native call that replaces it.

OpenVINO's CPU plugin gives the thread that compiles a model an alternate signal stack of its own (mmap, then
`sigaltstack`) and unmaps it when the compiled model is released; it puts the previous stack back only if its own
is still the current one. Two compiled models released in the order they were made (a reload: the new version
compiles before the old one goes) therefore leave the thread on unmapped memory. The next signal whose handler
runs on the alternate stack then kills the process with a SIGSEGV that no handler sees, because the kernel cannot
write the signal frame. Every Python-level handler runs there (CPython installs them with SA_ONSTACK): Ctrl-C,
the gateway's SIGTERM drain, torch DataLoader's SIGCHLD.

`kept()` around such a call puts the thread's own stack back, so that the plugin's stack is never the current one
when the plugin unmaps it. The project's compiles all go through `runtime.backends.openvino.compile_model`, which
holds it; NNCF's quantization (export.openvino_ir) compiles inside the library and is wrapped where it is called.
Linux only; elsewhere it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Iterator
from dataclasses import dataclass

SS_DISABLE = 2  # <signal.h>: no alternate stack


class _StackT(ctypes.Structure):
    _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int), ("ss_size", ctypes.c_size_t)]


@dataclass(frozen=True)
class AltStack:
    """A thread's alternate signal stack: its address (0 when none), flags and size."""

    address: int
    flags: int
    size: int

    @property
    def disabled(self) -> bool:
        return bool(self.flags & SS_DISABLE)


_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
# Stacks this module installed when the kernel refused the thread's own (below); they live as long as the process.
_ADOPTED: list[ctypes.Array] = []


def current() -> AltStack:
    """The calling thread's alternate signal stack (`sigaltstack(2)`)."""
    if _libc is None:
        return AltStack(0, SS_DISABLE, 0)
    old = _StackT()
    if _libc.sigaltstack(None, ctypes.byref(old)) != 0:
        raise OSError(ctypes.get_errno(), "sigaltstack")
    return AltStack(old.ss_sp or 0, old.ss_flags, old.ss_size)


def _install(address: int, flags: int, size: int) -> bool:
    new = _StackT(address or None, flags, size)
    return _libc.sigaltstack(ctypes.byref(new), None) == 0


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Run the body, then give the calling thread back the alternate signal stack it had before.

    When the kernel refuses that stack (too small for this CPU's signal frame once a library has enabled AMX
    state), the thread gets a stack of this module's, as large as the one the body installed, that is never
    freed."""
    if _libc is None:
        yield
        return
    before = current()
    try:
        yield
    finally:
        after = current()
        if after != before and not _install(before.address, before.flags & SS_DISABLE, before.size):
            buffer = ctypes.create_string_buffer(after.size)
            if _install(ctypes.addressof(buffer), 0, after.size):
                _ADOPTED.append(buffer)
