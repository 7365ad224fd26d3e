"""The benchmarks' pages (docs/benchmarks/*.md) and README.md's headline table are what benchmarks/render_results.py
renders from benchmarks/results/*.json now; and a results file round-trips and renders its numbers and verdicts."""

from __future__ import annotations

import json
from pathlib import Path

from bench_script import BENCH, load_script


def test_the_pages_and_the_readme_table_are_current() -> None:
    render = load_script("render_results")
    stale = [str(path.relative_to(render.ROOT)) for path, text in render.rendered().items()
             if not path.is_file() or path.read_text() != text]
    assert not stale, f"stale: {stale}; run python benchmarks/render_results.py"


def test_every_benchmark_has_a_page_linked_from_the_index() -> None:
    render = load_script("render_results")
    index = (render.DOCS / "index.md").read_text()
    for b in render.BENCHMARKS:
        assert (render.DOCS / f"{b.name}.md").is_file() and f"]({b.name}.md)" in index
        assert (BENCH / b.script).is_file(), b.script


def test_a_results_file_round_trips_and_its_page_shows_its_numbers(tmp_path: Path) -> None:
    rf = load_script("results_file")
    render = load_script("render_results")
    lines = ["Speed, 2 threads", "", "| runtime | images/s |", "|---|---:|", "| fp32 | 41.5 |", "| int8 | 80.25 |"]
    results = rf.ResultsFile.of("forward", rf.tables_in(lines), [("int8 / fp32", "1.93", ">= 1.5", True),
                                                                   ("fp32 / torch", "1.01", ">= 1.15", False)],
                                {"raw": (1, 2)}, {"rounds": 3, "out": tmp_path}, argv=["--rounds", "3"])
    assert results.saved_to(tmp_path) == 1  # a check failed: exit status 1
    raw = json.loads((tmp_path / "forward.json").read_text())
    assert raw["tables"][0] == {"title": "Speed, 2 threads", "columns": ["runtime", "images/s"],
                                "rows": [["fp32", 41.5], ["int8", 80.25]]}
    assert raw["passed"] is False and raw["args"]["out"] == str(tmp_path) and raw["data"] == {"raw": [1, 2]}
    assert raw["machine"]["cores"] >= 1 and raw["machine"]["cpu"]
    loaded = render.load("forward", tmp_path)
    assert loaded == results
    text = render.page(render.BENCHMARKS[0], loaded)
    assert "| fp32 | 41.5 |" in text and "| fp32 / torch | 1.01 | >= 1.15 | FAIL |" in text
    assert "python benchmarks/forward.py --rounds 3" in text and results.commit in text
    table = render.readme_table({b.name: (loaded if b.name == "forward" else None) for b in render.BENCHMARKS})
    assert "[forward](docs/benchmarks/forward.md) | int8 / fp32: 1.93 (target >= 1.5) | 1/2 pass" in table


def test_a_benchmark_without_results_in_this_format_gives_its_command_and_no_numbers(tmp_path: Path) -> None:
    render = load_script("render_results")
    (tmp_path / "forward.json").write_text(json.dumps({"cpu": "old format", "rows": [{"images/s": 20.7}]}))
    assert render.load("forward", tmp_path) is None
    text = render.page(render.BENCHMARKS[0], None)
    assert "Not yet run in this format" in text and "python benchmarks/forward.py" in text
    assert not any(ch.isdigit() for ch in text.split("```text")[0].replace("forward", ""))
