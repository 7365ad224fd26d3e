"""`vit-export --res dynamic` in bounded memory: its peak RSS, measured on the export process itself.

Reference: the kernel's own accounting of the export process (VmRSS sampled from /proc, and the process's
VmHWM, its high-water mark since exec), through benchmarks/export_memory.py's `measure_export`, which kills the
export once it passes the bound. A 384 ViT-Ti (timm's preset, random weights) exported with a dynamic resolution
needed 7.7 GB while its parity check held every layer's attention of batch 8 at 576 x 576 in PyTorch and in
onnxruntime; it now needs about 2 GB (1.2 of them the libraries themselves). The bound is generous: memory, not
time.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
pytest.importorskip("timm")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "export_memory.py"
BOUND_GB = 3.5


def _script():
    spec = importlib.util.spec_from_file_location("export_memory_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_a_dynamic_export_of_a_384_vit_ti_stays_under_the_bound(tmp_path):
    bench = _script()
    ckpt = bench.make_checkpoint("Ti/16", 384, tmp_path / "ti.safetensors")
    m = bench.measure_export(ckpt, ["--res", "dynamic", "--out", str(tmp_path / "out")], int(BOUND_GB * bench.GB),
                             timeout_s=1200)
    assert not m.killed, f"killed at {m.sampled_peak_bytes / bench.GB:.2f} GB (bound {BOUND_GB} GB):\n{m.tail}"
    assert m.returncode == 0, m.tail
    assert 0 < m.peak_rss_bytes < BOUND_GB * bench.GB
    # The check is as strong as before: the three sizes, the batch axis at the model's own size, both graphs.
    manifest = json.loads((tmp_path / "out" / "ti_dynamic_explain.json").read_text())
    rows = manifest["parity"]["rows"]
    assert {(r["res"], r["batch"]) for r in rows} == {("384x384", 1), ("384x384", 8), ("576x576", 1),
                                                      ("576x576", 2), ("384x288", 1), ("384x288", 2)}
    assert all(r["ok"] and r["rollout_beyond"] <= 1e-5 for r in rows)


def test_the_watchdog_stops_an_export_past_its_bound(tmp_path):
    """The bound is enforced, not only reported: an export given 0.3 GB is killed (its imports alone pass it)."""
    bench = _script()
    ckpt = bench.make_checkpoint("Ti/16", 384, tmp_path / "ti.safetensors")
    m = bench.measure_export(ckpt, ["--res", "dynamic", "--out", str(tmp_path / "out")], int(0.3 * bench.GB))
    assert m.killed and m.returncode != 0 and m.sampled_peak_bytes > 0.3 * bench.GB


def test_the_peak_is_the_export_s_own_not_its_parent_s(tmp_path):
    """Linux carries ru_maxrss over an exec from the forking process; the export's VmHWM starts afresh. A parent
    holding 1.5 GB (as a long-running test worker does) must not show in the export's peak: a --help export."""
    bench = _script()
    ballast = bytearray(int(1.5 * bench.GB))
    ballast[:: 4096] = b"\1" * len(range(0, len(ballast), 4096))  # touched: resident
    m = bench.measure_export(tmp_path / "none.safetensors", ["--help"], int(BOUND_GB * bench.GB), timeout_s=300)
    assert m.returncode == 0, m.tail
    assert 0 < m.peak_rss_bytes < 1.0 * bench.GB, m.peak_rss_bytes / bench.GB
    del ballast

