"""FlexiViT patch resizing (Beyer et al., CVPR 2023) on the quickstart's digits model, in one run.

    python benchmarks/patch_resize.py [--out runs/bench_transfer] [--seed 0]
    python benchmarks/patch_resize.py --tiny          # CI's smoke run

The source is the quickstart's model at 32x32 with 4x4 patches (64 tokens; pre-trained at 16x16 and fine-tuned,
`benchmarks/digits_transfer.py` builds both and they are reused from --out). Each row resizes its patch embedding
by the pseudo-inverse and resamples the position embeddings once (`VisionTransformer.set_patch_size(P, res)`,
what `vit-serve convert --patch-size P --res R` and `vit-export --patch-size P --res R` do): patch 2 and 8 at
32x32 (4x and 1/4 the tokens), and the resolutions that keep the 64 tokens (patch 2 at 16x16, patch 8 at 64x64).
Held-out top-1 as resized and after a short fine-tune there; images/s of the PyTorch model (batch 64, median of
interleaved rounds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import digits_transfer

import vit_serve
from vit_serve.train.eval_checkpoint import run_eval

# (patch, resolution): the source's and each resize.
ROWS: tuple[tuple[int, tuple[int, int]], ...] = ((4, (32, 32)), (2, (32, 32)), (8, (32, 32)), (2, (16, 16)),
                                                  (8, (64, 64)))


def images_per_s(model: torch.nn.Module, res: tuple[int, int], batch: int, iters: int) -> float:
    x = torch.randn(batch, 3, *res)
    with torch.inference_mode():
        model(x)
        t0 = time.perf_counter()
        for _ in range(iters):
            model(x)
    return batch * iters / (time.perf_counter() - t0)


def run(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/bench_transfer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--finetune-steps", type=int, default=30, help="the short fine-tune after resizing")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="a few steps (CI's smoke run)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    sizes = digits_transfer.Sizes(pretrain=4, full=2) if args.tiny else digits_transfer.Sizes()
    steps, rounds, iters = (1, 1, 1) if args.tiny else (args.finetune_steps, args.rounds, 5)

    src16, _ = digits_transfer.pretrained(out, args.seed, sizes.pretrain)
    folder = out / f"source32_seed{args.seed}_{sizes.pretrain}_{sizes.full}"
    source = folder / "model.safetensors"
    if not source.exists():
        digits_transfer.finetune(src16, (32, 32), sizes.full, args.seed, folder)
    models, top1, tuned = {}, {}, {}
    for patch, res in ROWS:
        model = vit_serve.load(source)
        model.set_patch_size(patch, res)
        path = vit_serve.save(model, out / f"resized_seed{args.seed}_p{patch}_{res[0]}x{res[1]}.safetensors",
                              overwrite=True)
        models[(patch, res)] = model.eval()
        top1[(patch, res)] = run_eval(str(path)).top1
        if (patch, res) != ROWS[0]:
            run = out / "ft" / f"patch{patch}_{res[0]}x{res[1]}_seed{args.seed}"
            tuned[(patch, res)] = digits_transfer.finetune(path, res, steps, args.seed, run)["top1"]
    rates: dict[tuple[int, tuple[int, int]], list[float]] = {k: [] for k in models}
    for _ in range(rounds):  # interleaved: a busy moment of the machine lands on every row alike
        for key, model in models.items():
            rates[key].append(images_per_s(model, key[1], 64, iters))

    base = statistics.median(rates[ROWS[0]])
    print(f"\nFlexiViT patch resizing of the quickstart's 32x32 model (4x4 patches, seed {args.seed}; CPU "
          f"x{torch.get_num_threads()} threads, batch 64, median of {rounds} rounds)\n")
    print("| patch | resolution | tokens | held-out top-1, resized | after a fine-tune of "
          f"{steps} steps | images/s | vs source |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for patch, res in ROWS:
        key = (patch, res)
        rate = statistics.median(rates[key])
        after = "(source)" if key == ROWS[0] else f"{100 * tuned[key]:.2f}%"
        print(f"| {patch} | {res[0]}x{res[1]} | {(res[0] // patch) * (res[1] // patch)} | {100 * top1[key]:.2f}% | "
              f"{after} | {rate:.0f} | {rate / base:.2f}x |")


def main(argv: list[str] | None = None) -> int:
    """`run`, its tables (and checks) saved as benchmarks/results/patch_resize.json."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, a sibling, also when loaded by path
    from results_file import record_printed

    return record_printed("patch_resize", run, argv)


if __name__ == "__main__":
    sys.exit(main())
