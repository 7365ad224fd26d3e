"""The shape of the code: modules and lines per package, the longest functions, import cycles, and the CLI flags
generated from typed fields vs written by hand. `python benchmarks/code_shape.py [ROOT]` (ROOT: a checkout,
default this one, e.g. a `git worktree` of an older commit to compare before and after)."""

from __future__ import annotations

import argparse
import ast
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
FLAG_CALL = re.compile(r"\.add_argument\(\s*['\"]-")  # an option spelled out at its call: written by hand


def package_of(path: Path, root: Path) -> str:
    """`vit_serve/serve/routes/v2.py` -> `vit_serve.serve.routes`; export/ is `vit_export`."""
    parts = list(path.relative_to(root).parent.parts)
    parts[0] = "vit_export" if parts[0] == "export" else parts[0]
    return ".".join(parts)


def lines_per_package(root: Path) -> dict[str, tuple[int, int]]:
    """package -> (modules, lines) over vit_serve/ and export/."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for top in ("vit_serve", "export"):
        for path in sorted((root / top).rglob("*.py")):
            row = out[package_of(path, root)]
            row[0] += 1
            row[1] += len(path.read_text().splitlines())
    return {k: (v[0], v[1]) for k, v in sorted(out.items())}


def function_lengths(root: Path) -> list[tuple[int, str]]:
    """(lines, "path:line name") of every function of vit_serve/ and export/, longest first."""
    rows = []
    for top in ("vit_serve", "export"):
        for path in sorted((root / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    rows.append((node.end_lineno - node.lineno + 1,
                                 f"{path.relative_to(root)}:{node.lineno} {node.name}"))
    return sorted(rows, key=lambda r: (-r[0], r[1]))


def import_cycles(graph) -> list[tuple[str, str]]:
    """Pairs (a, b) of a grimp graph where a imports b directly and b reaches a back through any chain."""
    cycles = []
    for a in sorted(graph.modules):
        for b in sorted(graph.find_modules_directly_imported_by(a)):
            if (a < b or not graph.direct_import_exists(importer=b, imported=a)) and \
                    graph.chain_exists(importer=b, imported=a):
                cycles.append((a, b))
    return cycles


def importable(root: Path) -> Path:
    """A folder that makes ROOT's packages importable as vit_serve and vit_export (export/ is installed under
    that name), put first on sys.path."""
    folder = Path(tempfile.mkdtemp(prefix="code_shape_"))
    (folder / "vit_serve").symlink_to(root / "vit_serve")
    (folder / "vit_export").symlink_to(root / "export")
    sys.path.insert(0, str(folder))
    return folder


def flag_counts(root: Path) -> dict[str, tuple[int, int]]:
    """command -> (options its parser has, options spelled out by hand at an add_argument call)."""
    from vit_export.cli import build_parser as export_parser

    from vit_serve.cli import build_parser

    parsers = {"vit-export": export_parser()}
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            parsers.update({f"vit-serve {k}": p for k, p in action.choices.items()})
    total = {k: sum(1 for a in p._actions if a.option_strings and a.dest != "help") for k, p in parsers.items()}
    sources = {"vit-export": [root / "export" / "cli.py"]}
    hand: dict[str, int] = {}
    serve_sources = [*(root / "vit_serve").glob("cli*.py"), *(root / "vit_serve" / "cli").glob("*.py")]
    text = "\n".join(p.read_text() for p in serve_sources)
    # A command's hand-written options: add_argument calls between its add_parser(...) and the next one.
    blocks = re.split(r"add_parser\(\s*['\"]", text)
    for block in blocks[1:]:
        name = block.split("'", 1)[0].split('"', 1)[0]
        hand[f"vit-serve {name}"] = len(FLAG_CALL.findall(block.split("add_parser(", 1)[0]))
    hand["vit-export"] = sum(len(FLAG_CALL.findall(p.read_text())) for p in sources["vit-export"])
    return {k: (total[k], min(hand.get(k, 0), total[k])) for k in sorted(total)}


def main(argv: list[str] | None = None) -> None:
    root = Path((argv or sys.argv[1:] or [str(HERE)])[0]).resolve()
    importable(root)
    import grimp

    print(f"# code shape of {root}\n\n| package | modules | lines |\n|---|---:|---:|")
    sizes = lines_per_package(root)
    for pkg, (mods, lines) in sizes.items():
        print(f"| {pkg} | {mods} | {lines} |")
    print(f"| **all** | {sum(m for m, _ in sizes.values())} | {sum(n for _, n in sizes.values())} |")
    lengths = function_lengths(root)
    print(f"\nfunctions over 100 lines: {sum(1 for n, _ in lengths if n > 100)}; over 60: "
          f"{sum(1 for n, _ in lengths if n > 60)}; the ten longest:\n")
    for n, where in lengths[:10]:
        print(f"- {n:4d}  {where}")
    cycles = import_cycles(grimp.build_graph("vit_serve", "vit_export", cache_dir=None))
    print(f"\nimport cycles (module pairs): {len(cycles)}")
    for a, b in cycles:
        print(f"- {a} <-> {b}")
    print("\n| command | options | written by hand | generated from fields |\n|---|---:|---:|---:|")
    for cmd, (total, hand) in flag_counts(root).items():
        print(f"| {cmd} | {total} | {hand} | {total - hand} |")


if __name__ == "__main__":
    main()
