"""Smoke run of benchmarks/cpu_runtimes.py (the per-core table of issue 43) at tiny settings: a row per runtime and
batch, the CPU named, and the fp32 runtimes agreeing with PyTorch eager. No timing asserted. References: PyTorch
eager fp32 (agreement, cosine) and scikit-image's photos."""

from __future__ import annotations

import json

import pytest
from bench_script import load_script

pytest.importorskip("openvino")
pytest.importorskip("nncf")
pytest.importorskip("skimage")

# torch.compile's rows are left out: inductor's C++ build takes minutes on a shared 2-core runner.
RUNTIMES = ("eager", "ort", "ort-int8-dynamic", "ort-int8-static", "ov-f32", "ov-bf16", "ov-int8")


def test_cpu_runtimes_prints_a_row_per_runtime_and_batch(capsys, _results_elsewhere):
    m = load_script("cpu_runtimes")
    # the exit status is the reduced precisions' accuracy verdicts, which a tiny random model may miss
    assert m.main(["--tiny", "--batches", "1,2", "--rounds", "1", "--iters", "1", "--threads", "1",
                   "--runtimes", ",".join(RUNTIMES)]) in (0, 1)
    out = capsys.readouterr().out
    assert out.startswith("CPU: ") and "fp32 peak" in out
    rows = [ln.split(" | ") for ln in out.splitlines() if ln.startswith("| Ti/16 |")]
    assert [(r[1], r[2]) for r in rows] == [(b, k) for b in ("1", "2") for k in RUNTIMES]
    for r in rows:
        assert float(r[4]) > 0 and float(r[10]) > 0  # img/s, GFLOP/s
        if r[2] in ("eager", "ort", "ov-f32"):  # fp32: the same answers as eager
            assert r[7] == "100.0%" and float(r[8]) > 0.9999, r
    doc = json.loads((_results_elsewhere / "cpu_runtimes.json").read_text())
    assert len(doc["tables"][0]["rows"]) == len(rows)
    judged = {c["check"].split(": ")[0] for c in doc["checks"]}
    assert judged == {f"Ti/16 batch {b} {k} ({p})" for b, k, p in ((r[1], r[2], r[3]) for r in rows)
                      if k not in ("eager", "ort", "ov-f32")}
