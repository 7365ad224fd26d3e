"""Exported ONNX vs PyTorch eager, both int8 schemes vs fp32, export wall time, and the torch backend's eager vs
`--compile` vs onnxruntime, side by side in one run.

    python benchmarks/export_onnx.py [--model S/16] [--res 224] [--threads 2] [--rounds 7]
        [--digits-ckpt runs/digits/model.safetensors] [--export-model B/16] [--export-res 384]
        [--only speed,digits,export,torch | --skip ...]

The CPU's int8 instructions decide which int8 scheme wins, so the first line names the CPU and its AVX2 /
AVX-512 / VNNI / AMX flags: report the tables with it.
1. The same ViT-S/16 (random weights) at 224 exported by `vit_export.onnx_export.export_onnx`: PyTorch eager
   (fp32, no_grad, `--threads` intra-op threads) vs onnxruntime (CPU, the same threads), batch 1 and 8;
   int8 dynamic (per-channel weights) and int8 static (QDQ, calibrated on 16 N(0, 1) inputs: speed only) vs fp32
   onnxruntime. Medians over interleaved rounds.
   Targets (export issue): onnxruntime >= 1.15x PyTorch at batch 1 and not slower at batch 8; int8 >= 1.5x fp32.
2. Both int8 schemes vs fp32 on the digits test set (359 scans): size, ms/img, top-1 agreement (target >= 99%)
   and accuracy, with a trained digits checkpoint (`--digits-ckpt`; trained first with `vit-serve train`'s
   defaults if missing, ~3 min); static int8 is calibrated on 256 training scans (never the test scans).
3. Export wall time of `--export-model` at `--export-res` from a 224 checkpoint with non-trivial weights (a
   zero-initialised head would make every logit 0 and the parity check vacuous; the script checks the logits
   vary): the logits graph, the explain graph, and the parity check against PyTorch.
4. The torch backend (`--only torch` runs it alone): the same ViT-S/16 at 224, batch 1 and 8, PyTorch eager vs
   `torch.compile` (inductor, as `vit-serve serve --compile` compiles it: `compile_forward`'s batch-1 and
   dynamic-batch graphs, checked against eager) vs onnxruntime fp32 (the `vit-export` graph), all in inference
   mode on `--threads` threads, medians over interleaved rounds; the compile's wall time with inductor's cache
   cold (a fresh TORCHINDUCTOR_CACHE_DIR) and warm (after `torch._dynamo.reset()`: a restart's cost), each
   contender's max |logits - eager's|, and what the load-time runtime choice
   (`vit_serve.runtime.torch_forwards.choose_forward`, batch 1 and 8) measures and costs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from vit_export.onnx_export import export_onnx
from vit_export.parity import check_parity, session
from vit_export.quantize import compare_schemes, quantize_int8, quantize_static_int8

import vit_serve


def cpu_info() -> str:
    """'Intel(R) Xeon(R) ...; 2 cores; avx2, avx512f, avx512_vnni' from /proc/cpuinfo (Linux), else the platform."""
    import os
    import platform

    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")
    have = [f for f in wanted if f in flags]
    return f"{model}; {os.cpu_count()} cores; {', '.join(have) or 'no AVX2'}" + (
        "" if {"avx512_vnni", "avx_vnni"} & flags else " (no VNNI)"
    )


def images_per_s(fn, x, iters: int) -> float:
    """Images per second of `fn(x)` over `iters` calls (one warm-up call before)."""
    fn(x)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(x)
    return iters * len(x) / (time.perf_counter() - t0)


def speed_table(model_name: str, res: int, threads: int, rounds: int, work: Path) -> list[str]:
    torch.set_num_threads(threads)
    model = nontrivial_weights(vit_serve.create_model(model_name, img_size=res)).eval()
    fp32 = export_onnx(model, work / "model.onnx", res=(res, res))
    int8 = quantize_int8(fp32, work / "model_int8.onnx")
    calib = np.random.default_rng(1).standard_normal((16, 3, res, res)).astype(np.float32)
    static = quantize_static_int8(fp32, work / "model_int8_static.onnx", calib)
    run = lambda s: lambda x: s.run(None, {"pixel_values": x})  # noqa: E731
    runs = {
        "PyTorch eager": lambda x: model(torch.from_numpy(x)),
        "onnxruntime fp32": run(session(fp32, threads)),
        "onnxruntime int8 dynamic": run(session(int8, threads)),
        "onnxruntime int8 static (QDQ)": run(session(static, threads)),
    }
    rows = []
    for batch, iters in ((1, 8), (8, 2)):
        x = np.random.default_rng(0).standard_normal((batch, 3, res, res)).astype(np.float32)
        speeds: dict[str, list[float]] = {k: [] for k in runs}
        with torch.no_grad():
            for _ in range(rounds):  # interleaved: a noisy neighbour slows every contender alike
                for name, fn in runs.items():
                    speeds[name].append(images_per_s(fn, x, iters))
        med = {k: statistics.median(v) for k, v in speeds.items()}
        base, ort32 = med["PyTorch eager"], med["onnxruntime fp32"]
        for name, v in med.items():
            vs_torch = f"{v / base:.2f}x"
            vs_fp32 = f"{v / ort32:.2f}x" if name != "PyTorch eager" else "-"
            rows.append(f"| {model_name} {res} | {batch} | {name} | {v:.1f} | {vs_torch} | {vs_fp32} |")
    sizes = (f"fp32 {fp32.stat().st_size / 1e6:.1f} MB, int8 dynamic {int8.stat().st_size / 1e6:.1f} MB, "
             f"int8 static {static.stat().st_size / 1e6:.1f} MB")
    return [
        f"\nSpeed ({threads} threads, median of {rounds} interleaved rounds; {sizes})\n",
        "| model | batch | runtime | images/s | vs PyTorch | vs onnxruntime fp32 |",
        "|---|---|---|---|---|---|",
        *rows,
    ]


def digits_table(ckpt: Path, threads: int, work: Path) -> list[str]:
    from vit_serve.data import digits_tensors

    if not ckpt.exists():
        from vit_serve.train.config import TrainConfig
        from vit_serve.train.loop import train

        print(f"{ckpt} not found: training the digits default first (~3 min) ...", flush=True)
        train(TrainConfig(out=str(ckpt.parent), progress=False, log_every=500))
    model = vit_serve.load(ckpt)
    fp32 = export_onnx(model, work / "digits.onnx")
    x, y = digits_tensors("test", model.preprocess_cfg)
    xt, _ = digits_tensors("train", model.preprocess_cfg)
    calib = xt[np.linspace(0, len(xt) - 1, 256).astype(int)].numpy()
    int8 = {
        "dynamic": quantize_int8(fp32, work / "digits_int8.onnx"),
        "static": quantize_static_int8(fp32, work / "digits_int8_static.onnx", calib),
    }
    rep = compare_schemes(fp32, int8, x.numpy(), y.numpy(), threads=threads)
    base = rep.rows[0].ms
    rows = [
        f"| onnxruntime {r.graph} | {r.mb:.2f} | {r.ms:.3f} | {base / r.ms:.2f}x | {100 * r.accuracy:.2f}% | "
        + ("-" if r.graph == "fp32" else f"{100 * r.agreement:.2f}%") + " |"
        for r in rep.rows
    ]
    return [
        f"\nint8 on the digits test set ({len(y)} scans, {ckpt}; static calibrated on 256 training scans; "
        f"batch 1, {threads} threads)\n",
        "| graph | size MB | ms/img | vs fp32 | top-1 | agreement with fp32 |",
        "|---|---|---|---|---|---|",
        *rows,
    ]


@torch.no_grad()
def nontrivial_weights(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """`create_model` zero-initialises the head (paper §3.2), so every logit would be 0. A seeded N(0, 0.02)
    [class] token and head (logits of O(1) from the final LayerNorm's unit-scale features) fix that."""
    g = torch.Generator().manual_seed(seed)
    model.head.weight.copy_(torch.randn(model.head.weight.shape, generator=g) * 0.1)
    model.head.bias.copy_(torch.randn(model.head.bias.shape, generator=g) * 0.1)
    if model.cls_token is not None:
        model.cls_token.copy_(torch.randn(model.cls_token.shape, generator=g) * 0.02)
    return model


def check_nontrivial(model: torch.nn.Module, res: int) -> float:
    """The spread of the logits over classes and inputs; SystemExit if they are (nearly) constant."""
    x = torch.randn(2, 3, res, res, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(x)
    spread = float(logits.std())
    if not spread > 0.1 or logits[0].argmax() == logits[0].argmin():
        raise SystemExit(f"export benchmark: logits are near-constant (std {spread:.2e}): the parity check "
                         "would measure nothing")
    return spread


def export_time_table(model_name: str, res: int, threads: int, work: Path) -> list[str]:
    torch.set_num_threads(threads)
    model = nontrivial_weights(vit_serve.create_model(model_name, img_size=224)).eval()
    spread = check_nontrivial(model, 224)
    rows = []
    for explain in (False, True):
        t0 = time.perf_counter()
        path = export_onnx(model, work / f"export_{explain}.onnx", res=(res, res), explain=explain)
        t_export = time.perf_counter() - t0
        t0 = time.perf_counter()
        report = check_parity(model, path, None)
        t_parity = time.perf_counter() - t0
        worst = max(r.max_abs for r in report.rows)
        rows.append(f"| {model_name} 224 -> {res} | {'explain' if explain else 'logits'} | {t_export:.1f} | "
                    f"{t_parity:.1f} | {path.stat().st_size / 1e6:.0f} MB | {worst:.1e} | "
                    f"{'ok' if report.ok else 'FAILED'} |")
    return [
        f"\nExport wall time ({threads} threads; logits std {spread:.2f} at 224)\n",
        "| model | graph | export s | parity check s | size | max abs logit diff | parity |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]


def torch_table(model_name: str, res: int, threads: int, rounds: int, work: Path) -> list[str]:
    from vit_serve.runtime.backends.torch import compile_forward
    from vit_serve.runtime.torch_forwards import choose_forward

    torch.set_num_threads(threads)
    model = nontrivial_weights(vit_serve.create_model(model_name, img_size=res)).eval()
    check_nontrivial(model, res)
    fp32 = export_onnx(model, work / "torch_section.onnx", res=(res, res))
    ort = session(fp32, threads)
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor-cache")  # cold: nothing compiled before
    try:
        t0 = time.perf_counter()
        compile_forward(model, (res, res), torch.device("cpu"), model_name)
        cold = time.perf_counter() - t0
        torch._dynamo.reset()  # the in-process graphs gone, inductor's on-disk cache kept: a restart
        t0 = time.perf_counter()
        compiled = compile_forward(model, (res, res), torch.device("cpu"), model_name)
        warm = time.perf_counter() - t0
    finally:
        if previous is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
    runs = {
        "PyTorch eager": lambda x: model(torch.from_numpy(x)).numpy(),
        "torch.compile (inductor)": lambda x: compiled(torch.from_numpy(x))[0].numpy(),
        "onnxruntime fp32": lambda x: ort.run(None, {"pixel_values": x})[0],
    }
    rows = []
    with torch.inference_mode():  # the mode the backend compiles and serves in (dynamo guards on it)
        for batch, iters in ((1, 8), (8, 2)):
            x = np.random.default_rng(0).standard_normal((batch, 3, res, res)).astype(np.float32)
            want = runs["PyTorch eager"](x)
            delta = {k: float(np.abs(fn(x) - want).max()) for k, fn in runs.items()}
            speeds: dict[str, list[float]] = {k: [] for k in runs}
            for _ in range(rounds):  # interleaved: a noisy neighbour slows every contender alike
                for name, fn in runs.items():
                    speeds[name].append(images_per_s(fn, x, iters))
            med = {k: statistics.median(v) for k, v in speeds.items()}
            base = med["PyTorch eager"]
            for name, v in med.items():
                d = "-" if name == "PyTorch eager" else f"{delta[name]:.1e}"
                rows.append(f"| {model_name} {res} | {batch} | {name} | {v:.1f} | {v / base:.2f}x | {d} |")
        _, choice = choose_forward(model, (res, res), max_batch=8)
    return [
        f"\nThe torch backend ({threads} threads, median of {rounds} interleaved rounds, inference mode; "
        f"logits std {float(np.std(want)):.2f})\n",
        "| model | batch | runtime | images/s | vs eager | max abs logit diff vs eager |",
        "|---|---|---|---|---|---|",
        *rows,
        f"\ntorch.compile wall time (batch-1 and dynamic-batch graphs, parity-checked): {cold:.1f} s with "
        f"inductor's cache cold, {warm:.1f} s warm (a restart)",
        f"load-time runtime choice (in-memory TorchScript export): {choice.describe()}",
    ]


def speed_checks(tables: list) -> list:
    """The speed section's targets against its table: onnxruntime fp32 >= 1.15x PyTorch at batch 1 and not slower
    at batch 8, int8 (the faster of the two schemes) >= 1.5x fp32."""
    from results_file import Check

    speed = next((t for t in tables if t.columns[:3] == ["model", "batch", "runtime"]), None)
    if speed is None:
        return []
    ratio = {(r[1], r[2]): (float(str(r[4]).rstrip("x")), str(r[5]).rstrip("x")) for r in speed.rows}
    checks = []
    for batch, bound in ((1, 1.15), (8, 1.0)):
        v = ratio[batch, "onnxruntime fp32"][0]
        checks.append(Check(f"onnxruntime fp32 / PyTorch, batch {batch}", f"{v:.2f}", f">= {bound}", v >= bound))
        scheme, v = max(((s, float(ratio[batch, f"onnxruntime int8 {s}"][1])) for s in ("dynamic", "static (QDQ)")),
                        key=lambda sv: sv[1])  # the CPU's int8 instructions decide which scheme wins
        checks.append(Check(f"int8 (the faster scheme: {scheme}) / fp32 onnxruntime, batch {batch}", f"{v:.2f}",
                            ">= 1.5", v >= 1.5))
    return checks


def run(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="S/16")
    ap.add_argument("--res", type=int, default=224)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--digits-ckpt", type=Path, default=Path("runs/digits/model.safetensors"))
    ap.add_argument("--export-model", default="B/16")
    ap.add_argument("--export-res", type=int, default=384)
    ap.add_argument("--skip", default="", help="comma list of sections to skip: speed,digits,export,torch")
    ap.add_argument("--only", default="", help="comma list of the sections to run (default: all)")
    args = ap.parse_args(argv)
    sections = {"speed", "digits", "export", "torch"}
    only = set(filter(None, args.only.split(","))) or sections
    if only - sections:
        ap.error(f"--only: unknown sections {sorted(only - sections)} (choose from {sorted(sections)})")
    skip = set(args.skip.split(",")) | (sections - only)
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        work = Path(tmp)
        lines: list[str] = [f"CPU: {cpu_info()}"]
        if "speed" not in skip:
            lines += speed_table(args.model, args.res, args.threads, args.rounds, work)
        if "digits" not in skip:
            lines += digits_table(args.digits_ckpt, args.threads, work)
        if "export" not in skip:
            lines += export_time_table(args.export_model, args.export_res, args.threads, work)
        if "torch" not in skip:
            lines += torch_table(args.model, args.res, args.threads, args.rounds, work)
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    """`run`, its tables (and checks) saved as benchmarks/results/export_onnx.json."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, a sibling, also when loaded by path
    from results_file import record_printed

    return record_printed("export_onnx", run, argv, speed_checks)


if __name__ == "__main__":
    sys.exit(main())
