"""`vit-serve serve --config FILE`: settings from a .toml or .json file of flat names, under VIT_SERVE_* and the
flags; unknown names, bad values and unreadable files refused in one line naming the file (and the setting)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from vit_serve.cli import main
from vit_serve.serve.config_file import SettingsFileError, read_settings_file, settings_from_file
from vit_serve.tune.server_process import ServerExitedError, ServerProcess, free_port


@pytest.fixture(autouse=True)
def _no_serve_environment(monkeypatch):
    for k in list(os.environ):
        if k.upper().startswith("VIT_SERVE_"):
            monkeypatch.delenv(k)


def _error(capsys, argv: list[str]) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("vit-serve serve: error: ") and err.count("\n") == 1, err
    return err


def test_toml_fields_land_in_their_groups(tmp_path):
    (tmp_path / "m.onnx").write_bytes(b"")
    f = tmp_path / "serve.toml"
    f.write_text('model = "m.onnx"\nbackend = "onnxruntime"\nthreads = 1\ndecode_workers = 3\nmax_batch = 8\n'
                 'max_delay_ms = 2.5\nmodel_control = "poll"\nstore_size = 7\nopen_probes = false\n')
    s = settings_from_file(f)
    assert s.model == str(tmp_path / "m.onnx")  # relative to the file's folder
    assert (s.backend, s.threads, s.decode_workers) == ("onnxruntime", 1, 3)
    assert (s.limits.max_batch, s.limits.max_delay_ms) == (8, 2.5)
    assert s.repository.model_control == "poll"
    assert s.explain_store.store_size == 7
    assert s.security.open_probes is False
    assert s.limits.max_queue == 256  # what the file leaves out keeps its default


def test_json_file_and_its_relative_paths(tmp_path):
    f = tmp_path / "sub" / "serve.json"
    f.parent.mkdir()
    f.write_text(json.dumps({"model": "timm/vit_tiny_patch16_224", "api_keys_file": "keys.txt", "tome": [2, 1],
                             "cors_origins": ["https://a.example"], "max_batch": 4}))
    s = settings_from_file(f)
    assert s.model == "timm/vit_tiny_patch16_224"  # nothing by that name beside the file: kept (a hub id)
    assert s.security.api_keys_file == str(f.parent / "keys.txt")
    assert s.tome == "2,1" and s.security.cors_origins == ["https://a.example"] and s.limits.max_batch == 4
    assert read_settings_file(f)["tome"] == "2,1"


def test_precedence_flags_then_environment_then_file(tmp_path, monkeypatch):
    f = tmp_path / "serve.toml"
    f.write_text('model = "m.onnx"\nmax_batch = 8\nmax_delay_ms = 2\nmax_queue = 10\n')
    monkeypatch.setenv("VIT_SERVE_MAX_BATCH", "4")
    monkeypatch.setenv("VIT_SERVE_MAX_DELAY_MS", "3")
    s = settings_from_file(f, max_delay_ms=7)
    assert (s.limits.max_batch, s.limits.max_delay_ms, s.limits.max_queue) == (4, 7.0, 10)


def test_unknown_setting_refused_naming_it(tmp_path):
    f = tmp_path / "serve.toml"
    f.write_text("max_bach = 8\n")
    with pytest.raises(SettingsFileError, match=r"serve\.toml: unknown setting 'max_bach' \(did you mean "
                                                r"'max_batch'\?\)"):
        settings_from_file(f)
    f.write_text("[limits]\nmax_batch = 8\n")
    with pytest.raises(SettingsFileError, match=r"unknown setting 'limits'.*flat"):
        settings_from_file(f)


def test_bad_value_refused_naming_the_field_and_file(tmp_path):
    f = tmp_path / "serve.toml"
    f.write_text('max_batch = 0\ntome = "x"\n')
    with pytest.raises(SettingsFileError) as e:
        settings_from_file(f)
    assert "serve.toml: max_batch: Input should be greater than or equal to 1" in str(e.value)
    assert "serve.toml: tome: " in str(e.value) and "bad r 'x'" in str(e.value)


def test_cli_refuses_a_bad_file_before_serving(capsys, tmp_path, tiny_ckpt):
    f = tmp_path / "serve.toml"
    f.write_text(f'model = "{tiny_ckpt}"\nmax_bach = 8\n')
    assert f"{f}: unknown setting 'max_bach'" in _error(capsys, ["serve", "--config", str(f)])
    f.write_text(f'model = "{tiny_ckpt}"\nmax_batch = -1\n')
    assert f"{f}: max_batch: Input should be greater than or equal to 1" in _error(capsys, ["serve", "--config",
                                                                                            str(f)])
    # a bad flag is named as a flag, a bad value of the file as the file's, in the same line
    err = _error(capsys, ["serve", "--config", str(f), "--max-queue", "0"])
    assert "--max-queue / VIT_SERVE_MAX_QUEUE: " in err and f"{f}: max_batch: " in err
    # a flag over the bad value: accepted, then the missing model is refused before anything starts
    f.write_text('model = "absent.safetensors"\nmax_batch = -1\n')
    assert "no such file: absent.safetensors" in _error(capsys, ["serve", "--config", str(f), "--max-batch", "2"])
    f.write_text("max_batch = [")
    assert "not valid TOML" in _error(capsys, ["serve", "--config", str(f)])
    assert "cannot read it" in _error(capsys, ["serve", "--config", str(tmp_path / "absent.toml")])
    (tmp_path / "serve.yaml").write_text("max_batch: 2\n")
    assert ".toml or .json" in _error(capsys, ["serve", "--config", str(tmp_path / "serve.yaml")])
    (tmp_path / "list.json").write_text("[1, 2]")
    assert "expected a table of settings" in _error(capsys, ["serve", "--config", str(tmp_path / "list.json")])


def test_serve_process_runs_from_the_file_with_a_flag_over_it(tiny_ckpt, photos, tmp_path):
    port = free_port()  # the file's port, not a flag: the process listens where the file says
    (tmp_path / tiny_ckpt.name).symlink_to(tiny_ckpt)
    f = tmp_path / "serve.toml"
    f.write_text(f'model = "{tiny_ckpt.name}"\nmodel_name = "from-file"\nport = {port}\nthreads = 1\n'
                 'decode_workers = 1\nmax_batch = 3\nshutdown_drain_s = 0\n')
    log = tmp_path / "output"
    with log.open("wb") as out:
        server = ServerProcess.command([sys.executable, "-m", "vit_serve", "serve", "--config", str(f),
                                        "--model-name", "from-flag"], port, env={"OMP_NUM_THREADS": "1"}, cwd="/",
                                       stdout=out, stderr=subprocess.STDOUT)
        try:
            try:
                ready = server.wait_ready(90, poll=0.2)
            except (ServerExitedError, TimeoutError) as e:
                raise AssertionError(log.read_text()[-3000:]) from e
            assert ready["model"] == "from-flag"
            r = httpx.post(f"{server.url}/classify", content=photos["coffee.jpg"],
                           headers={"Content-Type": "image/jpeg"})
            assert r.status_code == 200 and r.json()["model"] == "from-flag"
        finally:
            server.stop()
    assert "loaded from-flag (torch backend)" in log.read_text()
