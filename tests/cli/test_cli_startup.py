"""`vit-serve --help` starts light: parsing the top-level command line imports none of the heavy modules (torch,
the web and export stacks); a command's own flags are built only when that command is run. Checked in a fresh
interpreter through `sys.modules`, not by timing."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "fastapi", "starlette", "uvicorn", "grpc", "onnx", "onnxruntime", "pydantic", "pydantic_settings",
         "matplotlib", "ray", "tensorrt", "tritonclient", "safetensors")

_PROBE = """
import contextlib, io, json, sys
from vit_serve.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        main(sys.argv[1:])
    except SystemExit as e:
        code = e.code
print(json.dumps({"code": code, "help": out.getvalue(), "modules": sorted(sys.modules)}))
"""


def _probe(*argv: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_top_level_help_imports_no_heavy_module():
    probe = _probe("--help")
    assert probe["code"] == 0
    assert "quickstart" in probe["help"] and "serve a model over HTTP" in probe["help"]
    loaded = set(probe["modules"])
    assert [m for m in HEAVY if m in loaded] == []


def test_a_command_s_help_still_lists_its_own_flags():
    probe = _probe("predict", "--help")
    assert probe["code"] == 0
    assert "--batch-size" in probe["help"] and "--engine" in probe["help"]


def test_every_command_s_help_imports_no_model_stack():
    """A command's --help builds its flags from typed settings (pydantic; serve's also from the gateway's error
    table, which names FastAPI's exceptions) but never loads the model, export or runtime stacks."""
    model_stack = ("torch", "onnx", "onnxruntime", "matplotlib", "ray", "tensorrt", "tritonclient", "safetensors")
    for command in ("convert", "inspect", "train", "eval", "serve", "predict", "quickstart", "tune"):
        probe = _probe(command, "--help")
        assert probe["code"] == 0, command
        assert [m for m in model_stack if m in set(probe["modules"])] == [], command


def test_the_help_of_the_light_parser_is_the_full_parser_s():
    from vit_serve.cli import build_parser

    assert build_parser(()).format_help() == build_parser().format_help()
    light = build_parser(())._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    full = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert list(light) == list(full)
    assert all(light[name].description == full[name].description for name in full)
