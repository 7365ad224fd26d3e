"""One prepared check of every CUDA path, for when a GPU is lent: under 8 minutes on one GPU.

    python benchmarks/gpu_check.py [--out DIR] [--budget 450] [--only NAME,...]   # from the repository root
    python benchmarks/gpu_check.py --list                                         # the stages; no GPU needed

Stages, in order (each runs in its own process under the global time budget; a stage that would not fit in
what is left is skipped with a line saying so, and one that overruns is stopped):

* cuda-tests:    pytest on every test file under tests/ that has a CUDA-only test (found by scanning them)
* sdpa-kernel:   which scaled-dot-product-attention kernel runs for ViT-B/16 in bf16 (torch.profiler; flash expected)
* forward:       forward images/s, vit-serve vs timm, ViT-B/16 at 224, bf16 autocast, same weights, eager
* train:         training images/s (forward, backward, AdamW), same models and precision, eager
* ddp-nccl:      DDP over NCCL with torchrun, world size = the number of GPUs, checked against one process;
                 then `vit-serve train --device cuda --precision bf16` under torchrun (the real loop)
* tensorrt:      tests/export/test_tensorrt.py and the TensorRT serving test, when `import tensorrt` works
* forward-compile, train-compile: the throughput stages again with torch.compile on both models

It prints a table per part and writes it to DIR/gpu_check.md (and gpu_check.json) with `--out DIR`.
Without a CUDA device it says so in one line and exits 3 (as `vit-export` does for TensorRT). Exit 1 when a stage
failed, else 0 (a stage skipped for want of time or a package, or stopped at its limit, gives no verdict).
Works without `pip install -e .`: the repository root and a `vit_export` alias of export/ (pyproject's
package-dir mapping) are put on the path of this process and of its children.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
NO_CUDA_EXIT = 3
DEFAULT_BUDGET_S = 450.0  # 7.5 minutes: the whole check stays under 8 on one GPU
TIMM_NAME = "vit_base_patch16_224"

# A test file has CUDA-only tests when it asks for CUDA, a GPU or TensorRT in a skip condition.
_CUDA_TEST_RE = re.compile(r"cuda\.is_available|\bneeds?_(?:cuda|gpu|trt)\b|mark\.(?:cuda|gpu)\b|CUDA GPU",
                           re.IGNORECASE)
_PYTEST_COUNT_RE = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


# ---- pure parts (tested on the CPU) ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Stage:
    name: str
    what: str
    needs_s: float  # the least time the stage needs; it is skipped when less is left
    limit_s: float  # the most it may take


STAGES: tuple[Stage, ...] = (
    Stage("cuda-tests", "pytest on the test files with CUDA-only tests", 30, 150),
    Stage("sdpa-kernel", "SDPA kernel of ViT-B/16 bf16 (torch.profiler)", 15, 60),
    Stage("forward", "forward images/s vs timm, ViT-B/16 224 bf16, eager", 20, 60),
    Stage("train", "training images/s vs timm, ViT-B/16 224 bf16, eager", 25, 75),
    Stage("ddp-nccl", "DDP over NCCL (torchrun, world = GPUs) + `vit-serve train` bf16 on CUDA", 30, 120),
    Stage("tensorrt", "TensorRT engine tests (when tensorrt imports)", 30, 150),
    Stage("forward-compile", "forward images/s vs timm with torch.compile", 60, 150),
    Stage("train-compile", "training images/s vs timm with torch.compile", 90, 180),
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


def pytest_counts(output: str) -> dict[str, int]:
    """The counts of pytest's last summary line ("3 passed, 2 skipped in 4.1s")."""
    lines = [ln for ln in output.splitlines() if _PYTEST_COUNT_RE.search(ln)]
    if not lines:
        return {}
    return {kind.rstrip("s") if kind.startswith("error") else kind: int(n)
            for n, kind in _PYTEST_COUNT_RE.findall(lines[-1])}


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in r) + " |" for r in rows]
    return "\n".join(out)


def _vit_export_importable() -> bool:
    try:
        import vit_export  # noqa: F401  (installed, or already aliased in this process)
    except ImportError:
        return False
    return True


def child_env(repo: Path = REPO, installed: bool | None = None) -> dict[str, str]:
    """The environment for child processes: `vit_serve` and `vit_export` importable from the working tree
    even when the package is not installed (pyproject maps vit_export to export/: a symlink does the same)."""
    env = dict(os.environ)
    paths = [str(repo)]
    if not (_vit_export_importable() if installed is None else installed):
        alias = Path(tempfile.mkdtemp(prefix="gpu_check-path-"))
        atexit.register(shutil.rmtree, alias, ignore_errors=True)
        (alias / "vit_export").symlink_to(repo / "export", target_is_directory=True)
        paths.insert(0, str(alias))
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    return env


def _ensure_importable() -> dict[str, str]:
    env = child_env()
    for p in reversed(env["PYTHONPATH"].split(os.pathsep)):
        if p not in sys.path:
            sys.path.insert(0, p)
    return env


# ---- results ------------------------------------------------------------------------------------------------

@dataclass
class Result:
    stage: str
    status: str  # pass | FAIL | skipped (not run) | stopped (ran out of its time: no verdict)
    detail: str
    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)


def _run(argv: list[str], env: dict[str, str], timeout: float, cwd: Path = REPO) -> tuple[int | None, str]:
    """Run a child in its own process group; (exit code, or None when stopped at the timeout; its output).
    At the timeout the whole group is killed: torchrun's workers and servers started by tests go with it."""
    p = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
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


# ---- the stages, parent side ----------------------------------------------------------------------------------

def stage_cuda_tests(env: dict[str, str], timeout: float) -> Result:
    if importlib.util.find_spec("pytest") is None:
        return Result("cuda-tests", "skipped", "pytest is not installed here")
    files = [f for f in cuda_test_files(REPO / "tests") if f.name != "test_tensorrt.py"]
    if not files:
        return Result("cuda-tests", "skipped", "no test file under tests/ has a CUDA-only test")
    # addopts cleared: pyproject's `--dist loadfile` needs pytest-xdist, which may be missing here.
    argv = [sys.executable, "-m", "pytest", "-q", "-rs", "-o", "addopts=", "-p", "no:cacheprovider",
            *[str(f.relative_to(REPO)) for f in files]]
    rc, out = _run(argv, env, timeout)
    counts = pytest_counts(out)
    names = ", ".join(str(f.relative_to(REPO)) for f in files)
    if rc is None:
        return Result("cuda-tests", "stopped", f"at {timeout:.0f} s ({names})", data={"output": out[-4000:]})
    summary = ", ".join(f"{v} {k}" for k, v in counts.items()) or _tail(out)
    ok = rc == 0 or (rc == 5 and not counts.get("failed"))  # 5: nothing collected
    return Result("cuda-tests", "pass" if ok else "FAIL", f"{summary} ({names})", data={"output": out[-4000:]})


def stage_tensorrt(env: dict[str, str], timeout: float) -> Result:
    if importlib.util.find_spec("tensorrt") is None:
        return Result("tensorrt", "skipped", "`import tensorrt` fails here (not installed)")
    if importlib.util.find_spec("pytest") is None:
        return Result("tensorrt", "skipped", "pytest is not installed here")
    argv = [sys.executable, "-m", "pytest", "-q", "-rs", "-o", "addopts=", "-p", "no:cacheprovider",
            "tests/export/test_tensorrt.py", "tests/serve/test_backends.py", "-k", "tensorrt or engine"]
    rc, out = _run(argv, env, timeout)
    if rc is None:
        return Result("tensorrt", "stopped", f"at {timeout:.0f} s", data={"output": out[-4000:]})
    summary = ", ".join(f"{v} {k}" for k, v in pytest_counts(out).items()) or _tail(out)
    return Result("tensorrt", "pass" if rc == 0 else "FAIL", summary, data={"output": out[-4000:]})


def stage_ddp(env: dict[str, str], timeout: float) -> Result:
    import torch

    world = torch.cuda.device_count()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu_check-ddp-") as tmp:
        report = Path(tmp) / "ddp.json"
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
        rc, out = _run([*torchrun, str(Path(__file__).resolve()), "--ddp-worker", str(report)], env, timeout)
        if rc != 0 or not report.exists():
            why = "stopped at the time limit" if rc is None else f"exit {rc}"
            return Result("ddp-nccl", "FAIL", f"DDP worker {why}: {_tail(out)}", data={"output": out[-4000:]})
        ddp = json.loads(report.read_text())
        ok = ddp["max_param_diff_vs_single_process"] <= 1e-4 and ddp["ranks_agree"] and ddp["all_reduce_ok"]
        detail = (f"world {world} over {ddp['backend']}: params after {ddp['steps']} DDP steps vs one process on "
                  f"the concatenated batch, max |diff| {ddp['max_param_diff_vs_single_process']:.1e}; ranks agree: "
                  f"{ddp['ranks_agree']}; CUDA all_reduce: {ddp['all_reduce_ok']}")
        left = timeout - (time.monotonic() - t0)
        if left < 20:
            return Result("ddp-nccl", "pass" if ok else "FAIL", detail + "; `vit-serve train`: no time left", data=ddp)
        missing = [m for m in ("sklearn", "torchvision") if importlib.util.find_spec(m) is None]
        if missing:
            return Result("ddp-nccl", "pass" if ok else "FAIL",
                          detail + f"; `vit-serve train`: skipped ({', '.join(missing)} not installed)", data=ddp)
        out_dir = Path(tmp) / "train"
        rc, out = _run([*torchrun, "-m", "vit_serve", "train", "--device", "cuda", "--precision", "bf16",
                        "--steps", "60", "--log-every", "20", "--out", str(out_dir)], env, left)
        summary_path = out_dir / "summary.json"
        if rc == 0 and summary_path.exists():
            s = json.loads(summary_path.read_text())
            detail += (f"; `vit-serve train --device cuda --precision bf16` x{world}: 60 steps, "
                       f"top-1 {100 * s['top1']:.1f}%, {s['images_per_s']:.0f} img/s")
        else:
            ok = False
            detail += f"; `vit-serve train` on CUDA failed ({'timeout' if rc is None else f'exit {rc}'}): {_tail(out)}"
            ddp["train_output"] = out[-4000:]
    return Result("ddp-nccl", "pass" if ok else "FAIL", detail, data=ddp)


def stage_measure(name: str, env: dict[str, str], timeout: float) -> Result:
    rc, data, out = _child_stage(name, env, timeout)
    if rc is None:
        return Result(name, "stopped", f"at {timeout:.0f} s: {_tail(out)}", data={"output": out[-4000:]})
    if rc != 0 or not data:
        return Result(name, "FAIL", f"exit {rc}: {_tail(out)}", data={"output": out[-4000:]})
    if name == "sdpa-kernel":
        ok = data["flash"]
        detail = (f"aten: {', '.join(data['aten_ops']) or 'none'}; kernels: {', '.join(data['kernels']) or 'none'}"
                  + ("" if ok else " (no flash kernel ran)"))
    else:
        ok = True  # throughput is reported, not judged: the ratio column says it
        detail = (f"timm {data['timm']:.0f} img/s, vit-serve {data['ours']:.0f} img/s, ratio "
                  f"{data['ours'] / data['timm']:.3f}x (batch {data['batch']}"
                  + (f", compile {data['compile_s']['timm']:.0f} s / {data['compile_s']['ours']:.0f} s" if
                     data.get("compile_s") else "") + ")")
    return Result(name, "pass" if ok else "FAIL", detail, data=data)


# ---- the stages, child side (one fresh process each, CUDA) ------------------------------------------------------

def _models() -> tuple[Any, Any]:
    """timm's ViT-B/16 and ours with the same weights (converted from it), both on CUDA."""
    import timm
    import torch

    from vit_serve.checkpoints.converted import build_model
    from vit_serve.checkpoints.timm_state import convert_timm

    torch.manual_seed(0)
    ref = timm.create_model(TIMM_NAME, pretrained=False)
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


def child_throughput(train: bool, compile: bool) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    torch.backends.cuda.matmul.allow_tf32 = True
    ref, ours = _models()
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
    res: dict[str, Any] = {k: statistics.median(v) for k, v in rates.items()}
    res.update(batch=batch, rounds=rates)
    if compile:
        res["compile_s"] = compile_s
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
    aten = sorted(n for n in names if n.startswith("aten::_") and ("attention" in n or "flash" in n))
    kernels = sorted(n for n in names if not n.startswith("aten::")
                     and re.search(r"flash|fmha|attention|sdpa", n, re.IGNORECASE))
    return {"aten_ops": aten, "kernels": [k[:120] for k in kernels],
            "flash": any("flash" in k.lower() for k in kernels)}  # the CUDA kernel that ran, not the op asked


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
    fn = {"sdpa-kernel": child_sdpa_kernel,
          "forward": lambda: child_throughput(False, False), "train": lambda: child_throughput(True, False),
          "forward-compile": lambda: child_throughput(False, True),
          "train-compile": lambda: child_throughput(True, True)}[name]
    print(json.dumps(fn()), flush=True)
    return 0


# ---- the report -----------------------------------------------------------------------------------------------

def environment() -> list[list[str]]:
    import torch

    rows = [["torch", torch.__version__], ["CUDA (torch build)", str(torch.version.cuda)]]
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        rows.append([f"GPU {i}", f"{p.name}, sm{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB"])
    for mod in ("timm", "onnx", "onnxruntime", "tensorrt", "pytest"):
        spec = importlib.util.find_spec(mod)
        if spec is None:
            rows.append([mod, "not installed"])
            continue
        try:
            rows.append([mod, getattr(__import__(mod), "__version__", "?")])
        except Exception as e:  # a broken install is reported, not fatal
            rows.append([mod, f"import fails: {type(e).__name__}"])
    return rows


def report(results: list[Result], env_rows: list[list[str]], budget_s: float, wall_s: float) -> str:
    parts = ["# GPU check", "", markdown_table(["", "version"], env_rows), "",
             markdown_table(["stage", "result", "detail", "s"],
                            [[r.stage, r.status, r.detail, f"{r.seconds:.0f}"] for r in results])]
    speed = [r for r in results if r.stage in ("forward", "train", "forward-compile", "train-compile")
             and r.status == "pass"]
    if speed:
        parts += ["", "ViT-B/16 at 224, bf16 autocast, same weights, images/s (median of 5 interleaved rounds):", "",
                  markdown_table(["measurement", "batch", "timm", "vit-serve", "vit-serve / timm"],
                                 [[r.stage, r.data["batch"], f"{r.data['timm']:.0f}", f"{r.data['ours']:.0f}",
                                   f"{r.data['ours'] / r.data['timm']:.3f}x"] for r in speed])]
    parts += ["", f"Total {wall_s:.0f} s of a {budget_s:.0f} s budget."]
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write gpu_check.md and gpu_check.json into this folder")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                    help=f"seconds for the whole check (default {DEFAULT_BUDGET_S:.0f})")
    ap.add_argument("--only", help="comma list of stage names to run (default: all)")
    ap.add_argument("--list", "--dry-run", dest="list", action="store_true",
                    help="list the stages and exit (no GPU needed)")
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
        print(markdown_table(["stage", "what", "needs s", "at most s"],
                             [[s.name, s.what, f"{s.needs_s:.0f}", f"{s.limit_s:.0f}"] for s in STAGES]))
        print(f"\nglobal budget {args.budget:.0f} s; a stage is skipped when less than it needs is left")
        return 0
    env = _ensure_importable()
    if args.child:
        return run_child(args.child)
    if args.ddp_worker:
        ddp_worker(args.ddp_worker, args.ddp_device)
        return 0

    import torch

    if not torch.cuda.is_available():
        msg = ("gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing to check here "
               "(--list shows the stages)")
        print(msg, file=sys.stderr)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "gpu_check.md").write_text(f"# GPU check\n\n{msg}\n")
        return NO_CUDA_EXIT

    t_start = time.monotonic()
    budget = Budget(args.budget)
    env_rows = environment()
    results: list[Result] = []
    runners: dict[str, Callable[[dict[str, str], float], Result]] = {
        "cuda-tests": stage_cuda_tests, "tensorrt": stage_tensorrt, "ddp-nccl": stage_ddp}
    for stage in STAGES:
        if stage.name not in only:
            continue
        limit = budget.allow(stage)
        if limit is None:
            results.append(Result(stage.name, "skipped",
                                  f"budget spent: {budget.left():.0f} s left, needs {stage.needs_s:.0f} s"))
        else:
            print(f"[{time.monotonic() - t_start:5.0f} s] {stage.name}: {stage.what} (at most {limit:.0f} s)",
                  file=sys.stderr, flush=True)
            t = time.monotonic()
            run = runners.get(stage.name)
            res = run(env, limit) if run else stage_measure(stage.name, env, limit)
            res.seconds = time.monotonic() - t
            results.append(res)
        print(f"        {results[-1].status}: {results[-1].detail}", file=sys.stderr, flush=True)
    text = report(results, env_rows, args.budget, time.monotonic() - t_start)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.md").write_text(text)
        (args.out / "gpu_check.json").write_text(json.dumps(
            [{"stage": r.stage, "status": r.status, "detail": r.detail, "seconds": r.seconds, "data": r.data}
             for r in results], indent=2, default=str))
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
