"""benchmarks/serve_embeddings.py at tiny settings (a tiny open_clip CLIP at 64 px exported with its text tower, one
round of a few requests): it runs end to end against a real gateway, /v1's image vector equals /embed's normalised,
and it writes its results (tables, the checks) where the benchmarks' results go (tests/benchmarks/conftest.py: a
temporary folder). The throughput ratio at these sizes is not a measurement: its check is reported, not asserted."""

from __future__ import annotations

import json

import pytest
from bench_script import load_script

pytest.importorskip("open_clip")
pytest.importorskip("skimage")


def test_tiny_run_writes_its_results(tmp_path, _results_elsewhere):
    m = load_script("serve_embeddings")
    m.main(["--clip", "tiny", "--requests", "8", "--rounds", "1", "--concurrency", "4", "--texts", "8",
            "--text-batch", "4", "--threads", "1", "--out", str(tmp_path / "run")])
    doc = json.loads((_results_elsewhere / "serve_embeddings.json").read_text())
    assert doc == json.loads((tmp_path / "run" / "results.json").read_text())
    checks = {c["check"]: c for c in doc["checks"]}
    assert "/v1/embeddings / /embed, median images/s (c=4)" in checks
    assert checks["/v1 image vector vs /embed's normalised, max abs difference"]["passed"]
    assert set(doc["data"]["texts_per_s"]) == {"1", "4"} and all(v > 0 for v in doc["data"]["texts_per_s"].values())
    assert len(doc["data"]["images_per_s"]["/v1/embeddings c=4"]) == 1
