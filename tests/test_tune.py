"""`vit-serve tune` on a tiny checkpoint: it finishes within its budget, writes serve.toml that `serve --config`
accepts, tune.json, tune.md and a PNG; candidates under the agreement floor are rejected; an export is tuned on
its runner settings only; a target nothing meets writes no serve.toml; bad arguments are refused in one line."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from vit_serve.cli import main

LABELS = [f"class_{i}" for i in range(10)]
BUDGET_S = 75.0
SLACK_S = 15.0  # the budget is the tool's own bound; the slack covers loading the reference model and this test


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, save_tiny) -> Path:
    return save_tiny(tmp_path_factory.mktemp("ckpt") / "tiny.safetensors", (32, 32), 1, LABELS)


@pytest.fixture(scope="module")
def tuned(ckpt, tmp_path_factory) -> tuple[int, Path, float, str]:
    """`vit-serve tune` on the checkpoint: (exit code, out folder, seconds it took, stdout)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("tune") / "out"
    buf = io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(buf):
        code = main(["tune", str(ckpt), "--out", str(out), "--budget-s", str(BUDGET_S), "--trial-s", "2",
                     "--concurrency", "4", "--p99-ms", "5000", "--no-progress"])
    return code, out, time.monotonic() - t0, buf.getvalue()


def test_tune_finishes_within_budget_and_writes_a_config_serve_accepts(tuned):
    from vit_serve.runtime import LoadSpec, check
    from vit_serve.serve.config_file import settings_from_file

    code, out, took, stdout = tuned
    assert code == 0, stdout
    assert took <= BUDGET_S + SLACK_S
    settings = settings_from_file(out / "serve.toml")
    assert check(LoadSpec.of(settings)) in ("torch", "onnxruntime")
    assert Path(settings.model).is_file()
    assert (out / "tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads((out / "tune.json").read_text())
    trials = {t["index"]: t for t in doc["trials"]}
    assert trials[doc["defaults"]]["step"] == "defaults" and doc["defaults"] == 1
    assert len(trials) >= 2
    for t in trials.values():
        if t["status"] == "ok":
            assert t["requests"] > 0 and t["images_per_s"] > 0 and t["p99_ms"] >= t["p50_ms"] > 0
    # the winner: the most images/s among the settings within the target, each setting's trials pooled
    pooled = {t["index"]: t for t in doc["settings"]}
    winner = pooled[doc["winner"]]
    assert winner["meets_target"] and winner["p99_ms"] <= 5000
    assert winner["images_per_s"] == max(t["images_per_s"] for t in pooled.values() if t["meets_target"])
    assert sum(len(t.get("trials", [t["index"]])) for t in pooled.values()) == len(trials)
    assert settings.limits.max_batch == winner["effective"]["max_batch"]
    assert settings.backend == winner["effective"]["backend"]
    assert "## Trials" in stdout and "winner: trial" in stdout and (out / "tune.md").read_text() in stdout
    # every trial ran what its file says, through the same reading as `serve --config`
    assert all(settings_from_file(out / "logs" / f"trial_{i:02d}.toml") for i in trials)


def test_candidates_under_the_agreement_floor_are_rejected(tuned):
    _, out, _, stdout = tuned
    doc = json.loads((out / "tune.json").read_text())
    measured = [c for c in doc["candidates"] if c["agreement"] is not None]
    assert measured[0]["name"] == "torch" and measured[0]["agreement"] == 1.0  # the reference itself
    for c in measured:
        assert (c["status"] == "rejected") == (c["agreement"] < 0.99), c
    rejected = {c["name"] for c in measured if c["status"] == "rejected"}
    assert rejected, "token merging on 4 patches changes this model's top-1 on some check images"
    assert not rejected & {t["candidate"] for t in doc["trials"]}
    assert "rejected" in stdout


def test_an_export_is_tuned_on_its_runner_settings_and_a_missed_target_writes_no_config(tuned, ckpt, tmp_path):
    import vit_export

    del tuned  # run after it: the two tunes would share the cores
    # exported here rather than taken from the tune's exports, which a slow machine's budget may skip
    onnx = vit_export.export(ckpt, vit_export.ExportOptions(out=tmp_path / "export")).graph.path
    dest = tmp_path / "onnx"
    code = main(["tune", str(onnx), "--out", str(dest), "--budget-s", "25", "--trial-s", "2", "--concurrency", "2",
                 "--p99-ms", "0.01", "--no-progress"])
    assert code == 3
    assert not (dest / "serve.toml").exists()
    doc = json.loads((dest / "tune.json").read_text())
    assert doc["winner"] is None and doc["candidates"] == [] and doc["trials"][0]["effective"]["backend"] == \
        "onnxruntime"
    assert any("MODEL is an export" in n for n in doc["notes"])
    text = (dest / "tune.md").read_text()
    assert "no setting met p99 <= 0.01 ms" in text and "the lowest p99 was" in text


def _refused(capsys, argv: list[str], code: int = 1) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err
    assert err.startswith("vit-serve tune: error: ") and err.count("\n") == 1, err
    return err


def test_bad_arguments_are_refused_in_one_line(capsys, ckpt, tmp_path):
    out = str(tmp_path / "out")
    assert "no such file" in _refused(capsys, ["tune", str(tmp_path / "absent.safetensors"), "--out", out])
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no image files" in _refused(capsys, ["tune", str(ckpt), "--out", out, "--images", str(empty)])
    assert "too short to measure even the defaults" in _refused(capsys, ["tune", str(ckpt), "--out", out,
                                                                        "--budget-s", "5"])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert "not empty; pass --force" in _refused(capsys, ["tune", str(ckpt), "--out", str(tmp_path / "full")])
    (tmp_path / "m.onnx").write_bytes(b"")
    assert "m.json" in _refused(capsys, ["tune", str(tmp_path / "m.onnx"), "--out", out])
    for flag, value in (("--p99-ms", "-5"), ("--p99-ms", "fast"), ("--concurrency", "0"), ("--budget-s", "0")):
        with pytest.raises(SystemExit) as e:
            main(["tune", str(ckpt), flag, value])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}: expected a" in err and err.count("\n") == 1, err
    assert not Path(out).exists()  # nothing was written for refused arguments
