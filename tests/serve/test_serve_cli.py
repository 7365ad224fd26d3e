"""`vit-serve serve`: one-line errors, and a real server process configured by flags over VIT_SERVE_* variables."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from vit_serve.cli import main
from vit_serve.serve.settings import ServeSettings
from vit_serve.tune.server_process import ServerExitedError, ServerProcess, free_port


def _one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("vit-serve serve: error: ") and err.count("\n") == 1, err
    return err


def test_errors_are_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("VIT_SERVE_MODEL", raising=False)
    assert "no such file" in _one_line_error(capsys, ["serve", str(tmp_path / "absent.safetensors")])
    assert "no model given" in _one_line_error(capsys, ["serve"])
    err = _one_line_error(capsys, ["serve", "m.safetensors", "--max-batch", "0"])
    assert "--max-batch / VIT_SERVE_MAX_BATCH" in err
    monkeypatch.setenv("VIT_SERVE_MAX_QUEUE", "lots")
    assert "VIT_SERVE_MAX_QUEUE" in _one_line_error(capsys, ["serve", "m.safetensors"])


def test_settings_from_environment_and_overrides(monkeypatch):
    monkeypatch.setenv("VIT_SERVE_MAX_BATCH", "3")
    monkeypatch.setenv("VIT_SERVE_MAX_DELAY_MS", "0")
    s = ServeSettings(model="m.onnx")
    assert (s.limits.max_batch, s.limits.max_delay_ms, s.limits.batching) == (3, 0.0, False)
    assert ServeSettings(model="m.onnx", max_batch=5, max_delay_ms=2).limits.batching
    with pytest.raises(ValueError, match="extra"):
        ServeSettings(model="m.onnx", max_batchsize=5)


def test_serve_subprocess_flags_win_over_environment(tiny_ckpt, photos, tmp_path):
    env = {"VIT_SERVE_MODEL": str(tiny_ckpt), "VIT_SERVE_MODEL_NAME": "from-env", "VIT_SERVE_THREADS": "1",
           "VIT_SERVE_DECODE_WORKERS": "1", "OMP_NUM_THREADS": "1"}
    log = tmp_path / "output"
    with log.open("wb") as out:
        server = ServerProcess.serve(["--model-name", "from-flag", "--max-batch", "4"], env=env, stdout=out,
                                     stderr=subprocess.STDOUT)
        try:
            try:
                ready = server.wait_ready(90, poll=0.2)
            except (ServerExitedError, TimeoutError) as e:
                raise AssertionError(log.read_text()[-3000:]) from e
            assert ready["model"] == "from-flag"  # MODEL from the environment, the name from the flag
            r = httpx.post(f"{server.url}/classify", content=photos["coffee.jpg"],
                           headers={"Content-Type": "image/jpeg"})
            assert r.status_code == 200 and r.json()["model"] == "from-flag"
        finally:
            status = server.stop()
    output = log.read_text()
    assert status in (0, -15), output  # uvicorn re-raises SIGTERM after shutting down cleanly
    assert "loaded from-flag (torch backend)" in output
    assert "Application shutdown complete" in output


def test_a_model_that_cannot_be_served_ends_with_one_line_and_no_traceback():
    """--backend triton with no Triton listening: the lifespan gives up after the startup timeout, and the process
    exits 3 with the reason in one logged line (uvicorn used to print Starlette's whole traceback)."""
    port = free_port()  # nothing listens there
    proc = subprocess.run([sys.executable, "-m", "vit_serve", "serve", "tiny", "--backend", "triton",
                           "--triton-url", f"127.0.0.1:{port}", "--triton-startup-timeout-s", "1",
                           "--port", "0"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    assert "Traceback" not in out, out
    reason = [line for line in out.splitlines() if "cannot serve tiny" in line]
    assert len(reason) == 1 and f"127.0.0.1:{port}" in reason[0], out


def test_engine_ray_refuses_what_ray_serve_cannot_serve_in_one_line(capsys, tiny_ckpt):
    """`--engine ray` is checked by `vit_serve.deploy.ray.build_app` before any cluster starts."""
    pytest.importorskip("ray.serve")
    err = _one_line_error(capsys, ["serve", str(tiny_ckpt), "--engine", "ray", "--model-control", "poll"])
    assert "poll" in err
