"""The per-core table (issue 43): every CPU runtime and precision on the same ViT, side by side in one run.

    python benchmarks/cpu_runtimes.py [--models S/16,B/16] [--res 224] [--batches 1,8] [--threads 2] [--rounds 5]
        [--iters 4] [--crops 32] [--runtimes eager,compiled,compiled-bf16,ort,ort-int8-dynamic,ort-int8-static,
        ov-f32,ov-bf16,ov-int8] [--flops-per-cycle N] [--tiny]

For each model (random weights, timm-style init; the same `vit-export` graph for every ONNX runtime) at batch 1
and 8: img/s and img/s per core (medians over interleaved rounds: each round runs every contender once), top-1
agreement and the mean cosine of the logits against PyTorch eager fp32 on `--crops` crops of real photos
(scikit-image's), judged by `vit_serve.accuracy_bounds` for the reduced precisions, and the arithmetic achieved
(GFLOP/s from the forward's FLOPs counted by torch's FlopCounterMode) against the cores' fp32 peak
(threads x clock x `--flops-per-cycle`, default from the ISA: 32 with AVX-512 or AVX2 (two 256-bit FMA pipes, as
Zen 4 executes AVX-512), 16 without; an estimate, said so in the header). The first lines name the CPU, its clock
and its ISA flags (AVX2, AVX-512, VNNI, BF16, AMX): OpenVINO's bf16 needs AVX512_BF16 or AMX and falls back to
f32 without them (the table then says "f32" in the precision the plugin reports).

Contenders: torch eager fp32 (inference mode); torch.compile (inductor) fp32 and with bf16 autocast
(`compiled-bf16`, on CPUs with bf16 only); onnxruntime fp32, int8 dynamic and int8 static (QDQ, calibrated on
the crops' first half: `vit_export.quantize`); OpenVINO f32 and bf16 (`INFERENCE_PRECISION_HINT`) of the same ONNX
file, and the NNCF int8 IR (`vit_export.openvino_ir.quantize_ir`, calibrated as static int8) at the plugin's
native precision. `--tiny` runs a 2-block Ti/16 at 32x32 on 4 crops (the smoke test's settings).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import vit_serve
from vit_serve.accuracy_bounds import BOUNDS, cosines
from vit_serve.runtime.backends.openvino import compile_model

RUNTIMES = ("eager", "compiled", "compiled-bf16", "ort", "ort-int8-dynamic", "ort-int8-static", "ov-f32", "ov-bf16",
            "ov-int8")
PRECISION = {"eager": "fp32", "compiled": "fp32", "compiled-bf16": "bf16", "ort": "fp32", "ort-int8-dynamic": "int8",
             "ort-int8-static": "int8", "ov-f32": "fp32", "ov-bf16": "bf16", "ov-int8": "int8"}
ISA = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class CPU:
    model: str
    ghz: float
    flags: frozenset[str]

    @property
    def bf16(self) -> bool:
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    def flops_per_cycle(self) -> int:
        return 32 if {"avx512f", "avx2"} & self.flags else 16


def cpu() -> CPU:
    """The CPU's model, clock (GHz, /proc/cpuinfo's current MHz) and flags (Linux; elsewhere what platform says)."""
    import platform

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return CPU(platform.processor() or platform.machine(), 0.0, frozenset())
    field = lambda key: next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith(key)), "")  # noqa: E731
    mhz = field("cpu MHz")
    return CPU(field("model name") or "?", float(mhz) / 1000 if mhz else 0.0, frozenset(field("flags").split()))


def photo_crops(n: int, size: tuple[int, int], pre) -> torch.Tensor:
    """`n` crops of scikit-image's photos (each photo cut into a grid of squares, in turn), preprocessed by `pre`."""
    import skimage.data
    from PIL import Image

    from vit_serve.preprocess import preprocess_batch

    names = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry")
    photos = [getattr(skimage.data, name)() for name in names]
    crops = []
    for i in range(n):
        a = photos[i % len(photos)]
        k = i // len(photos)
        side = min(a.shape[:2]) // 2
        y, x = (k % 2) * (a.shape[0] - side), ((k // 2) % 2) * (a.shape[1] - side)
        crops.append(Image.fromarray(a[y : y + side, x : x + side]))
    return preprocess_batch(crops, pre.with_size(*size))


def _ort(path: Path, threads: int) -> Callable[[np.ndarray], np.ndarray]:
    from vit_export.parity import session

    sess = session(path, threads)
    return lambda x: sess.run(None, {"pixel_values": x})[0]


def _ov(path: Path, threads: int, precision: str | None) -> tuple[Callable[[np.ndarray], np.ndarray], str]:
    """An OpenVINO CPU model (precision None: the plugin's own) and the inference precision it reports."""
    config: dict = {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"}
    if precision:
        config["INFERENCE_PRECISION_HINT"] = precision
    compiled = compile_model(path, config)
    hint = compiled.get_property("INFERENCE_PRECISION_HINT")
    got = hint.to_string() if hasattr(hint, "to_string") else str(hint)
    out = compiled.outputs[0]
    return lambda x: np.asarray(compiled({"pixel_values": x})[out]), got


def _torch(model: torch.nn.Module, compiled: bool, bf16: bool) -> Callable[[np.ndarray], np.ndarray]:
    fn = torch.compile(model, backend="inductor", dynamic=False) if compiled else model

    def run(x: np.ndarray) -> np.ndarray:
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return fn(torch.from_numpy(x)).float().numpy()

    return run


def contenders(model: torch.nn.Module, names: list[str], folder: Path, res: tuple[int, int], calib: np.ndarray,
               threads: int, host: CPU) -> dict[str, tuple[Callable[[np.ndarray], np.ndarray], str]]:
    """{runtime: (run, precision it runs at)} for the runtimes asked for that can run here."""
    from vit_export.onnx_export import export_onnx
    from vit_export.openvino_ir import quantize_ir
    from vit_export.quantize import quantize_int8, quantize_static_int8

    onnx = export_onnx(model, folder / "model.onnx", res=res)
    out: dict[str, tuple[Callable[[np.ndarray], np.ndarray], str]] = {}
    for name in names:
        if name == "eager":
            out[name] = _torch(model, False, False), "fp32"
        elif name.startswith("compiled"):
            bf16 = name.endswith("bf16")
            if bf16 and not host.bf16:
                print(f"({name}: this CPU has no bf16 (avx512_bf16 / amx_bf16): skipped)")
                continue
            out[name] = _torch(model, True, bf16), PRECISION[name]
        elif name == "ort":
            out[name] = _ort(onnx, threads), "fp32"
        elif name == "ort-int8-dynamic":
            out[name] = _ort(quantize_int8(onnx, folder / "dyn.onnx"), threads), "int8"
        elif name == "ort-int8-static":
            out[name] = _ort(quantize_static_int8(onnx, folder / "static.onnx", calib), threads), "int8"
        elif name in ("ov-f32", "ov-bf16"):
            out[name] = _ov(onnx, threads, name[3:])
        elif name == "ov-int8":
            run, got = _ov(quantize_ir(onnx, folder / "int8.xml", calib), threads, None)
            out[name] = run, f"int8 ({got})"
    return out


def timed(runs: dict[str, Callable[[np.ndarray], np.ndarray]], x: np.ndarray, rounds: int, iters: int
          ) -> dict[str, float]:
    """img/s of each run on batch `x`: the median over `rounds` interleaved rounds of `iters` calls (after one
    warm-up call each)."""
    for run in runs.values():
        run(x)
    samples: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for k, run in runs.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                run(x)
            samples[k].append(iters * len(x) / (time.perf_counter() - t0))
    return {k: statistics.median(v) for k, v in samples.items()}


def forward_flops(model: torch.nn.Module, res: tuple[int, int]) -> float:
    """FLOPs of one image's forward (torch's FlopCounterMode: a multiply-add counts 2)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, torch.inference_mode():
        model(torch.zeros(1, 3, *res))
    return float(counter.get_total_flops())


def bench_model(name: str, args: argparse.Namespace, host: CPU, peak: float) -> list[str]:
    """The table's rows of one model: per batch, per runtime."""
    res = (args.res, args.res)
    kwargs = {"depth": 2, "img_size": res} if args.tiny else {"img_size": res}
    model = vit_serve.create_model(name, num_classes=1000, **kwargs).eval()
    pre = model.preprocess_cfg or vit_serve.PreprocessConfig(input_size=res)
    x = photo_crops(args.crops, res, pre).numpy()
    calib = x[: max(1, len(x) // 2)]
    with torch.inference_mode():
        ref = model(torch.from_numpy(x)).numpy()
    flops = forward_flops(model, res)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cpu-runtimes-") as tmp:
        runs = contenders(model, args.runtimes, Path(tmp), res, calib, args.threads, host)
        accuracy = {k: _accuracy(ref, np.concatenate([run(x[i : i + 1]) for i in range(len(x))]), PRECISION[k])
                    for k, (run, _) in runs.items()}
        for batch in args.batches:
            xb = x[np.arange(batch) % len(x)]
            rates = timed({k: run for k, (run, _) in runs.items()}, xb, args.rounds, args.iters)
            base = rates.get("ort") or rates.get("eager") or 1.0
            for k, rate in rates.items():
                gflops = rate * flops / 1e9
                rows.append(f"| {name} | {batch} | {k} | {runs[k][1]} | {rate:.1f} | {rate / args.threads:.2f} | "
                            f"{rate / base:.2f}x | {accuracy[k]} | {gflops:.1f} | {gflops / peak:.0%} |")
    return rows


def _accuracy(ref: np.ndarray, got: np.ndarray, precision: str) -> str:
    """'agreement | mean cosine | ok' of `got` against fp32 eager (fp32 contenders: the same columns, no bound)."""
    agree = float((ref.argmax(-1) == got.argmax(-1)).mean())
    cos = float(cosines(ref, got).mean())
    verdict = "-"
    if precision in BOUNDS:
        lo_agree, lo_cos = BOUNDS[precision]
        verdict = "pass" if agree >= lo_agree and cos >= lo_cos else "FAIL"
    return f"{agree:.1%} | {cos:.5f} | {verdict}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="S/16,B/16")
    p.add_argument("--res", type=int, default=224)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--crops", type=int, default=32)
    p.add_argument("--runtimes", default=",".join(RUNTIMES))
    p.add_argument("--flops-per-cycle", type=int, default=None)
    p.add_argument("--tiny", action="store_true", help="a 2-block Ti/16 at 32x32 on 4 crops (smoke test)")
    args = p.parse_args(argv)
    if args.tiny:
        args.models, args.res, args.crops = "Ti/16", 32, 4
    args.batches = [int(b) for b in args.batches.split(",")]
    args.runtimes = [r.strip() for r in args.runtimes.split(",") if r.strip()]
    unknown = set(args.runtimes) - set(RUNTIMES)
    if unknown:
        p.error(f"unknown runtimes {sorted(unknown)}; known: {', '.join(RUNTIMES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    host = cpu()
    per_cycle = args.flops_per_cycle or host.flops_per_cycle()
    peak = args.threads * host.ghz * per_cycle  # GFLOP/s
    isa = ", ".join(f for f in ISA if f in host.flags) or "none"
    lines = [f"CPU: {host.model}; {host.ghz:.2f} GHz; ISA: {isa}",
             f"threads {args.threads}; fp32 peak {peak:.0f} GFLOP/s ({args.threads} x {host.ghz:.2f} GHz x "
             f"{per_cycle} FLOP/cycle{'' if args.flops_per_cycle else ', estimated from the ISA'}); "
             f"{args.crops} photo crops; medians of {args.rounds} interleaved rounds x {args.iters} calls",
             "| model | batch | runtime | precision | img/s | img/s/core | vs ort fp32 (or eager) | top-1 agr. | "
             "cosine | bounds | GFLOP/s | of peak |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines))
    checks = []
    for name in args.models.split(","):
        for row in bench_model(name.strip(), args, host, peak or 1.0):
            print(row, flush=True)
            lines.append(row)
            cells = [c.strip() for c in row.strip("|").split("|")]
            if cells[9] in ("pass", "FAIL"):  # a reduced precision, judged by vit_serve.accuracy_bounds
                checks.append((f"{cells[0]} batch {cells[1]} {cells[2]} ({cells[3]}): top-1 agreement, cosine",
                               f"{cells[7]}, {cells[8]}", "the precision's bounds", cells[9] == "pass"))
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness.py, a sibling of this script
    from harness import save_results

    data = {"cpu": host.model, "ghz": host.ghz, "isa": isa, "threads": args.threads, "peak_gflops": peak}
    return save_results("cpu_runtimes", lines, checks, data, args, script="cpu_runtimes.py")


if __name__ == "__main__":
    sys.exit(main())
