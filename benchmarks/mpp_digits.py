"""Masked patch prediction (paper §4.6) on the digits set: does MPP pre-training help a fixed fine-tune budget?

    python benchmarks/mpp_digits.py [--mpp-steps 1000] [--steps 300] [--out runs/bench_mpp]

Pre-trains the digits default with --objective mpp (no labels), then fine-tunes it for --steps; trains the
same model from scratch for the same --steps; prints one table (MPP loss start/end, accuracies).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

from vit_serve.train.config import TrainConfig
from vit_serve.train.loop import train
from vit_serve.train.progress import read_metrics


def run(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/bench_mpp")
    ap.add_argument("--mpp-steps", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args(argv)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)

    mpp = train(TrainConfig(objective="mpp", out=str(out / "mpp"), steps=args.mpp_steps, progress=False,
                            log_every=50, dropout=0.0, label_smoothing=0.0))
    losses = [r["loss"] for r in read_metrics(out / "mpp" / "metrics.jsonl") if "loss" in r]
    # The same optimiser (Adam), schedule and step budget for both; only the starting weights differ.
    common = dict(steps=args.steps, progress=False, log_every=50, optimizer="adam", lr=3e-3, weight_decay=0.1,
                  label_smoothing=0.1, dropout=0.1)
    ft = train(TrainConfig(mode="finetune", init=str(out / "mpp" / "model.safetensors"), out=str(out / "ft"),
                           **common))
    scratch = train(TrainConfig(out=str(out / "scratch"), **common))

    print(f"\nMasked patch prediction on digits 16x16 (CPU x{torch.get_num_threads()} threads)\n")
    print("| run | steps | wall time s | held-out top-1 |")
    print("|---|---:|---:|---:|")
    print(f"| MPP pre-training (loss at step 50 {losses[0]:.3f} -> {losses[-1]:.3f}) | {args.mpp_steps} | "
          f"{mpp['wall_s']:.0f} | - |")
    print(f"| fine-tune from MPP | {args.steps} | {ft['wall_s']:.0f} | {100 * ft['top1']:.2f}% |")
    print(f"| from scratch | {args.steps} | {scratch['wall_s']:.0f} | {100 * scratch['top1']:.2f}% |")


def main(argv: list[str] | None = None) -> int:
    """`run`, its tables (and checks) saved as benchmarks/results/mpp_digits.json."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, a sibling, also when loaded by path
    from results_file import record_printed

    return record_printed("mpp_digits", run, argv)


if __name__ == "__main__":
    sys.exit(main())
