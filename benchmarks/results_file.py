"""The benchmarks' results file: one typed record per benchmark, benchmarks/results/NAME.json.

Every benchmark script ends with `ResultsFile.of(NAME, tables, checks, data).save()`: the commit and date it ran
at, the machine (`machine_info`: CPU model, cores, ISA flags, Python and the runtimes' versions), the command that
reproduces it, its tables (rows as data), its checks against its targets (the verdicts) and whatever raw numbers
it keeps. The latest run replaces the last; the history stays in git. benchmarks/render_results.py renders the
docs' pages and the README's headline table from these files. VIT_SERVE_BENCH_RESULTS names another folder (the
tests' runs write there, never over the committed results).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

SCHEMA = 1
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# The ISA flags that decide a CPU benchmark's numbers (SIMD width, int8 dot products, bf16, AMX tiles).
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")

Cell = str | int | float | bool | None


@dataclass(frozen=True)
class Machine:
    """Where a benchmark ran: what its numbers depend on."""

    cpu: str
    cores: int
    isa: list[str]
    system: str
    python: str
    versions: dict[str, str] = field(default_factory=dict)
    load_average: float | None = None  # the 1-minute load when the run ended: how shared the machine was

    def describe(self) -> str:
        isa = ", ".join(self.isa) or "no AVX2"
        runtimes = ", ".join(f"{k} {v}" for k, v in self.versions.items())
        load = f"; load average {self.load_average:.1f}" if self.load_average is not None else ""
        return f"{self.cpu}; {self.cores} cores; {isa}; {self.system}; Python {self.python}" + (
            f"; {runtimes}" if runtimes else "") + load


@dataclass(frozen=True)
class Table:
    """One table of a run: its columns and its rows (cells as numbers where they are numbers)."""

    title: str
    columns: list[str]
    rows: list[list[Cell]]

    @classmethod
    def from_markdown(cls, title: str, lines: list[str]) -> Table:
        """The first markdown table in `lines` (the lines a script prints), its cells parsed as numbers where
        they are plain numbers."""
        body = [ln.strip() for ln in lines if ln.strip().startswith("|")]
        if not body:
            raise ValueError(f"{title!r}: no markdown table in the lines given")
        split = [[c.strip() for c in ln.strip("|").split("|")] for ln in body]
        rows = [r for r in split[1:] if not all(re.fullmatch(r":?-+:?", c) for c in r)]
        return cls(title, split[0], [[_cell(c) for c in r] for r in rows])

    @classmethod
    def from_dicts(cls, title: str, rows: list[dict[str, Any]], columns: list[str] | None = None) -> Table:
        """Rows given as dicts; the columns are `columns` or the first row's keys."""
        columns = columns or (list(rows[0]) if rows else [])
        return cls(title, columns, [[_plain(r.get(c)) for c in columns] for r in rows])


@dataclass(frozen=True)
class Check:
    """One verdict: a measured value against its target."""

    check: str
    value: str
    target: str
    passed: bool


@dataclass(frozen=True)
class ResultsFile:
    """A benchmark's results, as benchmarks/results/NAME.json holds them."""

    name: str
    command: str
    commit: str
    date: str
    machine: Machine
    args: dict[str, Cell]
    tables: list[Table]
    checks: list[Check]
    data: dict[str, Any] = field(default_factory=dict)
    schema: int = SCHEMA

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @classmethod
    def of(cls, name: str, tables: list[Table], checks: list[Check] | list[tuple[str, str, str, bool]],
           data: dict[str, Any] | None = None, args: Any = None, argv: list[str] | None = None,
           script: str | None = None) -> ResultsFile:
        """This run's results: the commit, date and machine now; the command: `script` (default: the running
        benchmarks/*.py, else NAME.py) with `argv` (default sys.argv[1:]); `args` an argparse Namespace or dict."""
        running = Path(sys.argv[0])
        script = script or (running.name if running.parent.name == "benchmarks" else f"{name}.py")
        argv = sys.argv[1:] if argv is None else argv
        command = " ".join(["python", f"benchmarks/{script}", *map(_quote, argv)])
        raw = vars(args) if args is not None and not isinstance(args, dict) else (args or {})
        return cls(name=name, command=command, commit=git_commit(script), date=_now(), machine=machine_info(),
                   args={k: _plain(v) for k, v in raw.items()}, tables=tables,
                   checks=[c if isinstance(c, Check) else Check(*c) for c in checks], data=_plain(data or {}))

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "passed": self.passed}, indent=2, ensure_ascii=False) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ResultsFile:
        raw = json.loads(text)
        if raw.get("schema") != SCHEMA:
            raise ValueError(f"not a results file of schema {SCHEMA} (an older format)")
        raw.pop("passed", None)
        return cls(**{**raw, "machine": Machine(**raw["machine"]), "tables": [Table(**t) for t in raw["tables"]],
                      "checks": [Check(**c) for c in raw["checks"]]})

    @classmethod
    def load(cls, path: Path) -> ResultsFile:
        return cls.from_json(path.read_text())

    def saved_to(self, folder: Path) -> int:
        """`save` into `folder` as NAME.json."""
        return self.save(folder / f"{self.name}.json")

    def save(self, path: Path | None = None) -> int:
        """Write the file (results_path(name) unless `path`; the latest run replaces the last) and say where;
        the exit code: 0 when every check passed, else 1."""
        path = path or results_path(self.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)
        print(f"\nresults: {path}")
        return 0 if self.passed else 1


def print_checks(checks: list[tuple[str, str, str, bool]]) -> None:
    """The checks as the markdown table a run prints."""
    print("\n| check | value | target | |\n|---|---:|---|---|")
    for name, value, target, ok in checks:
        print(f"| {name} | {value} | {target} | {'pass' if ok else 'FAIL'} |")


@contextlib.contextmanager
def printed() -> Iterator[list[str]]:
    """The lines printed to stdout inside the block (still printed), for `tables_in`: a script's tables as it
    prints them."""
    lines: list[str] = []
    seen = io.StringIO()

    class Tee(io.TextIOBase):
        def write(self, text: str) -> int:
            seen.write(text)
            return real.write(text)

        def flush(self) -> None:
            real.flush()

    real = sys.stdout
    sys.stdout = Tee()
    try:
        yield lines
    finally:
        sys.stdout = real
        lines.extend(seen.getvalue().splitlines())


def tables_in(lines: list[str], title: str = "") -> list[Table]:
    """Every markdown table in the lines a script prints, each titled by the text line just above it (else
    `title`)."""
    tables, block, above = [], [], title
    for line in [*lines, ""]:
        if line.strip().startswith("|"):
            block.append(line)
            continue
        if block:
            tables.append(Table.from_markdown(above, block))
            block = []
        if line.strip():
            above = line.strip().rstrip(":")
    return tables


def checks_in(tables: list[Table]) -> tuple[list[Table], list[Check]]:
    """The tables other than the checks' (`print_checks`'s: check | value | target | pass/FAIL), and the checks."""
    rest, checks = [], []
    for t in tables:
        if t.columns[0] == "check" and t.columns[2] == "target":  # the value column: "value" or "measured"
            checks += [Check(str(r[0]), str(r[1]), str(r[2]), r[3] in ("pass", "met")) for r in t.rows]
        else:
            rest.append(t)
    return rest, checks


def record_printed(name: str, run: Callable[[list[str] | None], int | None], argv: list[str] | None = None,
                   derive: Callable[[list[Table]], list[Check]] | None = None) -> int:
    """Run a script's `run(argv)` and save what it printed as NAME's results: every markdown table it printed
    (titled by the line above), its printed checks table as the checks (and those `derive` finds in the tables).
    The exit code: `run`'s when it is not 0, else 0 when every check passed, else 1."""
    with printed() as lines:
        code = run(argv)
    tables, checks = checks_in(tables_in(lines))
    checks += derive(tables) if derive else []
    if derive:
        print_checks([(c.check, c.value, c.target, c.passed) for c in checks])
    saved = ResultsFile.of(name, tables, checks, argv=argv).save()
    return code or saved


def results_path(name: str) -> Path:
    """Where NAME's results go: VIT_SERVE_BENCH_RESULTS/NAME.json, else benchmarks/results/NAME.json."""
    return Path(os.environ.get("VIT_SERVE_BENCH_RESULTS") or RESULTS) / f"{name}.json"


def machine_info() -> Machine:
    """The CPU model, its cores and ISA flags (/proc/cpuinfo on Linux, else the platform), the OS, Python and
    the versions of torch and onnxruntime where they are installed."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")),
                 platform.processor() or platform.machine())
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))
    versions = {}
    for dist in ("torch", "onnxruntime"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[dist] = metadata.version(dist)
    return Machine(cpu=model, cores=os.cpu_count() or 1, isa=[f for f in ISA_FLAGS if f in flags],
                   system=f"{platform.system()} {platform.machine()}", python=platform.python_version(),
                   versions=versions, load_average=round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None)


def git_commit(script: str = "") -> str:
    """The checkout's commit, with "+dirty" when the code measured (vit_serve/, export/) or the benchmark's own
    files (`script`, its harness) differ from it."""
    paths = ["vit_serve", "export", "benchmarks/results_file.py", "benchmarks/harness.py"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *paths,
                                *([f"benchmarks/{script}"] if script else [])],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(str(arg))


def _cell(text: str) -> Cell:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _plain(value: Any) -> Any:
    """JSON's types: paths and other objects as strings, tuples as lists, dict keys as strings."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
