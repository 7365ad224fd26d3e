"""Every Python and shell example of README.md and docs/**/*.md runs, so none can rot.

Each fenced block names its language (`text` for output, trees and synopses). The ```python, ```bash / ```sh /
```shell and ```console (its `$ ` lines) blocks run, one process each, in the order of their page, in a working
folder of that page's own (every top-level entry of the repository linked into it, so `runs/`, `exports/` and
other outputs stay there). HTML comments on the lines before a block (blank lines between them allowed) change
how it runs; they show neither on GitHub nor on the site:

    <!-- docs-test: skip REASON -->              not run (a server that keeps running, Docker, a GPU, a download);
                                                 the reason is required, and counted in the summary
    <!-- docs-test: replace OLD => NEW -->       run with OLD replaced by NEW (OLD must be in the block): a long
                                                 example run on a small model, e.g. `=> --steps 2 --out`
    <!-- docs-test: timeout SECONDS -->          the block's limit (default 300 s)

`python -m pytest tests/docs/test_doc_examples.py -rs` lists every skipped block with its reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNS = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash", "console": "console"}
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(\w+)\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^\s`{]*)")
DEFAULT_TIMEOUT_S = 300


@dataclass
class Block:
    """One fenced block: where it is, its language, its text, and its markers."""

    path: Path
    line: int
    lang: str
    text: str
    skip: str | None = None
    replace: list[tuple[str, str]] = field(default_factory=list)
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _markers(lines: list[str], fence: int) -> list[tuple[str, str]]:
    """The docs-test comments in the lines before line `fence` (blank lines between them allowed)."""
    found, i = [], fence - 1
    while i >= 0 and (not lines[i].strip() or MARKER.match(lines[i])):
        if m := MARKER.match(lines[i]):
            found.append((m.group(1), m.group(2)))
        i -= 1
    return found[::-1]


def _apply(block: Block, markers: list[tuple[str, str]]) -> Block:
    for name, arg in markers:
        if name == "skip":
            block.skip = arg
        elif name == "replace" and "=>" in arg:
            old, new = (s.strip() for s in arg.split("=>", 1))
            block.replace.append((old, new))
        elif name == "timeout":
            block.timeout_s = float(arg)
        else:
            raise ValueError(f"{block.where}: unknown docs-test marker {name!r} {arg!r} (skip, replace, timeout)")
    return block


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, nested fences (in lists) unindented."""
    lines, out, i = path.read_text(encoding="utf-8").splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3).lower()
        j = i + 1
        while j < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[j]):
            j += 1
        body = "\n".join(line[indent:] if not indent or line[:indent].isspace() else line.lstrip()
                         for line in lines[i + 1:j])
        out.append(_apply(Block(path, i + 1, lang, body + "\n"), _markers(lines, i)))
        i = j + 1
    return out


ALL = [b for p in pages() for b in blocks(p)]
RUNNABLE = [b for b in ALL if b.lang in RUNS]


def _workdir(path: Path, factory: pytest.TempPathFactory, cache: dict[Path, Path] = {}) -> Path:  # noqa: B006
    """The page's working folder: the repository's top-level entries linked in, outputs kept apart."""
    if path not in cache:
        work = factory.mktemp(path.stem)
        for entry in ROOT.iterdir():
            if not entry.name.startswith(".") and entry.name not in ("runs", "exports", "site"):
                (work / entry.name).symlink_to(entry)
        cache[path] = work
    return cache[path]


def _script(block: Block) -> tuple[list[str], str]:
    text = block.text
    for old, new in block.replace:
        assert old in text, f"{block.where}: `replace {old} => ...` does not match the block any more"
        text = text.replace(old, new)
    kind = RUNS[block.lang]
    if kind == "python":
        return [sys.executable, "-"], text
    if kind == "console":
        text = "\n".join(line[2:] for line in text.splitlines() if line.startswith("$ ")) + "\n"
    return ["bash", "-euo", "pipefail", "-s"], text


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_example_runs(block: Block, tmp_path_factory: pytest.TempPathFactory) -> None:
    if block.skip is not None:
        pytest.skip(f"{block.where}: {block.skip}")
    cmd, script = _script(block)
    env = {**os.environ, "MPLBACKEND": "Agg",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run(cmd, input=script, cwd=_workdir(block.path, tmp_path_factory), env=env, text=True,
                              capture_output=True, timeout=block.timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.where}: still running after {block.timeout_s:g} s (a long example: mark it "
                    "`<!-- docs-test: replace ... -->` to run it small, or `timeout N`)")
    assert done.returncode == 0, (f"{block.where} ({block.lang}) exited {done.returncode}:\n{script}\n--- stdout\n"
                                  f"{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}")


def test_every_block_names_its_language() -> None:
    unnamed = [b.where for b in ALL if not b.lang]
    assert not unnamed, (f"fenced blocks without a language (```python / ```bash run in CI; ```text, ```toml, "
                         f"... do not): {', '.join(unnamed)}")


def test_skipped_examples_say_why() -> None:
    """Every skip has a reason; the summary (run with -s) says how many ran, how many were skipped, and why."""
    skipped = [b for b in RUNNABLE if b.skip is not None]
    assert all(b.skip.strip() for b in skipped), [b.where for b in skipped if not b.skip.strip()]
    reasons = Counter(b.skip for b in skipped)
    print(f"\n{len(RUNNABLE) - len(skipped)} examples run, {len(skipped)} skipped, of {len(ALL)} fenced blocks:")
    for reason, n in reasons.most_common():
        print(f"  {n} x {reason}")


def test_the_collector_reads_markers_and_nested_fences(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("Intro\n\n<!-- docs-test: skip needs Docker -->\n\n```bash\ndocker build .\n```\n\n"
                    "- a list item:\n\n    ```python\n    print(1)\n    ```\n\n"
                    "<!-- docs-test: replace --steps 500 => --steps 2 -->\n<!-- docs-test: timeout 60 -->\n"
                    "```sh\nvit-serve train --steps 500\n```\n\n````text\n```\nnot a fence\n```\n````\n\n"
                    "```python\nfor i in range(2):\n    print(i)\n```\n")
    found = blocks(page)
    assert [(b.lang, b.line) for b in found] == [("bash", 5), ("python", 11), ("sh", 17), ("text", 21),
                                                 ("python", 27)]
    assert found[0].skip == "needs Docker" and found[1].text == "print(1)\n" and found[1].skip is None
    assert found[2].replace == [("--steps 500", "--steps 2")] and found[2].timeout_s == 60
    assert found[3].text == "```\nnot a fence\n```\n"
    assert found[4].text == "for i in range(2):\n    print(i)\n"  # a top-level block keeps its indentation
    assert _script(found[2])[1] == "vit-serve train --steps 2\n"
