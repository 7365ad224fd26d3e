"""benchmarks/serve_load.py --mode backends (benchmarks/serve_backends.py) at tiny settings: onnxruntime and OpenVINO
gateways on one random-weight Ti/16 export at 32 px, one round of a few requests: both answer every request, the
OpenVINO gateway's precision and accuracy gate come from its /models, and the results are written where the
benchmarks' results go (tests/benchmarks/conftest.py: a temporary folder). The ratio at these sizes is not a
measurement: its check is reported, not asserted. Also the CPU-flag reading the bound depends on."""

from __future__ import annotations

import json

import pytest
from bench_script import load_script

pytest.importorskip("openvino")


def test_bf16_is_read_from_the_cpu_flags():
    m = load_script("serve_backends")
    assert m.cpu_has_bf16("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni\n")
    assert m.cpu_has_bf16("flags\t\t: fpu avx2 amx_bf16 amx_tile\n")
    assert not m.cpu_has_bf16("flags\t\t: fpu sse avx2 avx512f avx512_vnni\n")
    assert not m.cpu_has_bf16("")


def test_tiny_run_writes_its_results(tmp_path, _results_elsewhere):
    m = load_script("serve_load")
    m.main(["--mode", "backends", "--model", "Ti/16", "--res", "32", "--requests", "8", "--rounds", "1",
            "--concurrency", "4", "--threads", "1", "--out", str(tmp_path / "run")])
    doc = json.loads((_results_elsewhere / "serve_backends.json").read_text())
    checks = {c["check"]: c for c in doc["checks"]}
    assert "openvino auto / onnxruntime fp32, median images/s (c=4)" in checks
    assert doc["data"]["openvino"]["precision"] in {"fp32", "bf16", "fp16"}  # fp32 on a CPU without bf16
    assert set(doc["data"]["throughput"]) == {"onnxruntime fp32 c=4", "openvino auto c=4"}
    assert all(v[0] > 0 for v in doc["data"]["throughput"].values())
