"""ServeSettings' derived defaults: decode threads sized against the model's threads (`default_decode_workers`),
and applied by the settings and the gateway's decode pool unless set explicitly. The environment's names: flat
(VIT_SERVE_MAX_BATCH) and silent; a deprecated name (the nested VIT_SERVE_LIMITS__MAX_BATCH) read with a warning
that names the flat one, and losing to it."""

from __future__ import annotations

import warnings

import pytest
from gateway_helpers import run

from vit_serve.serve import settings as settings_mod
from vit_serve.serve.settings import ENV_RENAMED, ServeSettings, SettingNameWarning, default_decode_workers


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


NAMES = [("VIT_SERVE_LIMITS__MAX_BATCH", "VIT_SERVE_MAX_BATCH", "4", lambda s: s.limits.max_batch, 4),
         ("VIT_SERVE_EXPLAIN_STORE__STORE_TTL_S", "VIT_SERVE_STORE_TTL_S", "5", lambda s: s.explain_store.store_ttl_s,
          5.0),
         ("VIT_SERVE_TRITON__TRITON_URL", "VIT_SERVE_TRITON_URL", "grpc://t:8001", lambda s: s.triton.triton_url,
          "grpc://t:8001"),
         ("VIT_SERVE_MONITOR__DRIFT_WINDOW", "VIT_SERVE_DRIFT_WINDOW", "300", lambda s: s.monitor.drift_window, 300)]


@pytest.mark.parametrize(("old", "new", "value", "read", "want"), NAMES)
def test_flat_environment_name_is_read_silently(monkeypatch, old, new, value, read, want):
    monkeypatch.setenv(new, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read(ServeSettings()) == want


@pytest.mark.parametrize(("old", "new", "value", "read", "want"), NAMES)
def test_deprecated_environment_name_works_and_names_the_new_one(monkeypatch, old, new, value, read, want):
    assert ENV_RENAMED[old] == new
    monkeypatch.setenv(old, value)
    with pytest.warns(SettingNameWarning) as caught:
        assert read(ServeSettings()) == want
    assert [str(w.message) for w in caught] == [f"{old} is deprecated: set {new}"]


def test_both_names_set_the_new_one_wins_with_a_warning(monkeypatch):
    monkeypatch.setenv("VIT_SERVE_LIMITS__MAX_BATCH", "4")
    monkeypatch.setenv("VIT_SERVE_MAX_BATCH", "7")
    with pytest.warns(SettingNameWarning, match="VIT_SERVE_MAX_BATCH wins") as caught:
        assert ServeSettings().limits.max_batch == 7
    assert len(caught) == 1


def test_every_group_field_has_one_deprecated_spelling():
    flat = ServeSettings.flat_fields()
    groups = {name for name, info in ServeSettings.model_fields.items() if name not in flat}
    assert sorted(ENV_RENAMED.values()) == sorted(f"VIT_SERVE_{f.upper()}" for g in groups
                                                  for f in ServeSettings.model_fields[g].annotation.model_fields)
    assert all(new.removeprefix("VIT_SERVE_").lower() in flat for new in ENV_RENAMED.values())


def test_vit_serve_shows_the_deprecation(monkeypatch, capsys):
    from vit_serve.cli.main import main

    monkeypatch.setenv("VIT_SERVE_LIMITS__MAX_QUEUE", "lots")  # refused after the warning: nothing is served
    with warnings.catch_warnings(record=True) as shown:
        warnings.resetwarnings()
        warnings.simplefilter("ignore", DeprecationWarning)  # Python's default outside __main__
        assert main(["serve", "m.onnx"]) != 0
    assert [str(w.message) for w in shown] == ["VIT_SERVE_LIMITS__MAX_QUEUE is deprecated: set VIT_SERVE_MAX_QUEUE"]
    assert "--max-queue / VIT_SERVE_MAX_QUEUE: " in capsys.readouterr().err  # the value's error names it too
