"""Peak memory and wall time of `vit-export CKPT --res dynamic`, each export in its own process.

    python benchmarks/export_memory.py [--models S/16,B/16,L/16] [--res 384] [--limit-gb 10]
        [--out RESULTS.json] [-- extra vit-export flags]

Per model: timm's preset at `--res` (`vit_<size>_patch16_<res>`) with timm's own random init (pretrained=False,
1000 classes), converted to a vit-serve checkpoint in a separate process; then `vit-export CKPT --res dynamic`
in a fresh process (both ONNX graphs, each checked against PyTorch with onnxruntime). The export's peak RSS is
its own VmHWM (read by the process itself as it exits) and, as a cross-check and a guard, the largest
VmRSS sampled from /proc every 50 ms; a watchdog kills the export above `--limit-gb` (the machine may be shared),
and the row then says "killed". The progress lines the export prints split its run into phases: each phase's
peak RSS says which step needs the memory (the export of a graph, its simplification, its parity check).

Targets (export-in-bounded-memory issue): B/16 under 4 GB, L/16 under 8 GB. The table and the JSON name the CPU
and the torch / onnxruntime versions; report them with it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GB = 1 << 30
TARGETS_GB = {"B/16": 4.0, "L/16": 8.0}
TIMM_SIZES = {"Ti": "tiny", "S": "small", "B": "base", "L": "large", "H": "huge"}
SAMPLE_S = 0.05

# The export process: the CLI, then its own peak RSS as the last line on stderr: VmHWM (KiB), the high-water mark
# of the memory this process has mapped since its exec. Not ru_maxrss: Linux carries that over an exec from the
# process that forked it, so an export started by a large process (a test worker of several GB) reported its
# parent's size.
_EXPORT = """
import json, sys
from vit_export.cli import main
rc = main(sys.argv[1:])
sys.stdout.flush()
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"peak_rss_kib": hwm}), file=sys.stderr)
raise SystemExit(rc)
"""

_CHECKPOINT = """
import sys, timm, torch, vit_serve
from vit_serve.checkpoints import build_model
from vit_serve.checkpoints.timm_state import convert_timm
arch, path = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
ref = timm.create_model(arch, pretrained=False).eval()
vit_serve.save(build_model(convert_timm(ref.state_dict(), arch)).eval(), path)
"""


@dataclass
class Phase:
    """The export's progress line that ended a phase, the phase's seconds and its peak sampled RSS."""

    line: str
    seconds: float
    peak_rss_bytes: int


@dataclass
class Measurement:
    """One export process: exit code, wall seconds, peak RSS (its own VmHWM, and the largest sample), whether
    the watchdog killed it, its phases and the tail of its output."""

    returncode: int
    seconds: float
    peak_rss_bytes: int
    sampled_peak_bytes: int
    killed: bool
    phases: list[Phase] = field(default_factory=list)
    tail: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.killed


def rss_bytes(pid: int) -> int:
    """The resident set of process `pid` (VmRSS), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def python_env() -> dict[str, str]:
    """The environment of a child Python: this checkout first on its path (PYTHONPATH kept after it)."""
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)))


def measure_export(ckpt: Path, args: list[str], limit_bytes: int, timeout_s: float = 3600.0,
                   env: dict[str, str] | None = None) -> Measurement:
    """Run `vit-export ckpt *args` in a new process; sample its RSS, kill it above `limit_bytes` or after
    `timeout_s`, and split its run into phases at its progress lines."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", _EXPORT, str(ckpt), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env if env is not None else python_env())
    state = {"peak": 0, "phase_peak": 0, "phase_t0": t0, "killed": False}
    phases: list[Phase] = []
    out_lines: list[str] = []
    err_lines: list[str] = []
    lock = threading.Lock()

    def watch() -> None:
        while proc.poll() is None:
            rss = rss_bytes(proc.pid)
            with lock:
                state["peak"] = max(state["peak"], rss)
                state["phase_peak"] = max(state["phase_peak"], rss)
            if rss > limit_bytes or time.perf_counter() - t0 > timeout_s:
                state["killed"] = True
                proc.kill()
                return
            time.sleep(SAMPLE_S)

    def read_out() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out_lines.append(line)
            now = time.perf_counter()
            with lock:
                phases.append(Phase(line.strip()[:100], now - state["phase_t0"], state["phase_peak"]))
                state["phase_t0"], state["phase_peak"] = now, rss_bytes(proc.pid)

    def read_err() -> None:
        assert proc.stderr is not None
        err_lines.extend(proc.stderr)

    threads = [threading.Thread(target=f, daemon=True) for f in (watch, read_out, read_err)]
    for t in threads:
        t.start()
    rc = proc.wait()
    for t in threads:
        t.join(timeout=10)
    seconds = time.perf_counter() - t0
    ru = 0
    for line in reversed(err_lines):
        if line.startswith('{"peak_rss_kib"'):
            ru = json.loads(line)["peak_rss_kib"] * 1024
            break
    tail = "".join(out_lines[-5:] + err_lines[-15:])[-3000:]
    return Measurement(rc, seconds, max(ru, state["peak"]), state["peak"], bool(state["killed"]),
                       [p for p in phases if p.line], tail)


def timm_arch(model: str, res: int) -> str:
    """"B/16", 384 -> "vit_base_patch16_384"."""
    size, patch = model.split("/")
    return f"vit_{TIMM_SIZES[size]}_patch{patch}_{res}"


def make_checkpoint(model: str, res: int, path: Path) -> Path:
    """timm's `model` preset at `res` with its own random init, as a vit-serve checkpoint (in another process:
    this one stays small)."""
    subprocess.run([sys.executable, "-c", _CHECKPOINT, timm_arch(model, res), str(path)], check=True,
                   env=python_env())
    return path


def table(rows: list[dict]) -> str:
    """The results as a markdown table."""
    lines = ["| model | res | peak RSS | sampled | time | target | exit |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        target = TARGETS_GB.get(r["model"])
        verdict = "-" if target is None else f"< {target:g} GB: {'met' if r['met'] else 'MISSED'}"
        state = "killed" if r["killed"] else str(r["returncode"])
        lines.append(f"| {r['model']} | {r['res']} | {r['peak_rss_gb']:.2f} GB | {r['sampled_peak_gb']:.2f} GB | "
                     f"{r['seconds']:.0f} s | {verdict} | {state} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="S/16,B/16,L/16", help="comma list of timm presets: Ti/16, S/16, B/16, L/16")
    ap.add_argument("--res", type=int, default=384)
    ap.add_argument("--limit-gb", type=float, default=10.0, help="kill an export whose RSS passes this")
    ap.add_argument("--out", type=Path, help="the results file (default benchmarks/results/export_memory.json)")
    ap.add_argument("export_args", nargs="*", help="more vit-export flags (after --)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import onnxruntime
    import torch
    from export_onnx import cpu_info

    rows = []
    cpu = cpu_info()
    print(f"CPU: {cpu}; torch {torch.__version__}, onnxruntime {onnxruntime.__version__}", flush=True)
    for model in filter(None, (m.strip() for m in args.models.split(","))):
        with tempfile.TemporaryDirectory(prefix="bench-export-memory-") as tmp:
            ckpt = make_checkpoint(model, args.res, Path(tmp) / "model.safetensors")
            flags = ["--res", "dynamic", "--out", str(Path(tmp) / "out"), *args.export_args]
            print(f"{model} at {args.res}: vit-export {' '.join(flags)} ...", flush=True)
            m = measure_export(ckpt, flags, int(args.limit_gb * GB))
        target = TARGETS_GB.get(model)
        row = {"model": model, "arch": timm_arch(model, args.res), "res": args.res, "flags": flags[:2],
               "peak_rss_gb": m.peak_rss_bytes / GB, "sampled_peak_gb": m.sampled_peak_bytes / GB,
               "seconds": m.seconds, "returncode": m.returncode, "killed": m.killed,
               "target_gb": target, "met": m.ok and (target is None or m.peak_rss_bytes / GB < target),
               "phases": [asdict(p) | {"peak_rss_gb": p.peak_rss_bytes / GB} for p in m.phases]}
        rows.append(row)
        for p in m.phases:
            print(f"    {p.peak_rss_bytes / GB:6.2f} GB {p.seconds:7.1f} s  {p.line}")
        print(f"  peak RSS {row['peak_rss_gb']:.2f} GB, {m.seconds:.0f} s, exit "
              f"{'killed' if m.killed else m.returncode}", flush=True)
        if not m.ok:
            print(m.tail, flush=True)
    print(table(rows))
    from results_file import ResultsFile, Table, print_checks

    checks = [(f"{r['model']} at {r['res']}: export peak RSS (GB)", f"{r['peak_rss_gb']:.2f}",
               f"< {r['target_gb']}" if r["target_gb"] else "exit 0", r["met"]) for r in rows]
    print_checks(checks)
    columns = ["model", "arch", "res", "peak_rss_gb", "sampled_peak_gb", "seconds", "returncode", "killed",
               "target_gb", "met"]
    tables = [Table.from_dicts("vit-export --res dynamic, each export in its own process", rows, columns)]
    return ResultsFile.of("export_memory", tables, checks, {"rows": rows}, args, argv).save(args.out)

if __name__ == "__main__":
    raise SystemExit(main())
