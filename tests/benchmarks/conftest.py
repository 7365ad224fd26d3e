"""The benchmarks' smoke runs write their results files under the test's temporary folder, never over the
committed benchmarks/results/ (results_file.results_path reads VIT_SERVE_BENCH_RESULTS)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _results_elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "bench_results"
    monkeypatch.setenv("VIT_SERVE_BENCH_RESULTS", str(folder))
    return folder
