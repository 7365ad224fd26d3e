"""benchmarks/gpu_check.py: what a CPU can check of the prepared GPU check.

The script itself runs as a new user would (a subprocess from the repository root); the stage list, the
budget, the discovery of the CUDA-only test files and the path set-up for an uninstalled tree are checked
against Python's own import system and pytest's real summary lines. The GPU stages run only on a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"

spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gpu_check
spec.loader.exec_module(gpu_check)


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})


def test_without_a_gpu_it_says_so_in_one_line_and_exits_3(tmp_path):
    r = _run("--out", str(tmp_path / "report"), CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0]
    assert "no CUDA device" in (tmp_path / "report" / "gpu_check.md").read_text()


def test_list_names_every_stage_without_a_gpu():
    r = _run("--list", CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 0, r.stderr
    for name in ("cuda-tests", "sdpa-kernel", "forward", "train", "ddp-nccl", "tensorrt", "forward-compile",
                 "train-compile"):
        assert f"| {name} |" in r.stdout
    assert _run("--dry-run").stdout == r.stdout


def test_unknown_stage_is_a_usage_error():
    r = _run("--only", "forward,nope")
    assert r.returncode == 2 and "unknown stage nope" in r.stderr and "Traceback" not in r.stderr


def test_the_stages_fit_the_8_minute_limit():
    assert gpu_check.DEFAULT_BUDGET_S <= 8 * 60 - 20  # start-up and the report fit in the rest
    assert all(s.needs_s <= s.limit_s for s in gpu_check.STAGES)


def test_budget_skips_a_stage_that_no_longer_fits():
    now = [0.0]
    budget = gpu_check.Budget(100, clock=lambda: now[0])
    stage = gpu_check.Stage("x", "", needs_s=30, limit_s=50)
    assert budget.allow(stage) == 50
    now[0] = 60  # 40 s left: runs, cut to what is left
    assert budget.allow(stage) == 40
    now[0] = 80  # 20 s left, needs 30
    assert budget.allow(stage) is None
    now[0] = 500
    assert budget.left() == 0


def test_finds_the_test_files_with_cuda_only_tests(tmp_path):
    found = {p.relative_to(REPO).as_posix() for p in gpu_check.cuda_test_files(REPO / "tests")}
    assert {"tests/export/test_tensorrt.py", "tests/serve/test_backends.py"} <= found
    assert "tests/test_model.py" not in found
    (tmp_path / "test_gpu.py").write_text("import pytest, torch\n"
                                          "@pytest.mark.skipif(not torch.cuda." "is_available(), reason='x')\n"
                                          "def test_a(): pass\n")
    (tmp_path / "test_cpu.py").write_text("def test_b(): pass\n")
    assert [p.name for p in gpu_check.cuda_test_files(tmp_path)] == ["test_gpu.py"]


def test_pytest_counts_reads_pytests_own_summary(tmp_path):
    (tmp_path / "test_x.py").write_text("import pytest\n"
                                        "def test_ok(): pass\n"
                                        "def test_bad(): assert False\n"
                                        "@pytest.mark.skip(reason='r')\n"
                                        "def test_skip(): pass\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
                        str(tmp_path / "test_x.py")], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert gpu_check.pytest_counts(r.stdout) == {"failed": 1, "passed": 1, "skipped": 1}


def test_an_uninstalled_tree_imports_vit_export_from_export(tmp_path):
    """`python -S` skips site-packages (and so the editable install): vit_export must come from export/."""
    env = gpu_check.child_env(REPO, installed=False)
    r = subprocess.run([sys.executable, "-S", "-c", "import vit_export; print(vit_export.__file__)"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).resolve() == (REPO / "export" / "__init__.py").resolve()


def test_ddp_stage_proves_gradient_averaging_with_gloo_on_cpu(tmp_path):
    """The ddp-nccl stage's worker, run by torchrun with 2 CPU processes over gloo: DDP's averaged gradients
    give the parameters of one process trained on both ranks' batches together."""
    report = tmp_path / "ddp.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(SCRIPT), "--ddp-worker", str(report), "--ddp-device", "cpu"], cwd=REPO,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(report.read_text())
    assert res["backend"] == "gloo" and res["world"] == 2
    assert res["ranks_agree"] and res["all_reduce_ok"]
    assert res["max_param_diff_vs_single_process"] <= 1e-4
