"""benchmarks/monitoring.py --quick on a tiny random model: parts (a) and (b)'s tables have their rows and columns,
the AUROC is a probability, and its pieces (AUROC, the alarm stream) are right on known inputs; part (c)'s two
gateways serve the runtime it names."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "monitoring.py"


def _script():
    spec = importlib.util.spec_from_file_location("monitoring_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _rows(text: str, header: str) -> list[list[str]]:
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {header}"))
    rows = []
    for ln in lines[start:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip("|").split("|")])
    return rows


def test_auroc_is_mann_whitney():
    auroc = _script().auroc
    assert auroc(np.array([0.0, 1.0]), np.array([2.0, 3.0])) == 1.0
    assert auroc(np.array([2.0, 3.0]), np.array([0.0, 1.0])) == 0.0
    assert auroc(np.array([1.0, 1.0]), np.array([1.0, 1.0])) == 0.5
    rng = np.random.default_rng(0)
    a, b = rng.normal(0, 1, 300), rng.normal(1, 1, 200)
    assert abs(auroc(a, b) - (b[:, None] > a[None]).mean()) < 1e-9


def test_quick_parts_a_and_b(tmp_path, save_tiny):
    model = save_tiny(tmp_path / "tiny.safetensors", (32, 32), 0, [str(d) for d in range(10)])
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, str(SCRIPT), "--model", str(model), "--parts", "a,b", "--quick",
                          "--crops", "24", "--stream", "150", "--repeats", "3", "--check-every", "10"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert time.monotonic() - t0 < 60
    bench = _script()
    a = _rows(run.stdout, "method")
    assert a[0] == ["method", *bench.OOD_SETS]
    assert [r[0].removesuffix(" *") for r in a[2:]] == list(bench.METHODS)
    assert all(0.0 <= float(v) <= 1.0 for r in a[2:] for v in r[1:])
    b = _rows(run.stdout, "reference")
    assert len(b) == 4 and len(b[0]) == 5
    for r in b[2:]:
        done, checks = map(int, re.fullmatch(r"(\d+) / (\d+)", r[2]).groups())
        assert 0 <= done <= checks == 6  # (150 - 100) / 10 + 1 checks
        assert 0.0 <= float(r[3]) <= 1.0
        assert r[4] in ("none", "already in alarm") or 1 <= int(r[4]) <= 2000


def test_part_c_serves_the_runtime_named_on_both_gateways(tmp_path, save_tiny):
    """Both gateways of the cost comparison serve --runtime (pinned), not what each one's load-time measurement
    would pick: on a shared machine the two could otherwise differ and the ratio would compare runtimes."""
    model = save_tiny(tmp_path / "tiny.safetensors", (32, 32), 0, [str(d) for d in range(10)])
    run = subprocess.run([sys.executable, str(SCRIPT), "--model", str(model), "--parts", "c", "--quick",
                          "--crops", "8", "--per-round", "32", "--runtime", "eager"],
                         capture_output=True, text=True, timeout=300)
    # exit 1: a check missed its target (one round of 32 requests on a busy machine is noise), not a crash
    assert run.returncode in (0, 1) and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert "| (c) images/s, monitoring on / off |" in run.stdout
    c = _rows(run.stdout, "gateway")
    assert [r[0] for r in c[2:]] == ["monitoring on", "monitoring off"]
    assert all(r[3].startswith("eager:fp32; max batch") for r in c[2:]), c


def test_help():
    run = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "--quick" in run.stdout and "--parts" in run.stdout
