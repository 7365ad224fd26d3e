"""benchmarks/serve_load.py --mode faults (benchmarks/serve_faults.py) at a tiny size, so that it cannot rot: a
Ti/16 at 32 px, four clients, the quick faults (redis-server killed and restarted, the sample folder's disk full,
SIGTERM during a hot reload) against a real `vit-serve serve` process, a real redis-server and the real
filesystem; every check of its results passes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_load.py"

pytest.importorskip("uvicorn")
pytest.importorskip("redis")
pytest.importorskip("pyarrow")


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server here")
def test_the_faults_mode_survives_its_quick_faults(tmp_path: Path) -> None:
    results = tmp_path / "faults.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--mode", "faults", "--faults", "redis,disk,sigterm",
                          "--model", "Ti/16", "--res", "32", "--concurrency", "4", "--threads", "1",
                          "--pre-s", "1", "--down-s", "1", "--post-s", "2", "--out", str(tmp_path / "work"),
                          "--results", str(results)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    got = json.loads(results.read_text())
    faults = {f["fault"].split()[0]: f for f in got["data"]["faults"]}
    assert set(faults) == {"redis", "sample", "SIGTERM"}
    assert got["passed"] and all(c["passed"] for c in got["checks"]), got["checks"]
    redis = faults["redis"]
    assert redis["statuses"]["/explain"].get("503", 0) > 0 and redis["recovery_s"] is not None  # it was down
    assert redis["statuses"]["/classify"] == {"200": redis["statuses"]["/classify"]["200"]}  # classify went on
    disk = faults["sample"]
    assert disk["samples_dropped_disk_full"] > 0 and disk["warnings"] == 1 and disk["parts_written"] > 0
    assert faults["SIGTERM"]["exit_status"] == 0 and faults["SIGTERM"]["lost"] == 0
    assert "| fault | 2xx |" in run.stdout
