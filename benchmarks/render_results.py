"""Render the benchmarks' pages and the README's headline table from benchmarks/results/*.json.

    python benchmarks/render_results.py           # write docs/benchmarks/*.md and README.md's table
    python benchmarks/render_results.py --check   # exit 1 if any of them differs from what it renders now

One page per benchmark of `BENCHMARKS` (docs/benchmarks/NAME.md): what it measures (its script's docstring), the
command that reproduces it, the commit, date and machine of the run, its verdicts and its tables, every number
from the results file (`results_file.ResultsFile`). A benchmark without a results file in this format gets a page
that says so and gives the command; no number is written by hand. docs/benchmarks/index.md lists them, and
README.md's table between `<!-- results:start -->` and `<!-- results:end -->` has one line per run.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, a sibling, also when loaded by path
from results_file import RESULTS, ROOT, ResultsFile, Table

DOCS = ROOT / "docs" / "benchmarks"
README = ROOT / "README.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"
# The charts benchmarks/figures.py draws from a benchmark's results file, shown on its page.
CHARTS = {"digits_transfer": ("resolution_transfer.png", "Held-out top-1 by resample mode, transfer and fine-tune")}


@dataclass(frozen=True)
class Benchmark:
    """A benchmark: its results' name, its script, the command that runs it (the default settings) and, for
    the modes of serve_load.py, what it measures (else the script's docstring says)."""

    name: str
    script: str
    command: str
    about: str = ""


BENCHMARKS = (
    Benchmark("forward", "forward.py", "python benchmarks/forward.py"),
    Benchmark("families", "families.py", "python benchmarks/families.py"),
    Benchmark("train_throughput", "train_throughput.py", "python benchmarks/train_throughput.py"),
    Benchmark("preprocess", "preprocess.py", "python benchmarks/preprocess.py"),
    Benchmark("export_onnx", "export_onnx.py", "python benchmarks/export_onnx.py"),
    Benchmark("export_memory", "export_memory.py", "python benchmarks/export_memory.py"),
    Benchmark("tome", "tome.py", "python benchmarks/tome.py"),
    Benchmark("digits_transfer", "digits_transfer.py", "python benchmarks/digits_transfer.py"),
    Benchmark("patch_resize", "patch_resize.py", "python benchmarks/patch_resize.py"),
    Benchmark("mpp_digits", "mpp_digits.py", "python benchmarks/mpp_digits.py"),
    Benchmark("predict", "predict.py", "python benchmarks/predict.py"),
    Benchmark("embed_dinov2", "embed_dinov2.py", "python benchmarks/embed_dinov2.py"),
    Benchmark("monitoring", "monitoring.py", "python benchmarks/monitoring.py"),
    Benchmark("text_labels", "text_labels.py", "python benchmarks/text_labels.py"),
    Benchmark("zero_shot_abstention", "zero_shot_abstention.py", "python benchmarks/zero_shot_abstention.py"),
    Benchmark("serve_uploads", "serve_load.py", "python benchmarks/serve_load.py --mode uploads",
              "Serving real uploads: the fast and exact decode paths side by side, 12 MP phone JPEGs and small "
              "photos, at concurrency 1, 16 and 64, with the server's memory peak against its settings' ceiling."),
    Benchmark("serve_batching", "serve_batching.py", "python benchmarks/serve_load.py --mode batching",
              "Dynamic batching on and off against the backend's offline throughput, at concurrency 1 to 64."),
    Benchmark("serve_routing", "serve_load.py", "python benchmarks/serve_load.py --mode routing",
              "A repository of three models routed by `?model=` against a single-model gateway."),
    Benchmark("serve_security", "serve_load.py", "python benchmarks/serve_load.py --mode security",
              "API keys and request ids on against off: throughput and server CPU per image."),
    Benchmark("cpu_runtimes", "cpu_runtimes.py", "python benchmarks/cpu_runtimes.py"),
    Benchmark("serve_backends", "serve_backends.py", "python benchmarks/serve_load.py --mode backends"),
    Benchmark("serve_embeddings", "serve_embeddings.py", "python benchmarks/serve_embeddings.py"),
    Benchmark("serve_abuse", "serve_abuse.py", "python benchmarks/serve_load.py --mode abuse",
              "Normal traffic alone and beside abusive requests: throughput kept, memory under the settings' "
              "ceiling, every abusive request refused with a 4xx."),
    Benchmark("serve_faults", "serve_faults.py", "python benchmarks/serve_load.py --mode faults",
              "Faults under traffic (redis, tritonserver, a full disk, SIGTERM during a reload): no request lost, "
              "only the expected 503s, recovery times."),
    Benchmark("serve_lifecycle", "serve_lifecycle.py", "python benchmarks/serve_load.py --mode lifecycle",
              "Every request accounted for: hang-ups, a retry storm, priorities and shadow traffic, against the "
              "gateway before issue 22."),
)


def about(b: Benchmark) -> str:
    """What the benchmark measures: its own line, else its script's docstring (up to the first blank line)."""
    if b.about:
        return b.about
    doc = ast.get_docstring(ast.parse((ROOT / "benchmarks" / b.script).read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split())


def load(name: str, folder: Path = RESULTS) -> ResultsFile | None:
    """NAME's results in this format, or None (no file, or one in an older format)."""
    path = folder / f"{name}.json"
    try:
        return ResultsFile.load(path)
    except (FileNotFoundError, ValueError, TypeError, KeyError):
        return None


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value).replace("|", "\\|")


def markdown_table(t: Table) -> list[str]:
    head = "| " + " | ".join(_cell(c) for c in t.columns) + " |"
    rule = "|" + "|".join("---:" if any(isinstance(r[i], (int, float)) and not isinstance(r[i], bool)
                                        for r in t.rows if i < len(r)) else "---"
                          for i in range(len(t.columns))) + "|"
    return [head, rule, *("| " + " | ".join(_cell(c) for c in r) + " |" for r in t.rows)]


def page(b: Benchmark, r: ResultsFile | None, older: bool = False) -> str:
    """docs/benchmarks/NAME.md (`older`: benchmarks/results/NAME.json holds a run in an older format)."""
    lines = [f"# {b.name}", "", about(b), "", f"Script: `benchmarks/{b.script}`.", ""]
    if r is None:
        lines += ["**Not yet run in this format.** Run it with:", "", "```text", b.command, "```", "",
                  f"It writes `benchmarks/results/{b.name}.json`; `python benchmarks/render_results.py` then renders "
                  "this page from it.", ""]
        if older:
            lines += [f"`benchmarks/results/{b.name}.json` now holds an earlier run in an older format, without "
                      "the commit and the machine it ran on; it is not shown here.", ""]
        return "\n".join(lines)
    verdict = ("every check passed" if r.passed else "some checks FAILED") if r.checks else "no targets: reported"
    lines += ["Reproduce (the command of this run):", "", "```text", r.command, "```", "",
              f"Ran at commit `{r.commit}` on {r.date}, on: {r.machine.describe()}.", "",
              f"## Verdicts: {verdict}", ""]
    if r.checks:
        lines += ["| check | value | target | verdict |", "|---|---:|---|---|",
                  *(f"| {_cell(c.check)} | {_cell(c.value)} | {_cell(c.target)} | {'pass' if c.passed else 'FAIL'} |"
                    for c in r.checks), ""]
    else:
        lines += ["This benchmark has no targets; its numbers are reported.", ""]
    if b.name in CHARTS:
        picture, alt = CHARTS[b.name]
        lines += [f"![{alt}](../assets/{picture})", "", "(drawn from this results file by "
                  "`python benchmarks/figures.py --only transfer`)", ""]
    for i, t in enumerate(r.tables, 1):
        heading = "Results" if len(r.tables) == 1 else f"Results {i}"
        lines += [f"## {heading}", "", *([f"{_cell(t.title)}:", ""] if t.title else []), *markdown_table(t), ""]
    if b.command not in r.command:
        lines += [f"The default settings: `{b.command}`.", ""]
    return "\n".join(lines)


def index(results: dict[str, ResultsFile | None]) -> str:
    """docs/benchmarks/index.md."""
    lines = ["# Benchmarks", "",
             "Each benchmark compares side by side in one run (ratios, not absolute times: the machines are shared) "
             "and writes its results to `benchmarks/results/NAME.json`: the commit, the date, the machine (CPU "
             "model, cores, ISA flags), its tables and its verdicts against its targets. Each page below is "
             "rendered from that file by `python benchmarks/render_results.py`; earlier runs are in git's history "
             "of the file.", "",
             "| benchmark | what | last run | verdict |", "|---|---|---|---|"]
    for b in BENCHMARKS:
        r = results[b.name]
        what = about(b).split(". ")[0].split(": ")[0].rstrip(".")
        when = f"{r.date[:10]}, `{r.commit}`" if r else "not yet run in this format"
        verdict = "" if r is None else (f"{sum(c.passed for c in r.checks)}/{len(r.checks)} checks pass"
                                        if r.checks else "reported, no target")
        lines.append(f"| [{b.name}]({b.name}.md) | {_cell(what)} | {when} | {verdict} |")
    lines += ["", "The pictures of these docs, and the one command that remakes them: [pictures](pictures.md).", "",
              "Not benchmarks of this kind: `benchmarks/gpu_check.py` (the CUDA paths, one verdict per stage, for "
              "a machine with a GPU) writes its own report to `--out`; `benchmarks/code_shape.py` and "
              "`benchmarks/rooms_walk.py` describe the code, not its speed."]
    return "\n".join([*lines, ""])


def readme_table(results: dict[str, ResultsFile | None]) -> str:
    """The README's headline table: one line per benchmark that has results, its first check."""
    lines = [START, "| benchmark | headline | verdict | machine, commit |", "|---|---|---|---|"]
    for b in BENCHMARKS:
        r = results[b.name]
        if r is None:
            continue
        c = r.checks[0] if r.checks else None
        head = f"{_cell(c.check)}: {_cell(c.value)} (target {_cell(c.target)})" if c else "reported, no target"
        verdict = f"{sum(x.passed for x in r.checks)}/{len(r.checks)} pass" if r.checks else "-"
        machine = f"{r.machine.cpu}, {r.machine.cores} cores, `{r.commit}`"
        lines.append(f"| [{b.name}](docs/benchmarks/{b.name}.md) | {head} | {verdict} | {machine} |")
    return "\n".join([*lines, END])


def with_readme_table(readme: str, table: str) -> str:
    """README.md's text with the table between the markers replaced."""
    start, end = readme.find(START), readme.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"README.md has no {START} ... {END} markers")
    return readme[:start] + table + readme[end + len(END):]


def rendered(folder: Path = RESULTS) -> dict[Path, str]:
    """Every file this renders, with its text as rendered from `folder`'s results now."""
    results = {b.name: load(b.name, folder) for b in BENCHMARKS}
    out = {DOCS / f"{b.name}.md": page(b, results[b.name], (folder / f"{b.name}.json").is_file())
           for b in BENCHMARKS}
    out[DOCS / "index.md"] = index(results)
    out[README] = with_readme_table(README.read_text(), readme_table(results))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file differs")
    args = ap.parse_args(argv)
    stale = []
    for path, text in rendered().items():
        if path.is_file() and path.read_text() == text:
            continue
        stale.append(path)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for path in stale:
        print(f"{'stale' if args.check else 'wrote'}: {path.relative_to(ROOT)}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
