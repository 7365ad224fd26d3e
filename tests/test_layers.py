"""The rules of the house as tests (issue 20): the import-linter contracts of pyproject.toml (layers, a runtime
without web frameworks, predict and deploy off the gateway's internals), no import cycles inside the packages
(grimp, lazy imports included), and no function longer than a screen."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 100
_spec = importlib.util.spec_from_file_location("code_shape", ROOT / "benchmarks" / "code_shape.py")
code_shape = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(code_shape)


def test_import_contracts_hold():
    lint = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_every_top_level_module_is_in_a_layer():
    """The layers contract names each top-level module of vit_serve (a new one is placed, not forgotten), and only
    modules that exist."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in config if c["type"] == "layers")["layers"]
    named = {m for layer in layers for m in re.split(r"\s*[|:]\s*", layer.strip())}
    package = ROOT / "vit_serve"
    modules = {f"vit_serve.{p.stem}" for p in package.glob("*.py") if p.stem != "__init__"}
    modules |= {f"vit_serve.{p.parent.name}" for p in package.glob("*/__init__.py")}
    assert modules | {"vit_export"} == named


def test_no_import_cycles():
    assert code_shape.import_cycles(grimp.build_graph("vit_serve", "vit_export", cache_dir=None)) == []


def test_import_cycles_are_found():
    """The check itself: a graph with a cycle through three modules reports its edges."""
    g = grimp.ImportGraph()
    for a, b in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")):
        g.add_import(importer=a, imported=b)
    assert code_shape.import_cycles(g) == [("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a")]


def test_no_function_over_a_screen():
    assert [f"{where} ({n} lines)" for n, where in code_shape.function_lengths(ROOT) if n > MAX_FUNCTION_LINES] == []


def test_long_functions_are_found(tmp_path):
    """The check itself: a 101-line function in a tree is reported with its length."""
    (tmp_path / "vit_serve").mkdir()
    (tmp_path / "export").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(100))
    (tmp_path / "vit_serve" / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}")
    assert code_shape.function_lengths(tmp_path)[:2] == [(101, "vit_serve/m.py:5 long"), (2, "vit_serve/m.py:1 short")]


SCHEDULING = ROOT / "vit_serve" / "runtime" / "scheduling"
MAX_SCHEDULING_CLASS_LINES, MAX_SCHEDULING_FILE_LINES = 250, 400


def test_the_scheduler_is_in_small_pieces():
    """Issue 39: no class over 250 lines and no file over 400 in vit_serve/runtime/scheduling/."""
    import ast

    files = sorted(SCHEDULING.glob("*.py"))
    assert files
    long_files = [f"{p.name} ({n} lines)" for p in files if (n := len(p.read_text().splitlines())) >
                  MAX_SCHEDULING_FILE_LINES]
    classes = [(p.name, node) for p in files for node in ast.walk(ast.parse(p.read_text()))
               if isinstance(node, ast.ClassDef)]
    long_classes = [f"{name}:{node.name} ({n} lines)" for name, node in classes
                    if (n := node.end_lineno - node.lineno + 1) > MAX_SCHEDULING_CLASS_LINES]
    assert long_files == [] and long_classes == []


MAX_ROUTE_LINES = 30
HTTP_METHODS = {"get", "post", "put", "patch", "delete", "head", "options", "api_route", "websocket"}


def route_handler_lengths(root: Path) -> list[tuple[int, str]]:
    """(lines, "path:line name") of every route handler of vit_serve/serve/routes/ (a function decorated with
    `router.get(...)`, `.post(...)`, ...), from its `def` to its last line (decorators apart), longest first."""
    import ast

    rows = []
    for path in sorted((root / "vit_serve" / "serve" / "routes").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and any(
                    isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr in HTTP_METHODS
                    for d in node.decorator_list):
                rows.append((node.end_lineno - node.lineno + 1, f"{path.relative_to(root)}:{node.lineno} {node.name}"))
    return sorted(rows, key=lambda r: (-r[0], r[1]))


def test_route_handlers_are_thin():
    """Routes parse their query and shape their schema; the request itself is the pipeline's (issue 39)."""
    assert [f"{where} ({n} lines)" for n, where in route_handler_lengths(ROOT) if n > MAX_ROUTE_LINES] == []


def test_long_route_handlers_are_found(tmp_path):
    """The check itself: a 31-line handler is reported with its length; its decorator and plain functions are
    not counted."""
    routes = tmp_path / "vit_serve" / "serve" / "routes"
    routes.mkdir(parents=True)
    body = "".join(f"    x{i} = {i}\n" for i in range(30))
    (routes / "r.py").write_text(f"@router.post(\n    '/r',\n)\nasync def long():\n{body}\n\n\n"
                                 f"def helper():\n{body}\n\n\n@router.get('/s')\ndef short():\n    pass\n")
    assert route_handler_lengths(tmp_path) == [(31, "vit_serve/serve/routes/r.py:4 long"),
                                               (2, "vit_serve/serve/routes/r.py:73 short")]
