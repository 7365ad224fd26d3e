"""vit_serve.signal_stack against the kernel's sigaltstack(2) and OpenVINO's CPU plugin: two compiled models
released in the order they were made leave the compiling thread on an unmapped alternate stack, and the next
Python-level signal handler then kills the process with a SIGSEGV; `kept()` around the compiles prevents it."""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import textwrap

import pytest

from vit_serve import signal_stack

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sigaltstack is checked on Linux")

# Two OpenVINO models compiled on this thread, released first-made first; then a child exits while a Python-level
# SIGCHLD handler is installed (as torch's DataLoader leaves one). KEPT chooses whether the compiles run in kept().
SCENARIO = textwrap.dedent("""
    import contextlib, faulthandler, gc, signal, subprocess, sys
    import numpy as np
    import openvino as ov
    from openvino import opset13 as ops
    from vit_serve import signal_stack

    faulthandler.enable()  # the thread's own alternate stack, as in any pytest or python -X faulthandler run
    own = signal_stack.current()

    def compiled():
        p = ops.parameter([1, 8], np.float32)
        with signal_stack.kept() if KEPT else contextlib.nullcontext():
            return ov.Core().compile_model(ov.Model([ops.relu(p)], [p]), "CPU")

    first, second = compiled(), compiled()
    del first; gc.collect()
    del second; gc.collect()
    now = signal_stack.current()
    mapped = any(int(a, 16) <= now.address < int(b, 16)
                 for a, b in (line.split()[0].split("-") for line in open("/proc/self/maps")))
    print("own", now == own, "mapped", mapped, flush=True)
    signal.signal(signal.SIGCHLD, lambda *a: None)
    subprocess.run(["true"], check=True)
    print("survived", flush=True)
""")


def _scenario(kept: bool) -> subprocess.CompletedProcess:
    pytest.importorskip("openvino")
    return subprocess.run([sys.executable, "-c", f"KEPT = {kept}\n{SCENARIO}"], capture_output=True, text=True,
                          timeout=120)


def test_kept_compiles_survive_a_signal_after_their_models_are_released():
    r = _scenario(kept=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == ["own", "True", "mapped", "True", "survived"]


def test_without_it_openvino_leaves_the_thread_on_a_stack_it_unmapped():
    """What `kept()` is for; if an OpenVINO release fixes its plugin, this fails and the guard can go. The signal
    then usually kills the process with a SIGSEGV that no handler reports (the CI worker's death); it survives
    when something else has been mapped at that address meanwhile, and the frame overwrote that memory."""
    r = _scenario(kept=False)
    assert r.stdout.split()[:2] == ["own", "False"], r.stdout + r.stderr
    assert r.returncode in (0, -signal.SIGSEGV), r.stdout + r.stderr
    if r.returncode == -signal.SIGSEGV:
        assert "Fatal Python error" not in r.stderr  # the kernel's kill: faulthandler's handler never ran


def test_kept_restores_a_stack_the_body_replaced():
    before = signal_stack.current()
    buffer = ctypes.create_string_buffer(64 * 1024)
    with signal_stack.kept():
        assert signal_stack._install(ctypes.addressof(buffer), 0, len(buffer))
        assert signal_stack.current().address == ctypes.addressof(buffer)
    assert signal_stack.current() == before


def test_a_stack_the_kernel_refuses_back_is_replaced_by_one_of_the_modules_own(monkeypatch):
    before = signal_stack.current()
    buffer = ctypes.create_string_buffer(64 * 1024)
    install = signal_stack._install
    refused: list[int] = []

    def refusing(address: int, flags: int, size: int) -> bool:
        if address == before.address and not refused:  # as the kernel answers a stack too small for AMX state
            refused.append(address)
            return False
        return install(address, flags, size)

    try:
        with signal_stack.kept():
            assert install(ctypes.addressof(buffer), 0, len(buffer))
            monkeypatch.setattr(signal_stack, "_install", refusing)
        now = signal_stack.current()
        assert refused and now.address == ctypes.addressof(signal_stack._ADOPTED[-1])
        assert now.size == len(buffer) and not now.disabled
    finally:
        assert install(before.address, before.flags & signal_stack.SS_DISABLE, before.size)
        signal_stack._ADOPTED.pop()
