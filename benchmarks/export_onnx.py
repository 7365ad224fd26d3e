"""Exported ONNX vs PyTorch eager, int8 vs fp32, and export wall time, side by side in one run.

    python benchmarks/export_onnx.py [--model S/16] [--res 224] [--threads 2] [--rounds 7]
        [--digits-ckpt runs/digits/model.safetensors] [--export-model B/16] [--export-res 384]

1. The same ViT-S/16 (random weights) at 224 exported by `vit_export.onnx_export.export_onnx`: PyTorch eager
   (fp32, no_grad, `--threads` intra-op threads) vs onnxruntime (CPU, the same threads), batch 1 and 8;
   int8 (`vit_export.quantize`, dynamic per-channel) vs fp32 onnxruntime. Medians over interleaved rounds.
   Targets (export issue): onnxruntime >= 1.15x PyTorch at batch 1 and not slower at batch 8; int8 >= 1.5x fp32.
2. int8 vs fp32 top-1 agreement (target >= 99%) and accuracy on the digits test set (359 scans), with a trained
   digits checkpoint (`--digits-ckpt`; trained first with `vit-serve train`'s defaults if missing, ~3 min).
3. Export wall time of `--export-model` at `--export-res` from a 224 checkpoint: the logits graph, the explain
   graph, and the parity check against PyTorch.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from vit_export.onnx_export import export_onnx
from vit_export.parity import check_parity, session
from vit_export.quantize import quantize_int8

import vit_serve


def _timed(fn, x, iters: int) -> float:
    """Images per second of `fn(x)` over `iters` calls (one warm-up call before)."""
    fn(x)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(x)
    return iters * len(x) / (time.perf_counter() - t0)


def speed_table(model_name: str, res: int, threads: int, rounds: int, work: Path) -> list[str]:
    torch.set_num_threads(threads)
    model = vit_serve.create_model(model_name, img_size=res).eval()
    fp32 = export_onnx(model, work / "model.onnx", res=(res, res))
    int8 = quantize_int8(fp32, work / "model_int8.onnx")
    runs = {
        "PyTorch eager": lambda x: model(torch.from_numpy(x)),
        "onnxruntime fp32": (lambda s: lambda x: s.run(None, {"pixel_values": x}))(session(fp32, threads)),
        "onnxruntime int8": (lambda s: lambda x: s.run(None, {"pixel_values": x}))(session(int8, threads)),
    }
    rows = []
    for batch, iters in ((1, 8), (8, 2)):
        x = np.random.default_rng(0).standard_normal((batch, 3, res, res)).astype(np.float32)
        speeds: dict[str, list[float]] = {k: [] for k in runs}
        with torch.no_grad():
            for _ in range(rounds):  # interleaved: a noisy neighbour slows every contender alike
                for name, fn in runs.items():
                    speeds[name].append(_timed(fn, x, iters))
        med = {k: statistics.median(v) for k, v in speeds.items()}
        base, ort32 = med["PyTorch eager"], med["onnxruntime fp32"]
        for name, v in med.items():
            vs_torch = f"{v / base:.2f}x"
            vs_fp32 = f"{v / ort32:.2f}x" if name != "PyTorch eager" else "-"
            rows.append(f"| {model_name} {res} | {batch} | {name} | {v:.1f} | {vs_torch} | {vs_fp32} |")
    sizes = f"fp32 {fp32.stat().st_size / 1e6:.1f} MB, int8 {int8.stat().st_size / 1e6:.1f} MB"
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
    int8 = quantize_int8(fp32, work / "digits_int8.onnx")
    x, y = digits_tensors("test", model.preprocess_cfg)
    x, y = x.numpy(), y.numpy()
    a = session(fp32, threads).run(None, {"pixel_values": x})[0].argmax(1)
    b = session(int8, threads).run(None, {"pixel_values": x})[0].argmax(1)
    return [
        f"\nint8 on the digits test set ({len(y)} scans, {ckpt})\n",
        "| graph | top-1 | agreement with fp32 |",
        "|---|---|---|",
        f"| onnxruntime fp32 | {100 * (a == y).mean():.2f}% | - |",
        f"| onnxruntime int8 | {100 * (b == y).mean():.2f}% | {100 * (a == b).mean():.2f}% |",
    ]


def export_time_table(model_name: str, res: int, threads: int, work: Path) -> list[str]:
    torch.set_num_threads(threads)
    model = vit_serve.create_model(model_name, img_size=224).eval()
    rows = []
    for explain in (False, True):
        t0 = time.perf_counter()
        path = export_onnx(model, work / f"export_{explain}.onnx", res=(res, res), explain=explain)
        t_export = time.perf_counter() - t0
        t0 = time.perf_counter()
        report = check_parity(model, path, None)
        t_parity = time.perf_counter() - t0
        rows.append(f"| {model_name} 224 -> {res} | {'explain' if explain else 'logits'} | {t_export:.1f} | "
                    f"{t_parity:.1f} | {path.stat().st_size / 1e6:.0f} MB | {'ok' if report.ok else 'FAILED'} |")
    return [
        f"\nExport wall time ({threads} threads)\n",
        "| model | graph | export s | parity check s | size | parity |",
        "|---|---|---|---|---|---|",
        *rows,
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="S/16")
    ap.add_argument("--res", type=int, default=224)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--digits-ckpt", type=Path, default=Path("runs/digits/model.safetensors"))
    ap.add_argument("--export-model", default="B/16")
    ap.add_argument("--export-res", type=int, default=384)
    ap.add_argument("--skip", default="", help="comma list of sections to skip: speed,digits,export")
    args = ap.parse_args()
    skip = set(args.skip.split(","))
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        work = Path(tmp)
        lines: list[str] = []
        if "speed" not in skip:
            lines += speed_table(args.model, args.res, args.threads, args.rounds, work)
        if "digits" not in skip:
            lines += digits_table(args.digits_ckpt, args.threads, work)
        if "export" not in skip:
            lines += export_time_table(args.export_model, args.export_res, args.threads, work)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
