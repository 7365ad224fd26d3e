"""The CUDA paths with a verdict each, for when a GPU is lent: one command, under 540 s on one H200 or H100.

    python benchmarks/gpu_wheels.py                         # here, once, with PyPI: fills .gpu-wheels/ (git-ignored)
    python benchmarks/gpu_check.py --out gpu_check_out      # from the repository root; the whole check
    python benchmarks/gpu_check.py --list                   # the stages and their criteria; no GPU needed

The one command for the device tool (the carried folder travels with the working tree, 64 MiB at most in all):

    run(command="python benchmarks/gpu_check.py --out $OUT/gpu_check", carry=[".gpu-wheels"], timeout_s=560)

That machine has no network, and its Python holds torch, timm, onnx, onnxruntime, transformers and pytest but
not the gateway's web stack: nothing is resolved or downloaded there. The project runs from the working tree
(PYTHONPATH; no `pip install`), and the carried wheels (benchmarks/gpu_wheels.py: fastapi, starlette, uvicorn,
pydantic and the rest of the gateway's requirements, at the versions the tests pass with) that the machine
lacks are installed into a temporary folder on the path of every process of the check (`pip install --no-deps
--no-index --target`); --no-install leaves them out. What cannot travel (TensorRT, scikit-image) makes the stages
needing it "not available here". The global budget, --budget, defaults to 530 s; each stage runs in its own
process and is stopped at its limit.

Stages, in order (the compile stages before TensorRT), and what each is judged by:

* cuda-tests:      the CUDA-only tests under tests/ (those skipped on a machine without CUDA), each run once
                   (the TensorRT ones run in the tensorrt stage): pass when none fails and at least one ran
* sdpa-kernel:     a flash-attention CUDA kernel runs for ViT-B/16 in bf16 (torch.profiler)
* forward:         ViT-B/16 at 224 against timm with the same weights: fp32 logits max |Δ| <= 1e-3 (TF32 off),
                   bf16 autocast logits cosine >= 0.999; eager images/s reported
* train:           the first 3 AdamW steps' losses in bf16 on CUDA equal the CPU's fp32 run within 2% (bf16);
                   eager training images/s against timm reported
* gpu-decode:      nvJPEG decode + resize of the two 12 MP phone JPEGs against the CPU fast path: PSNR >= 35 dB
                   (the corpus made from the carried photos where scikit-image is missing); then
                   `vit-serve serve --device cuda` (the carried web stack) answers POST /classify of a phone JPEG
                   decoded by nvJPEG with the CPU path's top-1
* ddp-nccl:        two ranks over NCCL (torchrun) give the parameters of one process on both batches (|Δ| <= 1e-4);
                   skipped, with the reason, on a machine with one GPU
* forward-compile: torch.compile'd forward images/s against timm compiled, bf16: ratio >= 0.95
* train-compile:   the same for training steps: ratio >= 0.95
* tensorrt:        `vit-export --format tensorrt` on a ViT-B/16 at 224 and at 384 (exit 0: its own parity check
                   passed), each engine served by `vit-serve serve --backend tensorrt` (POST /classify: top-1 equal
                   to PyTorch's), the Triton repository served by `tritonserver` when one with the TensorRT backend
                   is installed, and the TensorRT tests under tests/
* tensorrt-rope:   a RoPE family exported once (timm's DINOv3, tiny, random weights; `--res dynamic`: its rotary
                   tables computed from the input's shape) built by TensorRT, fp32 (TF32 off), with one profile over
                   H and W, and run at two sizes it was not traced at, one non-square: max |Δ logit| <= 1e-3
                   against onnxruntime on the same graph, and the graph plain (no If / Loop, Range from shapes)

Verdicts: pass, FAIL, no verdict (it should have been judged and was not: a tool missing, every test skipped
or none collected, stopped at its time limit), not available here (it needs what cannot travel to the machine:
TensorRT, scikit-image), skipped (does not apply here, e.g. DDP on one GPU). Exit status: 0 when every stage
passed, was skipped or is not available here; 1 when one failed; 3 when none failed but one gave no verdict.
Without a CUDA device the command is a dry run that ends in a few seconds, with exit 0: the carried wheels are
installed as on the GPU machine, and every stage says "no verdict: no CUDA device" (nothing trained or exported);
tests/test_gpu_check.py runs it so in CI. The table is printed, and written to DIR/gpu_check.md and
DIR/gpu_check.json with --out DIR. `vit_export` is aliased to export/ (pyproject's package-dir mapping) on the
path of this process and of its children when the project is not installed.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_BUDGET_S = 530.0  # the whole check, start-up and report included, stays under 540 s on one H200
DEVICE_LIMIT_S = 540.0
TIMM_NAME = "vit_base_patch16_224"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling gpu_wheels, also when loaded by path
import gpu_wheels  # noqa: E402

DEFAULT_WHEELS = gpu_wheels.DEFAULT_DIR
PHOTOS_ENV = "GPU_CHECK_PHOTOS"  # the carried corpus photos
CORPUS_ENV = "GPU_CHECK_CORPUS"  # the folder of the corpus files, for the gpu-decode child
PHONE_JPEGS = ("phone_astronaut.jpg", "phone_mosaic_exif6.jpg")

PASS, FAIL, NO_VERDICT, SKIPPED = "pass", "FAIL", "no verdict", "skipped"
NOT_AVAILABLE = "not available here"
EXIT_OK, EXIT_FAILED, EXIT_NO_VERDICT = 0, 1, 3

# The criteria (the bounds).
FP32_LOGIT_MAX_ABS = 1e-3
BF16_LOGIT_COSINE_MIN = 0.999
COMPILED_RATIO_MIN = 0.95
TRAIN_LOSS_REL_TOL = 0.02  # bf16 autocast against fp32: 8 mantissa bits, a few steps of AdamW
DECODE_PSNR_MIN = 35.0
DDP_PARAM_MAX_ABS = 1e-4
TRT_FP32_MAX_ABS = 1e-3  # an fp32 engine, TF32 cleared, against onnxruntime's CPU kernels (vit_export.tensorrt_build)
# The RoPE stage's model (timm.create_model overrides: tiny, built at 64 x 64) and its patch grids (H, W): the
# sizes the engine runs at, none of them the traced 4 x 4; the profile spans grids 2 .. 16 and batches 1 .. 4.
ROPE_TIMM = ("vit_small_patch16_dinov3", dict(embed_dim=96, depth=2, img_size=64, global_pool="token",
                                               num_classes=10))
ROPE_GRIDS = ((9, 9), (12, 7))
ROPE_PROFILE = ((1, 2, 2), (2, 9, 9), (4, 16, 16))  # (batch, grid H, grid W): min, opt, max

# A test file has CUDA-only tests when it asks for CUDA, a GPU or TensorRT in a skip condition.
_CUDA_TEST_RE = re.compile(r"cuda\.is_available|\bneeds?_(?:cuda|gpu|trt)\b|mark\.(?:cuda|gpu)\b|CUDA GPU",
                           re.IGNORECASE)
# A test is CUDA-only when a skipif mark's reason names CUDA, a GPU, TensorRT or nvJPEG.
_CUDA_REASON_RE = re.compile(r"cuda|gpu|tensorrt|nvjpeg", re.IGNORECASE)
_TENSORRT_REASON_RE = re.compile(r"tensorrt", re.IGNORECASE)
SELECT_ENV = "GPU_CHECK_SELECT"  # "cuda" or "tensorrt": which CUDA-only tests the plugin below keeps
# A skip of pytest.importorskip: "could not import 'skimage.data': No module named 'skimage'".
_IMPORT_SKIP_RE = re.compile(r"could not import '([\w.]+)'")


# ---- verdicts (pure; tested on the CPU) ---------------------------------------------------------------------

@dataclass(frozen=True)
class Criterion:
    """One judged number: `value` against `bound` (at least or at most); value None: it was not measured."""

    name: str
    value: float | None
    bound: float
    at_least: bool

    @property
    def ok(self) -> bool | None:
        if self.value is None:
            return None
        return self.value >= self.bound if self.at_least else self.value <= self.bound

    def text(self) -> str:
        got = "not measured" if self.value is None else f"{self.value:.4g}"
        return f"{self.name} {got} ({'>=' if self.at_least else '<='} {self.bound:g})"


def at_least(name: str, value: float | None, bound: float) -> Criterion:
    return Criterion(name, value, bound, True)


def at_most(name: str, value: float | None, bound: float) -> Criterion:
    return Criterion(name, value, bound, False)


def judge(criteria: Sequence[Criterion]) -> str:
    """FAIL when a criterion fails, pass when at least one was measured and all passed, else no verdict."""
    oks = [c.ok for c in criteria if c.ok is not None]
    if any(ok is False for ok in oks):
        return FAIL
    return PASS if oks else NO_VERDICT


@dataclass(frozen=True)
class PytestSummary:
    """What pytest's junit XML says: test counts, skip reasons, and pytest's exit code (None: stopped)."""

    tests: int = 0
    failures: int = 0
    errors: int = 0
    skipped: int = 0
    skip_reasons: tuple[str, ...] = ()
    exit_code: int | None = 0

    @property
    def passed(self) -> int:
        return self.tests - self.failures - self.errors - self.skipped


def read_junit(path: Path, exit_code: int | None) -> PytestSummary:
    """The summary of pytest's `--junitxml` file (no file: nothing was collected, or pytest never got there)."""
    if not path.is_file():
        return PytestSummary(exit_code=exit_code)
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    reasons = sorted({_skip_reason(s) for s in root.iter("skipped")})
    return PytestSummary(
        tests=sum(int(s.get("tests", 0)) for s in suites), failures=sum(int(s.get("failures", 0)) for s in suites),
        errors=sum(int(s.get("errors", 0)) for s in suites), skipped=sum(int(s.get("skipped", 0)) for s in suites),
        skip_reasons=tuple(r for r in reasons if r), exit_code=exit_code)


def _skip_reason(skipped: ET.Element) -> str:
    """A junit <skipped> element's reason; a module skipped at collection (pytest.importorskip at its top) has
    "collection skipped" as its message and the reason in its text: ('path', line, 'Skipped: reason')."""
    message, text = (skipped.get("message") or "").strip(), (skipped.text or "").strip()
    if message == "collection skipped" and "Skipped: " in text:
        return text.split("Skipped: ", 1)[1].rstrip("')\"")
    return message


def tests_verdict(s: PytestSummary) -> tuple[str, str]:
    """pass / FAIL / no verdict, and why, from a pytest run's summary.

    FAIL: a test failed or errored, or pytest itself failed (exit 2-4: interrupted, internal or usage error);
    no verdict: stopped at its time limit, none collected (exit 5), or every test skipped; else pass."""
    counts = f"{s.passed} passed, {s.failures} failed, {s.errors} errors, {s.skipped} skipped"
    if s.failures or s.errors:
        return FAIL, counts
    if s.exit_code is None:
        return NO_VERDICT, f"stopped at its time limit ({counts})"
    if s.exit_code not in (0, 5):
        return FAIL, f"pytest exited {s.exit_code} ({counts})"
    if s.tests == 0:
        return NO_VERDICT, "no test collected"
    if s.skipped == s.tests:
        why = "; ".join(s.skip_reasons)[:300]
        cannot = not_carried(m.group(1) for r in s.skip_reasons if (m := _IMPORT_SKIP_RE.search(r)))
        if cannot and all(_IMPORT_SKIP_RE.search(r) for r in s.skip_reasons):
            return NOT_AVAILABLE, f"all {s.tests} skipped: they need {cannot}"
        return NO_VERDICT, f"all {s.tests} skipped: {why}"
    return PASS, counts


def not_carried(modules: Sequence[str] | Any) -> str | None:
    """What of `modules` (imported names) cannot travel to the GPU machine (gpu_wheels.NOT_CARRIED), or None."""
    named = sorted({gpu_wheels.NOT_CARRIED[top] for m in modules if (top := m.split(".")[0]) in gpu_wheels.NOT_CARRIED})
    return ", ".join(named) or None


def exit_code(verdicts: Sequence[str], dry_run: bool = False) -> int:
    """1 when a stage failed; 3 when none failed but one gave no verdict; else 0 (pass, skipped, not available
    here). A dry run (no CUDA device: nothing could be judged) is 0 unless a stage failed."""
    if FAIL in verdicts:
        return EXIT_FAILED
    if dry_run:
        return EXIT_OK
    return EXIT_NO_VERDICT if NO_VERDICT in verdicts or not verdicts else EXIT_OK


def cuda_test_kind(skip_reasons: Sequence[str]) -> str | None:
    """"tensorrt", "cuda" or None (not CUDA-only), from the reasons of a test's skipif marks."""
    cuda = [r for r in skip_reasons if _CUDA_REASON_RE.search(r)]
    if not cuda:
        return None
    return "tensorrt" if any(_TENSORRT_REASON_RE.search(r) for r in cuda) else "cuda"


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """As a pytest plugin (`-p gpu_check`, with $GPU_CHECK_SELECT set): keep only the CUDA-only tests of that
    kind, so that each runs once, in its stage, and a stage whose tests all skip gives no verdict."""
    kind = os.environ.get(SELECT_ENV)
    if not kind:
        return
    keep, drop = [], []
    for item in items:
        reasons = [str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")]
        (keep if cuda_test_kind(reasons) == kind else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


@dataclass(frozen=True)
class Stage:
    name: str
    what: str
    criterion: str
    needs_s: float  # the least time the stage needs; it gets no verdict when less is left
    limit_s: float  # the most it may take


STAGES: tuple[Stage, ...] = (
    Stage("cuda-tests", "the CUDA-only tests under tests/ (TensorRT's excepted), once each",
          "none fails, one at least runs", 30, 110),
    Stage("sdpa-kernel", "SDPA kernel of ViT-B/16 bf16 (torch.profiler)", "a flash kernel runs", 10, 40),
    Stage("forward", "ViT-B/16 224 logits and images/s vs timm, same weights, eager",
          f"fp32 max |Δ| <= {FP32_LOGIT_MAX_ABS:g}, bf16 cosine >= {BF16_LOGIT_COSINE_MIN}", 20, 60),
    Stage("train", "first AdamW steps bf16 CUDA vs fp32 CPU; training images/s vs timm, eager",
          f"loss within {TRAIN_LOSS_REL_TOL:.0%} of the CPU's", 30, 75),
    Stage("gpu-decode", "nvJPEG on the 12 MP phone JPEGs vs the CPU fast path; the gateway decoding on CUDA",
          f"PSNR >= {DECODE_PSNR_MIN:g} dB; served top-1 = the CPU path's, by nvJPEG", 25, 90),
    Stage("ddp-nccl", "DDP over NCCL, 2 ranks (torchrun) vs one process", f"params |Δ| <= {DDP_PARAM_MAX_ABS:g}; "
          "skipped on one GPU", 20, 60),
    Stage("forward-compile", "forward images/s vs timm, both torch.compile'd, bf16",
          f"ratio >= {COMPILED_RATIO_MIN}", 40, 90),
    Stage("train-compile", "training images/s vs timm, both torch.compile'd, bf16",
          f"ratio >= {COMPILED_RATIO_MIN}", 50, 110),
    Stage("tensorrt", "vit-export --format tensorrt B/16 224 + 384, served by the gateway (and tritonserver), "
          "the TensorRT tests", "exports exit 0, served top-1 = PyTorch's, tests pass", 90, 200),
    Stage("tensorrt-rope", "a DINOv3 (RoPE) --res dynamic graph built by TensorRT with an H x W profile, run at "
          "two unseen sizes", f"max |Δ logit| vs onnxruntime <= {TRT_FP32_MAX_ABS:g}; graph plain", 30, 90),
)


class Budget:
    """A global deadline: how long a stage may run, or None when what is left is less than it needs."""

    def __init__(self, total_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock, self.deadline = clock, clock() + total_s

    def left(self) -> float:
        return max(0.0, self.deadline - self.clock())

    def allow(self, stage: Stage) -> float | None:
        left = self.left()
        return None if left < stage.needs_s else min(stage.limit_s, left)


def cuda_test_files(tests_dir: Path) -> list[Path]:
    """Test files (test_*.py under tests_dir) holding a CUDA-only test, sorted."""
    return sorted(p for p in tests_dir.rglob("test_*.py") if _CUDA_TEST_RE.search(p.read_text(errors="replace")))


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in r) + " |" for r in rows]
    return "\n".join(out)


def _vit_export_importable() -> bool:
    """Installed, or already aliased in this process (found, not imported: importing it imports torch)."""
    return importlib.util.find_spec("vit_export") is not None


def child_env(repo: Path = REPO, installed: bool | None = None, site: Path | None = None) -> dict[str, str]:
    """The environment for child processes: `vit_serve` and `vit_export` importable from the working tree
    even when the package is not installed (pyproject maps vit_export to export/: a symlink does the same),
    this script importable as the pytest plugin `gpu_check`, and `site` (the carried wheels installed) on the
    path after them."""
    env = dict(os.environ)
    paths = [str(repo), str(Path(__file__).resolve().parent), *([str(site)] if site else [])]
    if not (_vit_export_importable() if installed is None else installed):
        alias = Path(tempfile.mkdtemp(prefix="gpu_check-path-"))
        atexit.register(shutil.rmtree, alias, ignore_errors=True)
        (alias / "vit_export").symlink_to(repo / "export", target_is_directory=True)
        paths.insert(0, str(alias))
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    return env


def _ensure_importable(site: Path | None = None) -> dict[str, str]:
    env = child_env(site=site)
    for p in reversed(env["PYTHONPATH"].split(os.pathsep)):
        if p not in sys.path:
            sys.path.insert(0, p)
    importlib.invalidate_caches()
    return env


# ---- results ------------------------------------------------------------------------------------------------

@dataclass
class Result:
    stage: str
    verdict: str  # pass | FAIL | no verdict | skipped
    detail: str
    criteria: list[Criterion] = field(default_factory=list)
    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)


def judged(stage: str, criteria: list[Criterion], detail: str, data: dict[str, Any] | None = None) -> Result:
    """A stage's result from its criteria; the detail leads with them."""
    text = "; ".join(c.text() for c in criteria)
    return Result(stage, judge(criteria), f"{text}; {detail}" if detail else text, criteria, data=data or {})


def combine(parts: Sequence[tuple[str, str]]) -> str:
    """The verdict of a stage made of parts (each (verdict, detail)): FAIL if one failed, no verdict if one gave
    none, pass if one passed, not available here if one is, else skipped."""
    verdicts = [v for v, _ in parts]
    for v in (FAIL, NO_VERDICT, PASS, NOT_AVAILABLE):
        if v in verdicts:
            return v
    return SKIPPED


def _run(argv: list[str], env: dict[str, str], timeout: float, cwd: Path = REPO) -> tuple[int | None, str]:
    """Run a child in its own process group; (exit code, or None when stopped at the timeout; its output).
    At the timeout the whole group is killed: torchrun's workers and servers started by tests go with it."""
    p = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=max(1.0, timeout))
        return p.returncode, out
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return None, out or ""


def _child_stage(name: str, env: dict[str, str], timeout: float) -> tuple[int | None, dict[str, Any], str]:
    """Run one measuring stage in a fresh process of this script; its last stdout line is JSON."""
    rc, out = _run([sys.executable, str(Path(__file__).resolve()), "--child", name], env, timeout)
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            try:
                return rc, json.loads(line), out
            except json.JSONDecodeError:
                break
    return rc, {}, out


def _tail(text: str, n: int = 300) -> str:
    text = " ".join(text.strip().splitlines()[-3:])
    return text[-n:]


def _needs(*modules: str) -> str | None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return f"not installed here: {', '.join(missing)}" if missing else None


def unavailable(stage: str, *modules: str) -> Result | None:
    """A stage's result when `modules` do not all import: "not available here" when one of them cannot travel
    to the GPU machine (TensorRT), else "no verdict" (it should have been carried); None when all import."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    cannot = not_carried(missing)
    if cannot:
        return Result(stage, NOT_AVAILABLE, f"it needs {cannot}")
    return Result(stage, NO_VERDICT, f"not installed here: {', '.join(missing)} (not in the carried wheels)")


@dataclass
class Context:
    env: dict[str, str]
    work: Path
    gpus: int


# ---- the stages, parent side ----------------------------------------------------------------------------------

def run_pytest(ctx: Context, kind: str, files: Sequence[Path], timeout: float) -> tuple[str, str]:
    """The CUDA-only tests of `kind` in `files`, once, judged by `tests_verdict` from pytest's junit XML."""
    if not files:
        return NO_VERDICT, "no test file under tests/ has a CUDA-only test"
    junit = ctx.work / f"pytest-{kind}.xml"
    # addopts cleared: pyproject's `--dist loadfile` needs pytest-xdist, which may be missing here.
    argv = [sys.executable, "-m", "pytest", "-q", "-rs", "-o", "addopts=", "-p", "no:cacheprovider", "-p",
            "gpu_check", f"--junitxml={junit}", *[str(f) for f in files]]
    rc, _ = _run(argv, {**ctx.env, SELECT_ENV: kind}, timeout)
    return tests_verdict(read_junit(junit, rc))


def stage_cuda_tests(ctx: Context, timeout: float) -> Result:
    if (res := unavailable("cuda-tests", "pytest")) is not None:
        return res
    verdict, detail = run_pytest(ctx, "cuda", cuda_test_files(REPO / "tests"), timeout)
    return Result("cuda-tests", verdict, detail)


def stage_ddp(ctx: Context, timeout: float) -> Result:
    if ctx.gpus < 2:
        return Result("ddp-nccl", SKIPPED, f"{ctx.gpus} GPU here: DDP over NCCL needs 2 ranks on 2 GPUs")
    report = ctx.work / "ddp.json"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    rc, out = _run([*torchrun, str(Path(__file__).resolve()), "--ddp-worker", str(report)], ctx.env, timeout)
    if rc is None:
        return Result("ddp-nccl", NO_VERDICT, f"stopped at its time limit: {_tail(out)}")
    if rc != 0 or not report.exists():
        return Result("ddp-nccl", FAIL, f"DDP worker exit {rc}: {_tail(out)}")
    ddp = json.loads(report.read_text())
    criteria = [at_most("params |Δ| vs one process", ddp["max_param_diff_vs_single_process"], DDP_PARAM_MAX_ABS),
                at_least("ranks agree", float(ddp["ranks_agree"]), 1.0),
                at_least("all_reduce", float(ddp["all_reduce_ok"]), 1.0)]
    return judged("ddp-nccl", criteria, f"2 ranks over {ddp['backend']}, {ddp['steps']} steps", ddp)


def stage_measure(name: str, ctx: Context, timeout: float) -> Result:
    """A measuring stage, run in its own process (`run_child`); judged by `criteria_of`."""
    rc, data, out = _child_stage(name, ctx.env, timeout)
    if rc is None:
        return Result(name, NO_VERDICT, f"stopped at its time limit: {_tail(out)}")
    if data.get("no_verdict"):
        return Result(name, NO_VERDICT, data["no_verdict"])
    if data.get("not_available"):
        return Result(name, NOT_AVAILABLE, data["not_available"])
    if rc != 0 or not data:
        return Result(name, FAIL, f"exit {rc}: {_tail(out)}")
    criteria, detail = criteria_of(name, data)
    return judged(name, criteria, detail, data)


def criteria_of(name: str, data: dict[str, Any]) -> tuple[list[Criterion], str]:
    """A measuring stage's criteria and its reported numbers, from what its child measured."""
    if name == "sdpa-kernel":
        return [at_least("flash kernel ran", float(data["flash"]), 1.0)], (
            f"kernels: {', '.join(data['kernels']) or 'none'}")
    if name == "tensorrt-rope":
        return [at_most("max |Δ logit| TensorRT vs onnxruntime", data["max_abs"], TRT_FP32_MAX_ABS),
                at_least("graph plain", float(data["plain"]), 1.0)], rope_detail(data)
    if name == "gpu-decode":
        return [at_least("min PSNR dB", data["min_psnr"], DECODE_PSNR_MIN)], ", ".join(
            f"{k} {v:.1f} dB" for k, v in data["psnr"].items())
    rate = (f"timm {data['timm']:.0f} img/s, vit-serve {data['ours']:.0f} img/s, ratio "
            f"{data['ours'] / data['timm']:.3f} (batch {data['batch']})")
    if name == "forward":
        return [at_most("fp32 max |Δ logit|", data["fp32_max_abs"], FP32_LOGIT_MAX_ABS),
                at_least("bf16 cosine", data["bf16_cosine"], BF16_LOGIT_COSINE_MIN)], rate
    if name == "train":
        return [at_most("max |Δ loss| / loss vs CPU fp32", data["loss_rel_diff"], TRAIN_LOSS_REL_TOL)], (
            f"losses CPU {data['cpu_losses']} CUDA bf16 {data['cuda_losses']}; {rate}")
    return [at_least("vit-serve / timm compiled", data["ours"] / data["timm"], COMPILED_RATIO_MIN)], (
        f"{rate}, compile {data['compile_s']['timm']:.0f} s / {data['compile_s']['ours']:.0f} s")


@contextlib.contextmanager
def _server(log: Path, start: Callable[..., Any]) -> Iterator[Any]:
    """The benchmarks' server harness (`harness.ServerProcess`, which `start` calls with the Popen options: its
    own process group, its output in `log`, from the repository root); stopped when the block ends, and whatever
    it started (tritonserver's backend stubs) with it."""
    with log.open("w") as f:
        server = start(cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield server
    finally:
        server.stop(grace=10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)


def _ready(server: Any, timeout: float) -> bool:
    """Whether the server answered ready within `timeout` s (False as soon as it exits)."""
    from harness import ServerExitedError

    try:
        server.wait_ready(timeout, poll=0.5)
    except (ServerExitedError, TimeoutError):
        return False
    return True


def _serve_engine(ctx: Context, plan: Path, image: Path, want: list[float], timeout: float) -> tuple[str, str]:
    """`vit-serve serve PLAN --backend tensorrt` answers POST /classify with PyTorch's top-1 (`want`: PyTorch's
    logits; a class within 1% of the logit range of PyTorch's best is its top-1 too, at fp16)."""
    from harness import ServerProcess

    args = [str(plan), "--backend", "tensorrt", "--device", "cuda", "--host", "127.0.0.1"]
    log = ctx.work / f"serve-{plan.parent.name}.log"
    with _server(log, lambda **popen: ServerProcess.serve(args, env=ctx.env, **popen)) as server:
        if not _ready(server, min(60.0, timeout)):
            return FAIL, f"gateway not ready: {_tail(log.read_text(errors='replace'))}"
        req = urllib.request.Request(f"{server.url}/classify", data=image.read_bytes(),
                                     headers={"Content-Type": "image/png"})
        with urllib.request.urlopen(req, timeout=30) as r:
            got = json.loads(r.read())["predictions"][0]["index"]
    best = max(range(len(want)), key=want.__getitem__)
    ok = want[got] >= want[best] - 0.01 * (max(want) - min(want))
    return (PASS if ok else FAIL), f"gateway TensorRT top-1 {got} (PyTorch {best})"


def _tritonserver_with_tensorrt() -> str | None:
    """The path of a tritonserver that has the TensorRT backend, else None (the pytriton wheel's has not)."""
    exe = shutil.which("tritonserver") or ("/opt/tritonserver/bin/tritonserver"
                                           if Path("/opt/tritonserver/bin/tritonserver").exists() else None)
    if exe is None:
        return None
    backends = Path(exe).resolve().parents[1] / "backends" / "tensorrt"
    return exe if backends.is_dir() else None


def _serve_triton(ctx: Context, repo: Path, timeout: float) -> tuple[str, str]:
    """tritonserver loads every TensorRT model of the repository the export wrote (READY in its index)."""
    exe = _tritonserver_with_tensorrt()
    if exe is None:
        return SKIPPED, "no tritonserver with the TensorRT backend here"
    from harness import ServerProcess, free_port
    from vit_export.tritonserver import SHM_PREFIX_ARG, new_shm_prefix, remove_shm

    port = free_port()
    prefix = new_shm_prefix()  # its own Python-backend regions, removed after it, however it ended
    argv = [exe, f"--model-repository={repo}", f"--http-port={port}", f"--grpc-port={free_port()}",
            f"--metrics-port={free_port()}", f"{SHM_PREFIX_ARG}{prefix}"]
    log = ctx.work / "tritonserver.log"
    with contextlib.ExitStack() as stack:
        stack.callback(remove_shm, prefix)
        server = stack.enter_context(_server(log, lambda **popen: ServerProcess.command(argv, port, ctx.env,
                                                                                          **popen)))
        server.ready_path = "/v2/health/ready"
        if not _ready(server, min(90.0, timeout)):
            return FAIL, f"tritonserver not ready: {_tail(log.read_text(errors='replace'))}"
        req = urllib.request.Request(f"{server.url}/v2/repository/index", data=b"{}", method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            index = json.loads(r.read())
    states = {m["name"]: m.get("state", "?") for m in index}
    ok = bool(states) and all(s == "READY" for s in states.values())
    return (PASS if ok else FAIL), "tritonserver: " + ", ".join(f"{k} {v}" for k, v in states.items())


def corpus_photos(folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the upload corpus's photos, or None where `upload_corpus.photos` loads them itself; why there are none).
    Where scikit-image or matplotlib is missing, the photos carried in `folder` (gpu_wheels.save_photos)."""
    if _needs("skimage", "matplotlib") is None:
        return None, None
    ph = gpu_wheels.load_photos(folder)
    if ph:
        return ph, None
    return None, (f"the upload corpus needs {not_carried(['skimage', 'matplotlib'])}, or its photos carried in "
                  f"{folder} (python benchmarks/gpu_wheels.py)")


def stage_gpu_decode(ctx: Context, timeout: float) -> Result:
    """nvJPEG against the CPU path on the corpus's phone JPEGs (a child), then the gateway decoding on CUDA."""
    if (res := unavailable("gpu-decode", "torchvision")) is not None:
        return res
    end = time.monotonic() + timeout
    ph, why = corpus_photos(Path(ctx.env.get(PHOTOS_ENV, DEFAULT_WHEELS / gpu_wheels.PHOTOS)))
    if why:
        return Result("gpu-decode", NOT_AVAILABLE, why)
    import upload_corpus

    files = upload_corpus.build(ctx.work / "corpus", PHONE_JPEGS, ph)
    decoded = stage_measure("gpu-decode", Context({**ctx.env, CORPUS_ENV: str(ctx.work / "corpus")}, ctx.work,
                                                  ctx.gpus), end - time.monotonic())
    served = _serve_decoded(ctx, files[PHONE_JPEGS[0]], end - time.monotonic())
    return Result("gpu-decode", combine([(decoded.verdict, decoded.detail), served]),
                  f"{decoded.detail}; {served[1]}", decoded.criteria, data=decoded.data)


def _serve_decoded(ctx: Context, jpeg: Path, timeout: float) -> tuple[str, str]:
    """`vit-serve serve --device cuda` on a Ti/16 (random weights) decodes a phone JPEG with nvJPEG (its decoder
    line says so) and answers POST /classify with the top-1 of the library on the CPU path (a class within 1% of
    the logit range of the best: nvJPEG's pixels differ from libjpeg's by design)."""
    if (res := unavailable("gpu-decode", "fastapi", "uvicorn", "pydantic_settings", "multipart")) is not None:
        return res.verdict, f"gateway: {res.detail}"
    if timeout < 20:
        return NO_VERDICT, f"gateway: {timeout:.0f} s left"
    import torch

    import vit_serve
    from vit_serve.preprocess import PreprocessConfig, preprocess

    torch.manual_seed(0)
    model = vit_serve.create_model("Ti/16", num_classes=10)
    with torch.no_grad():  # a zero-initialised head would make every top-1 class 0
        model.head.weight.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(0))
    ckpt = ctx.work / "ti16.safetensors"
    vit_serve.save(model, ckpt)
    with torch.no_grad():
        want = vit_serve.load(ckpt).eval()(preprocess(jpeg, model.preprocess_cfg or PreprocessConfig())[None])[0]
    want = want.tolist()
    from harness import ServerProcess

    args = [str(ckpt), "--device", "cuda", "--host", "127.0.0.1"]
    log = ctx.work / "serve-gpu-decode.log"
    with _server(log, lambda **popen: ServerProcess.serve(args, env=ctx.env, **popen)) as server:
        if not _ready(server, min(90.0, timeout)):
            return FAIL, f"gateway not ready: {_tail(log.read_text(errors='replace'))}"
        req = urllib.request.Request(f"{server.url}/classify", data=jpeg.read_bytes(),
                                     headers={"Content-Type": "image/jpeg"})
        with urllib.request.urlopen(req, timeout=60) as r:
            got = json.loads(r.read())["predictions"][0]["index"]
    text = log.read_text(errors="replace")
    line = next((ln for ln in text.splitlines() if "decode: " in ln), "no decoder line")
    best = max(range(len(want)), key=want.__getitem__)
    top1 = want[got] >= want[best] - 0.01 * (max(want) - min(want))
    ok = top1 and "decode: nvJPEG on cuda" in line
    return (PASS if ok else FAIL), f"gateway: top-1 {got} (CPU path {best}); {line.split('decode: ', 1)[-1]}"


def stage_tensorrt(ctx: Context, timeout: float) -> Result:
    if (res := unavailable("tensorrt", "tensorrt", "onnx", "onnxruntime", "onnxscript")) is not None:
        return res
    import torch

    import vit_serve
    from vit_serve.preprocess import PreprocessConfig, preprocess

    end = time.monotonic() + timeout
    parts: list[tuple[str, str]] = []
    torch.manual_seed(0)
    model = vit_serve.create_model("B/16", num_classes=1000)
    with torch.no_grad():  # a zero-initialised head would make every top-1 class 0
        model.head.weight.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(0))
    ckpt = ctx.work / "b16.safetensors"
    vit_serve.save(model, ckpt)
    image = ctx.work / "photo.png"
    _test_photo(image)
    for res in (224, 384):
        out, repo = ctx.work / f"trt{res}", ctx.work / f"repo{res}"
        argv = [sys.executable, "-m", "vit_export.cli", str(ckpt), "--format", "tensorrt,triton", "--res", str(res),
                "--out", str(out), "--repo", str(repo), "--name", f"b16_{res}", "--triton-ensemble", "trt"]
        rc, log = _run(argv, ctx.env, end - time.monotonic())
        if rc != 0:
            parts.append((NO_VERDICT if rc is None else FAIL,
                          f"vit-export {res}: {'stopped' if rc is None else f'exit {rc}'}: {_tail(log)}"))
            continue
        parts.append((PASS, f"vit-export {res}: exit 0"))
        plans = sorted(out.glob("*_tensorrt/*.plan"))
        if not plans:
            parts.append((FAIL, f"vit-export {res} wrote no engine"))
            continue
        m = vit_serve.load(ckpt)
        m.set_resolution(res)
        with torch.no_grad():
            cfg = (m.preprocess_cfg or PreprocessConfig()).with_size(res, res)
            want = m(preprocess(image, cfg)[None])[0].tolist()
        parts.append(_serve_engine(ctx, plans[0], image, want, end - time.monotonic()))
        parts.append(_serve_triton(ctx, repo, end - time.monotonic()))
    if (why := _needs("pytest")) is None:
        v, d = run_pytest(ctx, "tensorrt", cuda_test_files(REPO / "tests"), max(1.0, end - time.monotonic()))
        parts.append((v, f"TensorRT tests: {d}"))
    else:
        parts.append((NO_VERDICT, f"TensorRT tests: {why}"))
    return Result("tensorrt", combine(parts), "; ".join(d for _, d in parts))


def stage_tensorrt_rope(ctx: Context, timeout: float) -> Result:
    if (res := unavailable("tensorrt-rope", "tensorrt", "onnx", "onnxruntime", "onnxscript", "timm")) is not None:
        return res
    return stage_measure("tensorrt-rope", ctx, timeout)


def rope_profile(patch: int) -> tuple[tuple[int, int, int, int], ...]:
    """The (min, opt, max) [B, 3, H, W] shapes of the RoPE engine's one optimisation profile (ROPE_PROFILE)."""
    return tuple((b, 3, gh * patch, gw * patch) for b, gh, gw in ROPE_PROFILE)


def rope_detail(data: dict[str, Any]) -> str:
    """The RoPE stage's numbers: per size, TensorRT vs onnxruntime and each vs timm; the graph and the build."""
    sizes = "; ".join(f"{k}: TensorRT-onnxruntime {v['trt_vs_ort']:.1e}, TensorRT-timm {v['trt_vs_timm']:.1e}, "
                      f"onnxruntime-timm {v['ort_vs_timm']:.1e}" for k, v in data["sizes"].items())
    return f"{data['model']}: {sizes}; graph {data['ops']} nodes; built in {data['build_s']:.1f} s"


def _test_photo(path: Path) -> None:
    """A real photograph (scikit-image's astronaut) as a PNG."""
    import skimage.data
    from PIL import Image

    Image.fromarray(skimage.data.astronaut()).save(path)


# ---- the stages, child side (one fresh process each, CUDA) ------------------------------------------------------

def _models() -> tuple[Any, Any]:
    """timm's ViT-B/16 and ours with the same weights (converted from it), both on CUDA."""
    import timm
    import torch

    from vit_serve.checkpoints.converted import build_model
    from vit_serve.checkpoints.timm_state import convert_timm

    torch.manual_seed(0)
    ref = timm.create_model(TIMM_NAME, pretrained=False)
    with torch.no_grad():  # timm zero-initialises the head: logits of zeros would agree whatever the network
        ref.head.weight.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(0))
    ours = build_model(convert_timm(ref.state_dict(), TIMM_NAME))
    return ref.cuda(), ours.cuda()


def _images_per_s(step: Callable[[], Any], batch: int, iters: int) -> float:
    import torch

    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    return batch * iters / (time.perf_counter() - t)


def _cosine_min(a: Any, b: Any) -> float:
    import torch.nn.functional as F

    return float(F.cosine_similarity(a.double(), b.double(), dim=-1).min())


def forward_agreement(ref: Any, ours: Any) -> dict[str, float]:
    """fp32 (TF32 off) max |Δ logit| and bf16-autocast minimum cosine between `ours` and timm's `ref`."""
    import torch

    x = torch.randn(8, 3, 224, 224, generator=torch.Generator().manual_seed(1)).cuda()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with torch.inference_mode():
        fp32 = float((ours.eval()(x) - ref.eval()(x)).abs().max())
        with torch.autocast("cuda", dtype=torch.bfloat16):
            cos = _cosine_min(ours(x).float(), ref(x).float())
    torch.backends.cuda.matmul.allow_tf32 = True
    return {"fp32_max_abs": fp32, "bf16_cosine": cos}


def train_losses(device: str, steps: int = 3, batch: int = 8) -> list[float]:
    """The first `steps` AdamW losses of ViT-B/16 (timm's init, same data): fp32 on the CPU, bf16 on CUDA."""
    import timm
    import torch
    import torch.nn.functional as F

    from vit_serve.checkpoints.converted import build_model
    from vit_serve.checkpoints.timm_state import convert_timm

    torch.manual_seed(0)
    ref = timm.create_model(TIMM_NAME, pretrained=False)
    model = build_model(convert_timm(ref.state_dict(), TIMM_NAME)).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(batch, 3, 224, 224, generator=g), torch.randint(0, 1000, (batch,), generator=g)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def loss_rel_diff(cpu: Sequence[float], cuda: Sequence[float]) -> float:
    """The largest |Δ loss| / CPU loss over the steps (inf when a loss is not finite or a step is missing)."""
    if len(cpu) != len(cuda) or not cpu:
        return float("inf")
    diffs = [abs(a - b) / abs(a) for a, b in zip(cpu, cuda, strict=True)]
    return max(diffs) if all(d == d for d in diffs) else float("inf")


def child_throughput(train: bool, compile: bool) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    torch.backends.cuda.matmul.allow_tf32 = True
    ref, ours = _models()
    res: dict[str, Any] = {}
    if not train and not compile:
        res.update(forward_agreement(ref, ours))
    if train and not compile:
        cpu, cuda = train_losses("cpu"), train_losses("cuda")
        res.update(cpu_losses=[round(v, 4) for v in cpu], cuda_losses=[round(v, 4) for v in cuda],
                   loss_rel_diff=loss_rel_diff(cpu, cuda))
    batch = 128 if train else 256
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (batch,), device="cuda")
    steps, compile_s = {}, {}
    for name, model in (("timm", ref), ("ours", ours)):
        model.train(train)
        net = torch.compile(model) if compile else model
        if train:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def step(net=net, opt=opt) -> None:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = F.cross_entropy(net(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        else:
            def step(net=net) -> None:
                with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
                    net(x)
        t = time.perf_counter()
        for _ in range(3):  # warm-up (and compilation)
            step()
        torch.cuda.synchronize()
        compile_s[name] = time.perf_counter() - t
        steps[name] = step
    rates: dict[str, list[float]] = {"timm": [], "ours": []}
    for _ in range(5):  # interleaved rounds: drift on the chip touches both alike
        for name in ("timm", "ours"):
            rates[name].append(_images_per_s(steps[name], batch, 10))
    res.update({k: statistics.median(v) for k, v in rates.items()})
    res.update(batch=batch, rounds=rates, compile_s=compile_s)
    return res


def child_sdpa_kernel() -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import vit_serve

    model = vit_serve.create_model("B/16", num_classes=1000).cuda().eval()
    x = torch.randn(8, 3, 224, 224, device="cuda")
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        model(x)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            model(x)
            torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    kernels = sorted(n for n in names if not n.startswith("aten::")
                     and re.search(r"flash|fmha|attention|sdpa", n, re.IGNORECASE))
    return {"kernels": [k[:120] for k in kernels],
            "flash": any("flash" in k.lower() for k in kernels)}  # the CUDA kernel that ran, not the op asked


def psnr(a: Any, b: Any) -> float:
    import numpy as np

    mse = float(((np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)) ** 2).mean())
    return float("inf") if mse == 0 else 10 * float(np.log10(255.0**2 / mse))


def _rope_models() -> tuple[Any, Any]:
    """timm's tiny DINOv3 (every float tensor + 0.2 N(0, 1), seeded) and ours converted from its state dict."""
    import timm
    import torch

    from vit_serve.checkpoints.converted import build_model
    from vit_serve.checkpoints.timm_state import convert_timm

    name, kw = ROPE_TIMM
    ref = timm.create_model(name, pretrained=False, dynamic_img_size=True, **kw).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ref.state_dict().values():
            if p.is_floating_point():
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    hub = {"architecture": name, "model_args": {k: kw[k] for k in ("img_size", "global_pool")}}
    return ref, build_model(convert_timm(ref.state_dict(), name, hub_config=hub)).eval()


def _build_dynamic_engine(onnx_path: Path, plan_path: Path, patch: int) -> float:
    """An fp32 engine (TF32 cleared, as vit_export.tensorrt_build's) of a dynamic-H x W graph, one profile
    (`rope_profile`); the build's seconds. RuntimeError when TensorRT cannot parse or build it."""
    import tensorrt as trt
    from vit_export.tensorrt_compat import plan_build

    plan = plan_build(str(trt.__version__), "fp32", "fp32")
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    for name in plan.creation_flags:
        flags |= 1 << int(getattr(trt.NetworkDefinitionCreationFlag, name))
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        raise RuntimeError("TensorRT could not parse the graph: " + "; ".join(
            str(parser.get_error(i)) for i in range(parser.num_errors)))
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    profile.set_shape(network.get_input(0).name, *rope_profile(patch))
    config.add_optimization_profile(profile)
    for name in plan.builder_flags:
        config.set_flag(getattr(trt.BuilderFlag, name))
    for name in plan.cleared_flags:
        config.clear_flag(getattr(trt.BuilderFlag, name))
    t0 = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError("TensorRT failed to build the engine of the dynamic graph")
    plan_path.write_bytes(bytes(serialized))
    return time.perf_counter() - t0


def child_tensorrt_rope() -> dict[str, Any]:
    """The `tensorrt-rope` stage: export, TensorRT build, and the logits at ROPE_GRIDS against onnxruntime and timm."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    import torch
    from vit_export.graph_ops import graph_ops
    from vit_export.onnx_export import export_graph

    from vit_serve.tensorrt_engine import TensorRTEngine

    ref, ours = _rope_models()
    p = ours.cfg.patch_size
    with tempfile.TemporaryDirectory(prefix="gpu_check-rope-") as tmp:
        graph = export_graph(ours, Path(tmp) / "dinov3.onnx", res="dynamic", simplify=False)
        ops = graph_ops(onnx.load(str(graph.path)))
        build_s = _build_dynamic_engine(graph.path, Path(tmp) / "dinov3.plan", p)
        engine = TensorRTEngine(Path(tmp) / "dinov3.plan")
        sess = ort.InferenceSession(str(graph.path), providers=["CPUExecutionProvider"])
        sizes = {}
        for gh, gw in ROPE_GRIDS:
            x = torch.randn(2, 3, gh * p, gw * p, generator=torch.Generator().manual_seed(gh * 100 + gw))
            with torch.no_grad():
                want = ref(x).numpy()
            got = np.asarray(engine.run(x.numpy())["logits"], dtype=np.float32)
            on_cpu = sess.run(None, {"pixel_values": x.numpy()})[0]
            sizes[f"{gh * p}x{gw * p}"] = {"trt_vs_ort": float(np.abs(got - on_cpu).max()),
                                           "trt_vs_timm": float(np.abs(got - want).max()),
                                           "ort_vs_timm": float(np.abs(on_cpu - want).max())}
    return {"model": f"{ROPE_TIMM[0]} (tiny)", "plain": ops.plain, "ops": ops.count, "build_s": build_s,
            "sizes": sizes, "max_abs": max(v["trt_vs_ort"] for v in sizes.values())}


def child_gpu_decode() -> dict[str, Any]:
    """nvJPEG (`GpuDecoder` on cuda) against the CPU fast path on the corpus' two 12 MP phone JPEGs (in
    $GPU_CHECK_CORPUS, written by the stage)."""
    from vit_serve.preprocess import PreprocessConfig, load_image, resize_and_crop
    from vit_serve.runtime.gpu_decode import GpuDecoder

    folder = Path(os.environ[CORPUS_ENV])
    datas = {n: (folder / n).read_bytes() for n in PHONE_JPEGS}
    cfg = PreprocessConfig(decode="fast")
    dec = GpuDecoder(cfg, 50_000_000, device="cuda")
    crops = dec.crops(list(datas.values()))
    dec.close()
    if dec.fallbacks:
        return {"psnr": {}, "min_psnr": None, "fallbacks": dict(dec.fallbacks)}
    values = {n: psnr(c, resize_and_crop(load_image(d, cfg=cfg), cfg)) for (n, d), c in
              zip(datas.items(), crops, strict=True)}
    return {"psnr": values, "min_psnr": min(values.values())}


def ddp_worker(report: Path, device_type: str = "cuda") -> None:
    """Under torchrun: DDP over NCCL (gloo for device_type "cpu", for the CPU test), each rank on its own data;
    rank 0 checks the result against one process trained on the concatenated batch (what DDP's averaged
    gradients must equal)."""
    import copy

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import vit_serve

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cuda = device_type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local)
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = vit_serve.create_model("Ti/16", num_classes=10, img_size=64).to(dev)
    single = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local] if cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    opt1 = torch.optim.SGD(single.parameters(), lr=0.1)
    steps, per_rank = 5, 8

    def data(step: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + r)
        return torch.randn(per_rank, 3, 64, 64, generator=g), torch.randint(0, 10, (per_rank,), generator=g)

    for s in range(steps):
        x, y = data(s, rank)
        loss = F.cross_entropy(ddp(x.to(dev)), y.to(dev))
        opt.zero_grad()
        loss.backward()
        opt.step()
        xs, ys = zip(*(data(s, r) for r in range(world)), strict=True)
        loss1 = F.cross_entropy(single(torch.cat(xs).to(dev)), torch.cat(ys).to(dev))
        opt1.zero_grad()
        loss1.backward()
        opt1.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    ranks_agree = all(torch.equal(g, flat) for g in gathered)
    ref = torch.cat([p.detach().flatten() for p in single.parameters()])
    total = torch.tensor([rank + 1.0], device=dev)
    dist.all_reduce(total)
    if rank == 0:
        report.write_text(json.dumps({
            "backend": dist.get_backend(), "world": world, "steps": steps,
            "max_param_diff_vs_single_process": float((flat - ref).abs().max()),
            "ranks_agree": ranks_agree, "all_reduce_ok": float(total) == world * (world + 1) / 2,
        }))
    dist.barrier()
    dist.destroy_process_group()


def run_child(name: str) -> int:
    fn = {"sdpa-kernel": child_sdpa_kernel, "gpu-decode": child_gpu_decode,
          "forward": lambda: child_throughput(False, False), "train": lambda: child_throughput(True, False),
          "forward-compile": lambda: child_throughput(False, True),
          "train-compile": lambda: child_throughput(True, True), "tensorrt-rope": child_tensorrt_rope}[name]
    print(json.dumps(fn()), flush=True)
    return 0


# ---- the report -----------------------------------------------------------------------------------------------

def environment(cuda: bool) -> list[list[str]]:
    """Versions (from the installed distributions: nothing is imported but torch) and the GPUs."""
    from importlib import metadata

    rows = [["python", sys.version.split()[0]]]
    for dist in ("torch", "timm", "onnx", "onnxruntime", "tensorrt", "torchvision", "pytest", "fastapi",
                 "uvicorn", "pydantic"):
        try:
            rows.append([dist, metadata.version(dist)])
        except metadata.PackageNotFoundError:
            rows.append([dist, "not installed"])
    if cuda:
        import torch

        rows.append(["CUDA (torch build)", str(torch.version.cuda)])
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            rows.append([f"GPU {i}", f"{p.name}, sm{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB"])
    return rows


def report(results: list[Result], env_rows: list[list[str]], notes: list[str], budget_s: float,
           wall_s: float, dry_run: bool = False) -> str:
    parts = ["# GPU check", "", markdown_table(["", "version"], env_rows), "", *notes, "" if notes else None,
             markdown_table(["stage", "verdict", "criterion", "detail", "s"],
                            [[r.stage, r.verdict, _criterion(r.stage), r.detail, f"{r.seconds:.0f}"]
                             for r in results])]
    code = exit_code([r.verdict for r in results], dry_run)
    parts += ["", f"Total {wall_s:.0f} s of a {budget_s:.0f} s budget; exit {code}."]
    return "\n".join(p for p in parts if p is not None) + "\n"


def _criterion(name: str) -> str:
    return next(s.criterion for s in STAGES if s.name == name)


def cuda_devices() -> tuple[int, str | None]:
    """(the number of CUDA devices, or 0 and why not)."""
    try:
        import torch
    except ImportError:
        return 0, "torch is not installed"
    if not torch.cuda.is_available():
        return 0, "no CUDA device"
    return torch.cuda.device_count(), None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write gpu_check.md and gpu_check.json into this folder")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                    help=f"seconds for the whole check (default {DEFAULT_BUDGET_S:.0f})")
    ap.add_argument("--only", help="comma list of stage names to run (default: all)")
    ap.add_argument("--wheels", type=Path, default=DEFAULT_WHEELS,
                    help="the carried wheels and photos (default ./.gpu-wheels; benchmarks/gpu_wheels.py fills it)")
    ap.add_argument("--no-install", action="store_true", help="install none of the carried wheels")
    ap.add_argument("--list", "--dry-run", dest="list", action="store_true",
                    help="list the stages and their criteria, and exit (no GPU needed)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--ddp-worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--ddp-device", default="cuda", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    names = [s.name for s in STAGES]
    only = args.only.split(",") if args.only else names
    unknown = sorted(set(only) - set(names))
    if unknown:
        ap.error(f"unknown stage {', '.join(unknown)}; the stages are {', '.join(names)}")
    if args.list:
        print(markdown_table(["stage", "what", "criterion", "needs s", "at most s"],
                             [[s.name, s.what, s.criterion, f"{s.needs_s:.0f}", f"{s.limit_s:.0f}"] for s in STAGES]))
        print(f"\nglobal budget {args.budget:.0f} s; a stage gets no verdict when less than it needs is left")
        return 0
    if args.child:
        _ensure_importable()
        return run_child(args.child)
    if args.ddp_worker:
        _ensure_importable()
        ddp_worker(args.ddp_worker, args.ddp_device)
        return 0

    t_start = time.monotonic()
    budget = Budget(args.budget)
    notes: list[str] = []
    results: list[Result] = []
    runners: dict[str, Callable[[Context, float], Result]] = {
        "cuda-tests": stage_cuda_tests, "tensorrt": stage_tensorrt, "ddp-nccl": stage_ddp,
        "gpu-decode": stage_gpu_decode, "tensorrt-rope": stage_tensorrt_rope}
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as work:
        site = Path(work) / "site"  # the carried wheels this machine lacks, installed for this run only
        if not args.no_install:
            notes.append(gpu_wheels.install(args.wheels, site))
            print(notes[-1], file=sys.stderr, flush=True)
        env = _ensure_importable(site if site.is_dir() else None)
        env[PHOTOS_ENV] = str(args.wheels.resolve() / gpu_wheels.PHOTOS)
        gpus, no_cuda = cuda_devices()
        ctx = Context(env, Path(work), gpus)
        for stage in STAGES:
            if stage.name not in only:
                continue
            limit = budget.allow(stage)
            if no_cuda is not None:
                results.append(Result(stage.name, NO_VERDICT, no_cuda))
            elif limit is None:
                results.append(Result(stage.name, NO_VERDICT,
                                      f"budget spent: {budget.left():.0f} s left, needs {stage.needs_s:.0f} s"))
            else:
                print(f"[{time.monotonic() - t_start:5.0f} s] {stage.name}: {stage.what} (at most {limit:.0f} s)",
                      file=sys.stderr, flush=True)
                t = time.monotonic()
                run = runners.get(stage.name)
                try:
                    res = run(ctx, limit) if run else stage_measure(stage.name, ctx, limit)
                except Exception as e:  # a stage's own crash is its FAIL, never the end of the check
                    res = Result(stage.name, FAIL, f"{type(e).__name__}: {e}")
                res.seconds = time.monotonic() - t
                results.append(res)
            print(f"        {results[-1].stage}: {results[-1].verdict}: {results[-1].detail}", file=sys.stderr,
                  flush=True)
        env_rows = environment(no_cuda is None)  # the carried distributions' versions too
    dry_run = no_cuda is not None
    if dry_run:
        notes.append(f"A dry run ({no_cuda}): nothing could be judged here.")
    text = report(results, env_rows, notes, args.budget, time.monotonic() - t_start, dry_run)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.md").write_text(text)
        (args.out / "gpu_check.json").write_text(json.dumps(
            [{**asdict(r), "criteria": [{**asdict(c), "ok": c.ok} for c in r.criteria]} for r in results],
            indent=2, default=str))
    return exit_code([r.verdict for r in results], dry_run)


if __name__ == "__main__":
    sys.exit(main())
