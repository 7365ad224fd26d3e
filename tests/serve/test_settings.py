"""ServeSettings' derived defaults: decode threads sized against the model's threads (`default_decode_workers`),
and applied by the settings and the gateway's decode pool unless set explicitly."""

from __future__ import annotations

import pytest
from gateway_helpers import run

from vit_serve.serve import settings as settings_mod
from vit_serve.serve.settings import ServeSettings, default_decode_workers


@pytest.mark.parametrize(("cpus", "threads", "device", "want"), [
    (1, None, "cpu", 2), (2, None, "cpu", 2), (2, 1, "cpu", 2), (2, 2, "cpu", 2),  # the floor on small machines
    (4, None, "cpu", 2), (4, 1, "cpu", 3), (8, 6, "cpu", 2), (16, None, "cpu", 4), (64, 8, "cpu", 4),
    (2, None, "cuda", 2), (8, None, "cuda", 4), (8, 6, "cuda", 2), (3, None, "auto", 2),
])
def test_decode_workers_rule(cpus, threads, device, want):
    assert default_decode_workers(cpus, threads, device) == want
    model = threads if threads is not None else (1 if device == "cuda" else -(-cpus // 2))
    assert want == settings_mod.DECODE_WORKERS_MIN or want + model <= cpus  # they fit in the cores when they can


@pytest.mark.parametrize(("cpus", "threads", "want"), [(2, None, 2), (2, 1, 2), (8, 6, 2), (8, 1, 4)])
def test_settings_apply_the_rule(monkeypatch, cpus, threads, want):
    monkeypatch.setattr(settings_mod, "available_cpus", lambda: cpus)
    kw = {} if threads is None else {"threads": threads}
    assert ServeSettings(model="m.onnx", device="cpu", **kw).decode_workers == want


def test_explicit_decode_workers_win(monkeypatch):
    monkeypatch.setattr(settings_mod, "available_cpus", lambda: 2)
    assert ServeSettings(model="m.onnx", threads=1, decode_workers=3).decode_workers == 3
    monkeypatch.setenv("VIT_SERVE_DECODE_WORKERS", "5")
    assert ServeSettings(model="m.onnx", threads=1).decode_workers == 5


def test_available_cpus_is_this_process_affinity():
    import os

    want = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert settings_mod.available_cpus() == want


def test_gateway_decode_pool_has_the_derived_size(monkeypatch, tiny_ckpt):
    from vit_serve.serve.gateway import Gateway

    monkeypatch.setattr(settings_mod, "available_cpus", lambda: 8)
    s = ServeSettings(model=str(tiny_ckpt), device="cpu", threads=6)

    async def scenario():
        gw = Gateway(s)
        await gw.start()
        try:
            return gw.decode_pool._max_workers
        finally:
            await gw.stop()

    assert s.decode_workers == 2
    assert run(scenario()) == 2
