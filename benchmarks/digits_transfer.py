"""Resolution transfer (paper §3.2) on the quickstart's digits model, every resampling mode side by side, in one run.

    python benchmarks/digits_transfer.py [--part modes,recipes] [--seeds 0,1,2] [--out runs/bench_transfer]
    python benchmarks/digits_transfer.py --tiny          # CI's smoke run: a few steps, one seed

The source: the quickstart's model (`vit_serve.quickstart`: 4x4 patches, pre-trained from scratch at 16x16 for
1000 steps), one per seed, trained once and reused from --out.

modes: each position-embedding resample mode we carry (`vit_serve.pos_embed`: jax, timm, hf, torchvision,
dinov2, open_clip) x each transfer (2x: 32x32, 4x: 64x64, 2x1: 32x16, a non-square grid), held-out top-1
before any step and after a short and a full fine-tune (the quickstart's recipe), mean and range over the seeds.

default: the digits default (`vit-serve train --data digits`: 2x2 patches, 64 tokens at 16x16) at full size, 16x16
-> 32x32: resampled against fresh position embeddings before any step (the control), then `--mode finetune` with
the paper's clipping at 1 and without (the digits recipe's, `DIGITS_RECIPE`).

recipes: the quickstart's 2x fine-tune (150 steps) under the paper's fine-tuning choices and timm's and
big_vision's (layer-wise lr decay, an EMA of the weights), against the source's own held-out top-1, per seed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import vit_serve
from vit_serve.config import RESAMPLE_MODES
from vit_serve.quickstart import FINETUNE_ARGS, FINETUNE_STEPS, PRETRAIN_ARGS, PRETRAIN_STEPS
from vit_serve.train.config import TrainConfig
from vit_serve.train.eval_checkpoint import run_eval
from vit_serve.train.loop import train

TRANSFERS: dict[str, tuple[int, int]] = {"2x": (32, 32), "4x": (64, 64), "2x1": (32, 16)}
# Fine-tuning recipes on top of the quickstart's (FINETUNE_ARGS: SGD momentum 0.9, no weight decay, cosine,
# lr 0.01, 10 warm-up steps, no clipping). The rest clip at global norm 1 as the paper does, and each changes one
# more of its choices, or adds timm's / big_vision's (layer-wise decay, an EMA of the weights).
CLIP = dict(grad_clip=1.0)
RECIPES: dict[str, dict[str, Any]] = {
    "clip 1 (the paper's), lr 0.01, warm-up 10": CLIP,
    "clip 1, lr 0.003": dict(CLIP, lr=0.003),
    "clip 1, lr 0.03": dict(CLIP, lr=0.03),
    "clip 1, warm-up 30": dict(CLIP, warmup_steps=30),
    "clip 1, layer decay 0.75": dict(CLIP, layer_decay=0.75),
    "clip 1, EMA 0.99": dict(CLIP, ema_decay=0.99),
    "clip 1, EMA 0.99, lr 0.03": dict(CLIP, ema_decay=0.99, lr=0.03),
    "no clipping (the quickstart's)": {},
}


@dataclass
class Sizes:
    pretrain: int = PRETRAIN_STEPS
    short: int = 20
    full: int = FINETUNE_STEPS
    seeds: tuple[int, ...] = (0, 1, 2)


@dataclass
class Cell:
    values: list[float] = field(default_factory=list)

    def __str__(self) -> str:
        if not self.values:
            return "-"
        v = [100 * x for x in self.values]
        mean = statistics.fmean(v)
        return f"{mean:.2f}" if len(v) == 1 else f"{mean:.2f} ({min(v):.2f}-{max(v):.2f})"


def pretrained(out: Path, seed: int, steps: int) -> tuple[Path, float]:
    """The quickstart's source model for `seed` (trained once, reused) and its held-out top-1 at 16x16."""
    folder = out / f"pretrain16_seed{seed}_{steps}"
    ckpt = folder / "model.safetensors"
    if not ckpt.exists():
        train(TrainConfig(out=str(folder), steps=steps, seed=seed, progress=False, reference=False,
                          **PRETRAIN_ARGS))
    return ckpt, run_eval(str(ckpt)).top1


def with_mode(ckpt: Path, mode: str, out: Path) -> Path:
    """The source checkpoint with its resample mode set (what `vit-serve convert --resample-mode` writes)."""
    path = out / f"{ckpt.parent.name}_{mode}.safetensors"
    if not path.exists():
        model = vit_serve.load(ckpt)
        model.cfg = model.cfg.replace(resample_mode=mode)
        vit_serve.save(model, path)
    return path


def finetune(init: Path, res: tuple[int, int], steps: int, seed: int, out: Path, **overrides: Any) -> dict:
    args = {**FINETUNE_ARGS, "log_every": max(steps, 1), **overrides}
    args["warmup_steps"] = min(args.get("warmup_steps", 10), max(steps // 2, 1))
    return train(TrainConfig(mode="finetune", init=str(init), res=res, out=str(out), steps=steps, seed=seed,
                             progress=False, reference=False, **args))


def modes_table(out: Path, sizes: Sizes, modes: tuple[str, ...], transfers: tuple[str, ...]) -> None:
    sources = [pretrained(out, s, sizes.pretrain) for s in sizes.seeds]
    source = Cell([top1 for _, top1 in sources])
    rows: dict[tuple[str, str], dict[str, Cell]] = {}
    t0 = time.perf_counter()
    for mode in modes:
        for name in transfers:
            res = TRANSFERS[name]
            row = rows[(mode, name)] = {"none": Cell(), "short": Cell(), "full": Cell()}
            for seed, (ckpt, _) in zip(sizes.seeds, sources, strict=True):
                init = with_mode(ckpt, mode, out)
                row["none"].values.append(run_eval(str(init), res=res).top1)
                for stage, steps in (("short", sizes.short), ("full", sizes.full)):
                    run = out / "ft" / f"{mode}_{name}_{stage}_seed{seed}"
                    row[stage].values.append(finetune(init, res, steps, seed, run)["top1"])
    wall = time.perf_counter() - t0
    print(f"\nResolution transfer of the quickstart's model (16x16, 4x4 patches, {sizes.pretrain} steps; held-out "
          f"top-1 {source}%), seeds {','.join(map(str, sizes.seeds))}: mean (min-max) held-out top-1 %, "
          f"fine-tunes of {sizes.short} and {sizes.full} steps (CPU x{torch.get_num_threads()}, {wall:.0f} s)\n")
    print("| mode | transfer | no step | short fine-tune | full fine-tune |")
    print("|---|---|---:|---:|---:|")
    for (mode, name), row in rows.items():
        res = TRANSFERS[name]
        print(f"| {mode} | {name} ({res[0]}x{res[1]}) | {row['none']} | {row['short']} | {row['full']} |")


def recipes_table(out: Path, sizes: Sizes, recipes: tuple[str, ...]) -> None:
    sources = [pretrained(out, s, sizes.pretrain) for s in sizes.seeds]
    print(f"\nThe quickstart's fine-tune at 2x (16x16 -> 32x32, {sizes.full} steps) by recipe, seeds "
          f"{','.join(map(str, sizes.seeds))}; source = the 16x16 model's held-out top-1 "
          f"({Cell([t for _, t in sources])}%)\n")
    print("| recipe | held-out top-1 % | vs source (mean) | seeds >= source | wall s / run |")
    print("|---|---:|---:|---:|---:|")
    for name in recipes:
        tops, deltas, walls = [], [], []
        for seed, (ckpt, src) in zip(sizes.seeds, sources, strict=True):
            slug = "".join(c if c.isalnum() else "_" for c in name)
            r = finetune(ckpt, (32, 32), sizes.full, seed, out / "recipes" / f"{slug}_seed{seed}", **RECIPES[name])
            top = r.get("top1_ema", r["top1"]) if "ema_decay" in RECIPES[name] else r["top1"]
            tops.append(top)
            deltas.append(top - src)
            walls.append(r["wall_s"])
        print(f"| {name} | {Cell(tops)} | {100 * statistics.fmean(deltas):+.2f} | "
              f"{sum(d >= 0 for d in deltas)}/{len(deltas)} | {statistics.fmean(walls):.0f} |", flush=True)


def default_table(out: Path, seeds: tuple[int, ...], pretrain_steps: int, finetune_steps: int) -> None:
    rows: dict[str, list[float]] = {k: [] for k in ("source", "resampled", "fresh", "clip", "none")}
    walls: dict[str, list[float]] = {k: [] for k in ("source", "clip", "none")}
    for seed in seeds:
        folder = out / f"default16_seed{seed}_{pretrain_steps}"
        ckpt = folder / "model.safetensors"
        pre = train(TrainConfig(out=str(folder), steps=pretrain_steps, seed=seed, progress=False, reference=False,
                                log_every=max(pretrain_steps, 1)))
        rows["source"].append(pre["top1"])
        walls["source"].append(pre["wall_s"])
        rows["resampled"].append(run_eval(str(ckpt), res=(32, 32)).top1)
        model = vit_serve.load(ckpt)
        model.set_resolution(32, 32)
        torch.manual_seed(seed)
        model.reset_pos_embed()
        rows["fresh"].append(run_eval(str(vit_serve.save(model, out / f"fresh32_seed{seed}.safetensors",
                                                          overwrite=True))).top1)
        for key, clip in (("clip", 1.0), ("none", 0.0)):
            ft = train(TrainConfig(mode="finetune", init=str(ckpt), res=(32, 32), steps=finetune_steps, seed=seed,
                                   out=str(out / f"default32_{key}_seed{seed}_{finetune_steps}"), grad_clip=clip,
                                   progress=False, reference=False, log_every=max(finetune_steps, 1)))
            rows[key].append(ft["top1"])
            walls[key].append(ft["wall_s"])
    wall = {k: f"{statistics.fmean(v):.0f}" for k, v in walls.items()}
    print(f"\nThe digits default (2x2 patches), 16x16 -> 32x32, seeds {','.join(map(str, seeds))} (CPU "
          f"x{torch.get_num_threads()} threads, torch {torch.__version__})\n")
    print("| stage | steps | wall time s | held-out top-1 % |")
    print("|---|---:|---:|---:|")
    print(f"| pre-train at 16x16 from scratch | {pretrain_steps} | {wall['source']} | {Cell(rows['source'])} |")
    print(f"| at 32x32, resampled position embeddings, no step | 0 | | {Cell(rows['resampled'])} |")
    print(f"| at 32x32, fresh position embeddings (control), no step | 0 | | {Cell(rows['fresh'])} |")
    print(f"| fine-tune at 32x32, clipping at 1 (the paper's) | {finetune_steps} | {wall['clip']} | "
          f"{Cell(rows['clip'])} |")
    print(f"| fine-tune at 32x32, no clipping (the digits recipe's) | {finetune_steps} | {wall['none']} | "
          f"{Cell(rows['none'])} |")


def run(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/bench_transfer")
    ap.add_argument("--part", default="modes,recipes", help="comma list of modes, recipes, default")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--modes", default=",".join(RESAMPLE_MODES))
    ap.add_argument("--transfers", default=",".join(TRANSFERS))
    ap.add_argument("--recipes", default=";".join(RECIPES), help="semicolon list of RECIPES' names")
    ap.add_argument("--pretrain-steps", type=int, default=PRETRAIN_STEPS)
    ap.add_argument("--short-steps", type=int, default=20)
    ap.add_argument("--full-steps", type=int, default=FINETUNE_STEPS)
    ap.add_argument("--default-pretrain-steps", type=int, default=2000)
    ap.add_argument("--default-finetune-steps", type=int, default=300)
    ap.add_argument("--tiny", action="store_true", help="a few steps and one seed (CI's smoke run)")
    args = ap.parse_args(argv)
    sizes = Sizes(args.pretrain_steps, args.short_steps, args.full_steps, tuple(int(s) for s in args.seeds.split(",")))
    if args.tiny:
        sizes = Sizes(pretrain=4, short=1, full=2, seeds=(0,))
    out = Path(args.out)
    parts = args.part.split(",")
    if "modes" in parts:
        modes_table(out, sizes, tuple(args.modes.split(",")), tuple(args.transfers.split(",")))
    if "recipes" in parts:
        recipes_table(out, sizes, tuple(args.recipes.split(";")))
    if "default" in parts:
        default_table(out, sizes.seeds, *((4, 2) if args.tiny else (args.default_pretrain_steps,
                                                                    args.default_finetune_steps)))


def main(argv: list[str] | None = None) -> int:
    """`run`, its tables (and checks) saved as benchmarks/results/digits_transfer.json."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, a sibling, also when loaded by path
    from results_file import record_printed

    return record_printed("digits_transfer", run, argv)


if __name__ == "__main__":
    sys.exit(main())
