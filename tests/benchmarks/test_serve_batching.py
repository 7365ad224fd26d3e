"""benchmarks/serve_batching.py's pieces: the batching check holds at every concurrency (0.98x); the gateway's
threads are told apart by their names as a real gateway process has them (read back with py-spy, the tool the
benchmark uses) and their CPU time comes from /proc."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_batching.py"


def _script():
    spec = importlib.util.spec_from_file_location("serve_batching", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_batching_checks_hold_at_every_concurrency():
    checks = _script().batching_checks
    assert [ok for *_, ok in checks({1: 27.7, 4: 35.0, 16: 36.9}, {1: 27.8, 4: 32.5, 16: 33.0})] == [True]
    slower = checks({1: 27.0, 4: 35.0, 16: 36.9, 64: 31.0}, {1: 27.8, 4: 32.5, 16: 33.0, 64: 31.0})
    assert [ok for *_, ok in slower] == [False] and "c=1" in slower[0][0]  # 0.971x at c=1


def test_thread_roles():
    role = _script().thread_role
    assert role(None) == "model"  # a native thread: onnxruntime's intra-op pool
    assert role("vit-serve-model-tiny_0") == "model"
    assert role("vit-serve-decode_1") == "decode"
    assert role("MainThread") == "event loop"
    assert role("Thread-3 (_relay)") == "other"


SERVER = """
import sys, time
from vit_serve.serve.app import create_app
from vit_serve.serve.settings import ServeSettings
import asyncio
async def main():
    app = create_app(ServeSettings(model=sys.argv[1], device="cpu", threads=1, decode_workers=2))
    async with app.router.lifespan_context(app):
        await app.state.gateway.wait_ready(60)
        print("ready", flush=True)
        app.state.gateway.model().thread.submit(time.sleep, 0.6)  # the model thread busy
        t0 = time.process_time()
        while time.process_time() - t0 < 0.5:  # the event loop's thread busy
            pass
        time.sleep(30)
asyncio.run(main())
"""


@pytest.mark.skipif(not (shutil.which("py-spy") or Path(sys.executable).with_name("py-spy").exists()),
                    reason="needs py-spy (pip install py-spy), which the benchmark reads thread names with")
def test_a_real_gateway_process_names_its_threads_and_cpu_lands_on_the_event_loop(tmp_path, save_tiny):
    m = _script()
    ckpt = save_tiny(tmp_path / "tiny.safetensors", (32, 32), 0, [f"c{i}" for i in range(10)])
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(ckpt)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "VIT_SERVE_BATCH_CURVE": "0"})
    try:
        assert proc.stdout.readline().strip() == "ready"
        before = m.thread_cpu_s(proc.pid)
        names = m.thread_names(proc.pid)
        if names is None:
            pytest.skip("py-spy may not read another process here (ptrace)")
        time.sleep(1.5)
        by_role = m.cpu_by_role(before, m.thread_cpu_s(proc.pid), names)
    finally:
        proc.kill()
        proc.wait()
    roles = {m.thread_role(n) for n in names.values()}
    assert {"model", "event loop"} <= roles, names  # decode threads start with the first upload
    assert by_role["event loop"] >= 0.3  # the busy loop above, 0.5 s of CPU (some may fall before `before`)
    assert by_role["decode"] < 0.2
