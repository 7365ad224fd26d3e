"""benchmarks/gpu_check.py: what a CPU can check of the prepared GPU check.

The script itself runs as a new user would (a subprocess from the repository root); the stage list, the
budget, the discovery of the CUDA-only test files and the path set-up for an uninstalled tree are checked
against Python's own import system and pytest's real summary lines. The GPU stages run only on a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"

spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gpu_check
spec.loader.exec_module(gpu_check)


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})


def _device_command() -> tuple[str, list[str]]:
    """The one command the docstring gives the device tool, and what it carries."""
    m = re.search(r'run\(command="([^"]+)", carry=\[([^\]]*)\], timeout_s=(\d+)\)', gpu_check.__doc__)
    assert m, "the docstring gives no run(command=..., carry=[...], timeout_s=...) line"
    assert int(m.group(3)) <= 600  # the device tool's limit for one command
    return m.group(1), [c.strip().strip('"') for c in m.group(2).split(",")]


def test_the_device_command_is_a_dry_run_here_every_stage_no_verdict_exit_0(tmp_path):
    """The docstring's one command, run as the device tool runs it (bash, from the repository root, $OUT set),
    on this machine without CUDA: a dry run to the end, each stage "no verdict", exit 0."""
    command, carry = _device_command()
    assert carry == [".gpu-wheels"] and gpu_check.DEFAULT_WHEELS == REPO / ".gpu-wheels"
    assert ".gpu-wheels/" in (REPO / ".gitignore").read_text().splitlines()  # it travels only as carried
    argv = shlex.split(command)
    assert argv[:2] == ["python", "benchmarks/gpu_check.py"]
    r = subprocess.run(["bash", "-c", command.replace("python ", f"{shlex.quote(sys.executable)} ", 1)], cwd=REPO,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    rows = json.loads((tmp_path / "gpu_check" / "gpu_check.json").read_text())
    assert [row["stage"] for row in rows] == [s.name for s in gpu_check.STAGES]
    assert all(row["verdict"] == "no verdict" and row["detail"] == "no CUDA device" for row in rows)
    md = (tmp_path / "gpu_check" / "gpu_check.md").read_text()
    assert md.count("| no verdict |") == len(gpu_check.STAGES) and "exit 0" in md and "A dry run" in md
    assert "carried wheels: " in md  # the install step ran, as it will there


def test_list_names_every_stage_without_a_gpu():
    r = _run("--list", CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 0, r.stderr
    for name in ("cuda-tests", "sdpa-kernel", "forward", "train", "gpu-decode", "ddp-nccl", "forward-compile",
                 "train-compile", "tensorrt"):
        assert f"| {name} |" in r.stdout
    assert "| ratio >= 0.95 |" in r.stdout and "PSNR >= 35 dB" in r.stdout
    assert _run("--dry-run").stdout == r.stdout


def test_unknown_stage_is_a_usage_error():
    r = _run("--only", "forward,nope")
    assert r.returncode == 2 and "unknown stage nope" in r.stderr and "Traceback" not in r.stderr


def test_the_stages_fit_540_s_and_compile_comes_before_tensorrt():
    assert gpu_check.DEFAULT_BUDGET_S <= 540 - 10  # start-up and the report fit in the rest
    assert all(s.needs_s <= s.limit_s for s in gpu_check.STAGES)
    assert sum(s.needs_s for s in gpu_check.STAGES) <= gpu_check.DEFAULT_BUDGET_S
    order = [s.name for s in gpu_check.STAGES]
    assert order.index("forward-compile") < order.index("train-compile") < order.index("tensorrt")


def test_help_says_how_to_run_it_in_one_command():
    r = _run("--help")
    command, _ = _device_command()
    assert r.returncode == 0 and command in r.stdout and "540 s" in r.stdout and 'carry=[".gpu-wheels"]' in r.stdout


def test_budget_skips_a_stage_that_no_longer_fits():
    now = [0.0]
    budget = gpu_check.Budget(100, clock=lambda: now[0])
    stage = gpu_check.Stage("x", "", "", needs_s=30, limit_s=50)
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


# ---- the verdicts, as pure functions ---------------------------------------------------------------------------

def test_a_failing_criterion_fails_its_stage_and_an_unmeasured_one_gives_no_verdict():
    pass_, fail_, none_ = "pass", "FAIL", "no verdict"
    assert gpu_check.judge([gpu_check.at_least("ratio", 0.96, 0.95)]) == pass_
    assert gpu_check.judge([gpu_check.at_least("ratio", 0.94, 0.95)]) == fail_
    assert gpu_check.judge([gpu_check.at_most("max |Δ|", 2e-3, 1e-3), gpu_check.at_least("cos", 1.0, 0.999)]) == fail_
    assert gpu_check.judge([gpu_check.at_least("PSNR", None, 35)]) == none_
    assert gpu_check.judge([]) == none_
    # What each measuring stage's child reports, judged: every criterion can fail.
    rate = {"timm": 1000.0, "batch": 256, "compile_s": {"timm": 30.0, "ours": 31.0}}
    cases = {
        "forward": ({**rate, "ours": 990.0, "fp32_max_abs": 4e-4, "bf16_cosine": 0.9995},
                    {"fp32_max_abs": 2e-3}, {"bf16_cosine": 0.998}),
        "train": ({**rate, "ours": 990.0, "loss_rel_diff": 0.004, "cpu_losses": [7.1], "cuda_losses": [7.1]},
                  {"loss_rel_diff": 0.05}, {"loss_rel_diff": gpu_check.loss_rel_diff([7.0], [float("nan")])}),
        "forward-compile": ({**rate, "ours": 960.0}, {"ours": 940.0}, {"ours": 500.0}),
        "train-compile": ({**rate, "ours": 1100.0}, {"ours": 900.0}, {"ours": 949.0}),
        "gpu-decode": ({"psnr": {"a.jpg": 41.0}, "min_psnr": 41.0}, {"min_psnr": 34.9}, {"min_psnr": 20.0}),
        "sdpa-kernel": ({"flash": True, "kernels": ["flash_fwd"]}, {"flash": False}, {"flash": False}),
        "tensorrt-rope": ({"model": "dinov3", "plain": True, "ops": 180, "build_s": 9.0, "max_abs": 2e-5,
                           "sizes": {"144x112": {"trt_vs_ort": 2e-5, "trt_vs_timm": 2e-5, "ort_vs_timm": 6e-6}}},
                          {"max_abs": 2e-3}, {"plain": False}),
    }
    for name, (good, *bad) in cases.items():
        assert gpu_check.judge(gpu_check.criteria_of(name, good)[0]) == pass_, name
        for change in bad:
            assert gpu_check.judge(gpu_check.criteria_of(name, {**good, **change})[0]) == fail_, (name, change)
    assert gpu_check.judge(gpu_check.criteria_of("gpu-decode", {"psnr": {}, "min_psnr": None})[0]) == none_


def test_losses_agree_within_bf16_tolerance_or_not():
    assert gpu_check.loss_rel_diff([6.9, 6.8], [6.93, 6.79]) == pytest.approx(0.03 / 6.9)
    assert gpu_check.loss_rel_diff([6.9], [6.9, 6.8]) == float("inf")  # a step missing
    assert gpu_check.loss_rel_diff([6.9], [float("nan")]) == float("inf")


def test_exit_code_and_combined_verdicts():
    assert gpu_check.exit_code(["pass", "skipped"]) == 0
    assert gpu_check.exit_code(["pass", "not available here"]) == 0
    assert gpu_check.exit_code(["pass", "no verdict"]) == 3
    assert gpu_check.exit_code(["FAIL", "no verdict", "pass"]) == 1
    assert gpu_check.exit_code([]) == 3
    assert gpu_check.exit_code(["no verdict"], dry_run=True) == 0
    assert gpu_check.exit_code(["no verdict", "FAIL"], dry_run=True) == 1
    assert gpu_check.combine([("not available here", "tensorrt"), ("skipped", "x")]) == "not available here"
    assert gpu_check.combine([("not available here", "tensorrt"), ("pass", "x")]) == "pass"
    assert gpu_check.combine([("pass", "a"), ("skipped", "no tritonserver")]) == "pass"
    assert gpu_check.combine([("pass", "a"), ("no verdict", "stopped")]) == "no verdict"
    assert gpu_check.combine([("no verdict", "x"), ("FAIL", "y")]) == "FAIL"
    assert gpu_check.combine([("skipped", "x")]) == "skipped"


def test_ddp_on_one_gpu_is_skipped_with_its_reason(tmp_path):
    r = gpu_check.stage_ddp(gpu_check.Context(dict(os.environ), tmp_path, gpus=1), 60)
    assert r.verdict == "skipped" and "needs 2 ranks on 2 GPUs" in r.detail


def _pytest_stage(tmp_path, kind: str, source: str | None) -> tuple[str, str]:
    """`run_pytest` (the cuda-tests and tensorrt stages' runner) on one test file, with pytest for real."""
    files = []
    if source is not None:
        (tmp_path / "test_sample.py").write_text(source)
        files = [tmp_path / "test_sample.py"]
    ctx = gpu_check.Context(gpu_check.child_env(REPO), tmp_path, gpus=1)
    return gpu_check.run_pytest(ctx, kind, files, 120)


SAMPLE = ("import pytest\n"
          "@pytest.mark.skipif(True, reason='no CUDA device: checked on GPUs only')\n"
          "def test_cuda(): pass\n"
          "@pytest.mark.skipif(True, reason='needs tensorrt and a CUDA GPU')\n"
          "def test_engine(): pass\n"
          "def test_cpu(): pass\n")


def test_pytest_verdicts_from_junit_all_skipped_none_collected_failed_passed(tmp_path):
    """Reference: pytest's own junit XML. The CPU test in the file is deselected: counted, it would make a
    stage whose CUDA tests all skipped "pass"."""
    verdict, detail = _pytest_stage(tmp_path, "cuda", SAMPLE)
    assert verdict == "no verdict" and detail == "all 1 skipped: no CUDA device: checked on GPUs only"
    verdict, detail = _pytest_stage(tmp_path, "tensorrt", SAMPLE)
    assert verdict == "no verdict" and "needs tensorrt and a CUDA GPU" in detail
    assert _pytest_stage(tmp_path, "cuda", "def test_cpu(): pass\n") == ("no verdict", "no test collected")
    assert _pytest_stage(tmp_path, "cuda", "") == ("no verdict", "no test collected")
    assert _pytest_stage(tmp_path, "cuda", None)[0] == "no verdict"
    failing = ("import pytest\n"
               "@pytest.mark.skipif(False, reason='needs a CUDA GPU')\n"
               "def test_cuda(): assert 1 == 2\n")
    assert _pytest_stage(tmp_path, "cuda", failing) == ("FAIL", "0 passed, 1 failed, 0 errors, 0 skipped")
    passing = failing.replace("1 == 2", "1 == 1") + ("@pytest.mark.skipif(True, reason='needs two CUDA GPUs')\n"
                                                     "def test_two(): pass\n")
    assert _pytest_stage(tmp_path, "cuda", passing) == ("pass", "1 passed, 0 failed, 0 errors, 1 skipped")
    broken = "import pytest\n@pytest.mark.skipif(False, reason='needs a CUDA GPU')\ndef test_cuda(:\n"
    assert _pytest_stage(tmp_path, "cuda", broken)[0] == "FAIL"  # a collection error is no pass


def test_pytest_verdict_of_a_stopped_or_broken_run():
    s = gpu_check.PytestSummary
    assert gpu_check.tests_verdict(s(tests=3, skipped=1, exit_code=None))[0] == "no verdict"
    assert gpu_check.tests_verdict(s(tests=3, failures=1, exit_code=None))[0] == "FAIL"
    assert gpu_check.tests_verdict(s(exit_code=4))[0] == "FAIL"  # usage error: no report at all
    assert gpu_check.tests_verdict(s(tests=2, skipped=1, exit_code=0)) == ("pass", "1 passed, 0 failed, 0 errors, "
                                                                           "1 skipped")


def test_cuda_test_kind_from_skip_reasons():
    assert gpu_check.cuda_test_kind(["no CUDA device: nvJPEG decoding is checked on GPUs only"]) == "cuda"
    assert gpu_check.cuda_test_kind(["TensorRT build skipped: no GPU"]) == "tensorrt"
    assert gpu_check.cuda_test_kind(["redis-server is not installed"]) is None
    assert gpu_check.cuda_test_kind([]) is None


def _wheel(folder: Path, name: str, version: str, tag: str = "py3-none-any", module: str | None = None) -> Path:
    """A real wheel (PEP 427: the module, METADATA, WHEEL, RECORD) of distribution `name`."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-{tag}.whl"
    files = {f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}.dist-info/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n"}
    if module:
        files[f"{module}.py"] = f"WHO = {name!r}\n"
    files[f"{dist}.dist-info/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{dist}.dist-info/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
    return path


def test_carried_wheels_install_only_what_is_missing_and_fits_without_a_network(tmp_path):
    """Real pip (--no-index): a missing distribution is installed into the target and imports from it in a child
    with the check's environment; one already here and one built for another Python are left out, and said."""
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    _wheel(wheels, "gpu-check-probe", "1.0", module="gpu_check_probe")
    _wheel(wheels, "pytest", "0.0.1", module="pytest_impostor")  # pytest is here: never replaced
    _wheel(wheels, "gpu-check-oldpy", "1.0", tag="cp27-cp27mu-manylinux1_x86_64", module="gpu_check_oldpy")
    line = gpu_check.gpu_wheels.install(wheels, target)
    assert line.startswith("carried wheels: 1 already here; none for this Python") and "gpu-check-oldpy" in line
    assert f"installed 1 into {target}: gpu_check_probe" in line.replace("gpu-check-probe", "gpu_check_probe")
    assert sorted(p.name for p in target.iterdir() if not p.name.startswith("__")) == [
        "gpu_check_probe-1.0.dist-info", "gpu_check_probe.py"]
    env = gpu_check.child_env(REPO, site=target)
    r = subprocess.run([sys.executable, "-c", "import gpu_check_probe, importlib.metadata as m, pytest; "
                        "print(gpu_check_probe.WHO, m.version('gpu-check-probe'), pytest.__version__ != '0.0.1')"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["gpu-check-probe", "1.0", "True"], r.stderr
    assert gpu_check.gpu_wheels.install(tmp_path / "none", target).startswith("carried wheels: none in ")


def test_the_carried_set_is_the_gateways_requirements_less_what_the_machine_holds():
    """From the installed distributions' own metadata: the web stack (and the gRPC service the gateway's app
    imports, reached through tritonclient's [grpc] extra) is carried; torch, onnx, pytest and theirs are not."""
    carried = gpu_check.gpu_wheels.carry_list()
    want = {"fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core", "pydantic-settings", "python-multipart",
            "prometheus-client", "tritonclient", "grpcio", "h11", "anyio"}
    assert want <= set(carried), want - set(carried)
    held = gpu_check.gpu_wheels.closure(gpu_check.gpu_wheels.RELIED_ON)
    assert {"torch", "onnx", "pytest", "numpy", "protobuf"} <= set(held) and not set(carried) & set(held)
    from importlib.metadata import version
    assert all(v == version(n) for n, v in carried.items())  # the versions the tests here pass with


def test_the_corpus_from_carried_photos_is_byte_for_byte_the_same(tmp_path):
    """Without scikit-image and matplotlib there, the corpus is built from the photos carried as PNG: the same
    files as from the packages (the 12 MP mosaic tiles every photo, in order)."""
    pytest.importorskip("skimage.data")
    pytest.importorskip("matplotlib")
    gw = gpu_check.gpu_wheels
    saved = gw.save_photos(tmp_path / "photos")
    assert sum(p.stat().st_size for p in saved) < 4 * 2**20
    ph, why = gpu_check.corpus_photos(tmp_path / "photos")
    assert ph is None and why is None  # the packages are here: upload_corpus loads them itself
    names = ("phone_mosaic_exif6.jpg", "thumbnail.jpg")
    sys.path.insert(0, str(REPO / "benchmarks"))
    import upload_corpus

    carried = upload_corpus.build(tmp_path / "a", names, gw.load_photos(tmp_path / "photos"))
    direct = upload_corpus.build(tmp_path / "b", names)
    assert {n: p.read_bytes() for n, p in carried.items()} == {n: p.read_bytes() for n, p in direct.items()}


def test_tests_that_need_what_cannot_travel_are_not_available_here(tmp_path):
    """pytest's own junit XML for a module skipped at collection by importorskip of a package that cannot travel
    (a submodule that exists nowhere, so that it skips on any machine): "not available here"; any other skip
    reason is still "no verdict"."""
    (tmp_path / "test_needs.py").write_text("import pytest\npytest.importorskip('skimage.not_a_module_here')\n"
                                           "def test_a(): pass\n")
    junit = tmp_path / "j.xml"
    rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
                         f"--junitxml={junit}", str(tmp_path / "test_needs.py")], capture_output=True,
                        cwd=tmp_path, timeout=120).returncode
    summary = gpu_check.read_junit(junit, rc)
    assert summary.skip_reasons and "could not import 'skimage.not_a_module_here'" in summary.skip_reasons[0]
    verdict, detail = gpu_check.tests_verdict(summary)
    assert verdict == "not available here" and "scikit-image" in detail
    assert gpu_check.tests_verdict(gpu_check.PytestSummary(tests=1, skipped=1, skip_reasons=(
        "could not import 'fastapi': No module named 'fastapi'",)))[0] == "no verdict"  # it should have been carried


def test_a_stage_that_needs_tensorrt_is_not_available_here_when_it_is_missing(tmp_path):
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("tensorrt is installed here")
    r = gpu_check.stage_tensorrt(gpu_check.Context(dict(os.environ), tmp_path, gpus=1), 60)
    assert r.verdict == "not available here" and "tensorrt" in r.detail
    assert gpu_check.unavailable("x", "json") is None
    assert gpu_check.unavailable("x", "gpu_check_no_such_module").verdict == "no verdict"


def test_the_rope_stage_profile_holds_its_sizes_and_its_models_agree():
    """tensorrt-rope: the engine's one profile spans the sizes it runs at (none of them the traced grid), and the
    CPU half of its child, timm's tiny DINOv3 and ours converted from it, agree at those sizes."""
    import torch

    pytest.importorskip("timm")
    ref, ours = gpu_check._rope_models()
    p = ours.cfg.patch_size
    lo, opt, hi = gpu_check.rope_profile(p)
    traced = tuple(ours.cfg.img_size)
    for gh, gw in gpu_check.ROPE_GRIDS:
        shape = (2, 3, gh * p, gw * p)
        assert all(a <= b <= c for a, b, c in zip(lo, shape, hi, strict=True)) and shape[2:] != traced
        x = torch.randn(shape, generator=torch.Generator().manual_seed(gh))
        with torch.no_grad():
            assert (ours(x) - ref(x)).abs().max() <= 1e-4
    assert lo[0] <= opt[0] <= hi[0] and gh * p != gw * p  # a non-square size among them
    if importlib.util.find_spec("tensorrt") is None:
        r = gpu_check.stage_tensorrt_rope(gpu_check.Context(dict(os.environ), REPO, gpus=1), 60)
        assert r.verdict == "not available here" and "tensorrt" in r.detail.lower()
