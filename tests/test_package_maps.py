"""Every package's `__init__.py` docstring is a map of the package, and the map is true.

The convention: a map entry is a docstring line that starts (after its indentation) with `- ` or `* ` and then
one or more backquoted names, separated by commas, before a colon:

    - `settings`, `config_file`: what they hold
    - `routes/`: a subpackage (or another folder of the package) ends with a slash

Each name is a module (`name.py`) or, with its slash, a folder of the package. Every module and subpackage must be
listed, and everything listed must exist. Dunder modules (`__main__`) need no entry. The docstrings are read with
`ast`, nothing is imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_ROOTS = (ROOT / "vit_serve", ROOT / "export")  # export/ is installed as vit_export
ENTRY = re.compile(r"^\s*[-*]\s+((?:`[A-Za-z_]\w*/?`\s*,\s*)*`[A-Za-z_]\w*/?`)\s*:")
NAME = re.compile(r"`([A-Za-z_]\w*/?)`")


def _packages() -> list[Path]:
    return sorted(init.parent for top in PACKAGE_ROOTS for init in top.rglob("__init__.py")
                  if "__pycache__" not in init.parts)


def map_of(docstring: str) -> list[str]:
    """The names a package docstring's map lists, in order (`sub/` for a folder)."""
    return [name for line in docstring.splitlines() if (m := ENTRY.match(line)) for name in NAME.findall(m.group(1))]


def _members(package: Path) -> set[str]:
    """The modules (`name`) and subpackages (`name/`) that must be listed."""
    modules = {f.stem for f in package.glob("*.py") if not f.stem.startswith("__")}
    subpackages = {f"{d.name}/" for d in package.iterdir() if (d / "__init__.py").is_file()}
    return modules | subpackages


def _docstring(package: Path) -> str:
    return ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""


def test_the_convention_reads_entries_and_only_entries():
    doc = """Intro naming `not_an_entry` in prose.

    - `alpha`: one
    * `beta`, `gamma/`: two at once
      - `delta`: indented
    - `epsilon` without a colon is prose
    `zeta`: no bullet, prose
    """
    assert map_of(doc) == ["alpha", "beta", "gamma/", "delta"]


def test_every_package_is_found():
    found = {p.relative_to(ROOT).as_posix() for p in _packages()}
    assert {"vit_serve", "vit_serve/serve", "vit_serve/runtime/scheduling", "export", "export/triton_models"} <= found


@pytest.mark.parametrize("package", _packages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_package_docstring_maps_every_module_and_nothing_else(package: Path):
    doc = _docstring(package)
    assert doc, f"{package / '__init__.py'} has no docstring"
    listed = map_of(doc)
    assert len(listed) == len(set(listed)), f"listed twice: {sorted(n for n in listed if listed.count(n) > 1)}"
    missing = [name for name in listed
               if not ((package / name).is_dir() if name.endswith("/") else (package / f"{name}.py").is_file())]
    assert missing == [], f"{package.name}'s map lists what does not exist"
    unlisted = sorted(_members(package) - set(listed))
    assert unlisted == [], f"{package.name}'s map does not list these (add a `- \\`name\\`: ...` line)"
