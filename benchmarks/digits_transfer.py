"""Resolution transfer at full size (paper §3.2), on the embedded digits set, in one run.

    python benchmarks/digits_transfer.py [--out runs/bench_digits] [--pretrain-steps 2000] [--finetune-steps 300]

1. pre-train the digits default (a 4-layer, width-96 ViT at 16x16, patch 2) from scratch;
2. at 32x32, before any step: accuracy with resampled position embeddings vs freshly initialised ones;
3. fine-tune at 32x32 (SGD momentum 0.9, cosine, vit_jax's recipe) and evaluate.
Prints one table. Targets (issue): pre-train >= 97%, resampled >= fresh + 20 points, fine-tuned >= 97%.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

import vit_serve
from vit_serve.train.config import TrainConfig
from vit_serve.train.eval_checkpoint import run_eval
from vit_serve.train.loop import train


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/bench_digits")
    ap.add_argument("--pretrain-steps", type=int, default=2000)
    ap.add_argument("--finetune-steps", type=int, default=300)
    args = ap.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)

    pre = train(TrainConfig(out=str(out / "pretrain16"), steps=args.pretrain_steps, progress=False, log_every=100))
    ckpt = out / "pretrain16" / "model.safetensors"
    t0 = time.perf_counter()
    resampled = run_eval(str(ckpt), res=(32, 32))["top1"]
    model = vit_serve.load(ckpt)
    model.set_resolution(32, 32)
    torch.manual_seed(0)
    model.reset_pos_embed()
    fresh = run_eval(str(vit_serve.save(model, out / "fresh32.safetensors")))["top1"]
    eval_s = time.perf_counter() - t0
    ft = train(TrainConfig(mode="finetune", init=str(ckpt), res=(32, 32), out=str(out / "finetune32"),
                           steps=args.finetune_steps, progress=False, log_every=100))

    print(f"\nDigits, resolution transfer 16x16 -> 32x32 (CPU x{torch.get_num_threads()} threads, "
          f"torch {torch.__version__})\n")
    print("| stage | steps | wall time s | held-out top-1 |")
    print("|---|---:|---:|---:|")
    print(f"| pre-train at 16x16 from scratch | {args.pretrain_steps} | {pre['wall_s']:.0f} | "
          f"{100 * pre['top1']:.2f}% |")
    print(f"| at 32x32, resampled position embeddings, no step | 0 | {eval_s:.0f} (both evals) | "
          f"{100 * resampled:.2f}% |")
    print(f"| at 32x32, fresh position embeddings (control), no step | 0 | | {100 * fresh:.2f}% |")
    print(f"| fine-tune at 32x32 | {args.finetune_steps} | {ft['wall_s']:.0f} | {100 * ft['top1']:.2f}% |")


if __name__ == "__main__":
    main()
