"""The Dockerfile names only things that exist: copied paths, extras, console scripts, routes and stages.

No Docker engine runs on the CI machines, so the image is not built here; these checks catch the usual rot
(a renamed folder, a dropped extra or script, a health check on a route that is gone).
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Instructions only: the header comment shows commands with placeholders.
DOCKERFILE = "\n".join(ln for ln in (ROOT / "Dockerfile").read_text().splitlines() if not ln.lstrip().startswith("#"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _instructions(name: str) -> list[str]:
    """Logical lines (continuations joined) starting with instruction `name`."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    return [ln.strip()[len(name):].strip() for ln in text.splitlines() if ln.strip().upper().startswith(name + " ")]


def _stages() -> dict[str, str]:
    return {m.group(2): m.group(1) for m in re.finditer(r"^FROM\s+(\S+)\s+AS\s+(\S+)", DOCKERFILE, re.M | re.I)}


def test_stages_cpu_default_and_cuda():
    stages = _stages()
    assert {"build-cpu", "build-cuda", "cpu", "cuda"} <= set(stages)
    last = re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", DOCKERFILE, re.M | re.I)[-1]
    assert last == "cpu", "docker build without --target builds the last stage: it must be the CPU image"
    assert "cuda" in stages["cuda"]


def test_copied_paths_exist():
    for args in _instructions("COPY"):
        if args.startswith("--from"):
            continue
        *sources, _dest = args.split()
        for src in sources:
            assert (ROOT / src).exists(), f"Dockerfile copies {src}, which is not in the repository"


def test_extras_exist():
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    named = {e for group in re.findall(r'"\.\[([^\]]+)\]"', DOCKERFILE) for e in group.split(",")}
    assert named, "the Dockerfile installs the project with extras"
    assert named <= extras, f"unknown extras {named - extras}"


def test_entrypoint_is_a_console_script_with_serve():
    scripts = PYPROJECT["project"]["scripts"]
    for args in _instructions("ENTRYPOINT"):
        argv = json.loads(args)
        assert argv[0] in scripts and argv[1] == "serve"
        from vit_serve.cli import build_parser

        # The entry point's flags parse (with a model path appended, as CMD does).
        build_parser().parse_args([*argv[1:], "/models/model.onnx"])


def test_non_root_and_healthcheck():
    users = _instructions("USER")
    assert len(users) == 2 and all(u not in ("root", "0") for u in users)
    checks = _instructions("HEALTHCHECK")
    assert len(checks) == 2 and all("/healthz" in c for c in checks)


def test_healthcheck_route_exists():
    pytest.importorskip("fastapi")
    from vit_serve.serve.app import create_app

    assert "/healthz" in create_app().openapi()["paths"]


def test_the_production_example_names_real_settings():
    """Every VIT_SERVE_* variable the header's production `docker run` sets is a ServeSettings field, and the
    settings it describes validate (keys from files, TLS, Redis, gRPC, polling)."""
    pytest.importorskip("pydantic_settings")
    from vit_serve.serve.settings import ServeSettings

    header = "\n".join(ln for ln in (ROOT / "Dockerfile").read_text().splitlines() if ln.lstrip().startswith("#"))
    named = dict(re.findall(r"-e VIT_SERVE_(\w+)=(\S+)", header))
    assert {"API_KEYS_FILE", "SSL_CERTFILE", "SSL_KEYFILE", "STORE", "GRPC_PORT"} <= set(named)
    fields = set(ServeSettings.flat_fields())
    assert {n.lower() for n in named} <= fields, {n.lower() for n in named} - fields
    s = ServeSettings(**{n.lower(): v for n, v in named.items()})
    assert s.grpc_port == 8001 and s.explain_store.store.startswith("redis://") and s.repository.model_control == "poll"


def test_healthchecks_are_python_that_compiles():
    for args in _instructions("HEALTHCHECK"):
        argv = json.loads(args[args.index("CMD") + 3:].strip())
        assert argv[1] == "-c"
        compile(argv[2], "HEALTHCHECK", "exec")


def _stage_text(name: str) -> str:
    """The instructions of stage `name` (continuations joined), up to the next FROM."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    m = re.search(rf"^FROM\s+\S+\s+AS\s+{re.escape(name)}\s*$(.*?)(?=^FROM\s|\Z)", text, re.M | re.I | re.S)
    assert m, f"no stage {name}"
    return m.group(1)


def _requirements(extras: set[str]) -> set[str]:
    """The distribution names the project's `extras` pull in, following extras of the project itself."""
    optional = PYPROJECT["project"]["optional-dependencies"]
    names, todo, seen = set(), list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in optional[extra]:
            name = re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower()
            if name == PYPROJECT["project"]["name"]:
                todo += re.search(r"\[([^\]]+)\]", req).group(1).split(",")
            else:
                names.add(name)
    return names


def test_the_cuda_image_has_torchvision_for_nvjpeg():
    """The gateway decodes JPEG uploads with nvJPEG through torchvision (vit_serve.runtime.gpu_decode); without it
    every upload silently took the CPU path in the CUDA image. The CPU image needs none."""
    def installed(stage: str) -> set[str]:
        extras = {e for group in re.findall(r'"\.\[([^\]]+)\]"', _stage_text(stage)) for e in group.split(",")}
        plain = set(re.findall(r"pip install (?:--index-url \S+ )?\"?([A-Za-z][\w.-]*)", _stage_text(stage)))
        return _requirements(extras) | {p.lower() for p in plain}

    assert "torchvision" in installed("build-cuda")
    assert "torchvision" not in installed("build-cpu")  # the CPU image keeps its CPU torch (no second download)
