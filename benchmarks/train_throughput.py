"""Training throughput and peak memory: `vit-serve train` vs timm in a minimal loop, same config, one run.

    python benchmarks/train_throughput.py [--model S/16] [--res 224] [--batch 16] [--steps 12] [--rounds 2]

vit-serve runs its whole training loop (`vit_serve.train.loop.train`: data loading from the digits set
upscaled to --res, augmentation off, AdamW, gradient clipping, logging); timm's model trains on in-memory
tensors with the same optimiser in the smallest possible loop. Each run is a fresh process (so its peak
resident memory is its own); rounds alternate between the two. fp32, CPU. Target (issue): >= 0.95x timm.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, a sibling
from results_file import ResultsFile, Table, print_checks

TIMM_NAMES = {"Ti/16": "vit_tiny_patch16_224", "S/16": "vit_small_patch16_224", "B/16": "vit_base_patch16_224"}


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def run_timm(model: str, res: int, batch: int, steps: int) -> dict:
    import timm

    base = _status_mib("VmRSS")  # after imports, before the model: as for vit-serve below
    net = timm.create_model(TIMM_NAMES[model], pretrained=False, num_classes=10, img_size=res)
    decay = [p for p in net.parameters() if p.ndim >= 2]
    rest = [p for p in net.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-3)
    x, y = torch.randn(batch, 3, res, res), torch.randint(0, 10, (batch,))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    steady = times[2:]  # first steps warm up allocators and kernels
    return {"images_per_s": batch * len(steady) / sum(steady), "peak_mib": _status_mib("VmHWM"), "base_mib": base}


def run_ours(model: str, res: int, batch: int, steps: int) -> dict:
    from vit_serve.train.config import TrainConfig
    from vit_serve.train.loop import train
    from vit_serve.train.progress import read_metrics

    base = _status_mib("VmRSS")
    with tempfile.TemporaryDirectory() as out:
        train(TrainConfig(model=model, data="digits", res=(res, res), batch_size=batch, steps=steps, log_every=1,
                          optimizer="adam", lr=1e-3, weight_decay=0.1, dropout=0.0, label_smoothing=0.0,
                          warmup_steps=1, eval_every=0, progress=False, out=out))
        rates = [r["images_per_s"] for r in read_metrics(Path(out) / "metrics.jsonl") if "images_per_s" in r]
    steady = rates[2:]
    # Harmonic mean of per-step rates = total images / total time over the steady steps.
    return {"images_per_s": len(steady) / sum(1 / r for r in steady), "peak_mib": _status_mib("VmHWM"),
            "base_mib": base}


def main() -> int | None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="S/16", choices=list(TIMM_NAMES))
    ap.add_argument("--res", type=int, default=224)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--_child", choices=["timm", "ours"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        fn = run_timm if args._child == "timm" else run_ours
        print(json.dumps(fn(args.model, args.res, args.batch, args.steps)))
        return

    results: dict[str, list[dict]] = {"timm": [], "ours": []}
    for _ in range(args.rounds):
        for impl in ("timm", "ours"):
            out = subprocess.run([sys.executable, __file__, "--model", args.model, "--res", str(args.res), "--batch",
                                  str(args.batch), "--steps", str(args.steps), "--_child", impl],
                                 capture_output=True, text=True, check=True)
            results[impl].append(json.loads(out.stdout.strip().splitlines()[-1]))
    ips = {k: statistics.median(r["images_per_s"] for r in v) for k, v in results.items()}
    peak = {k: max(r["peak_mib"] for r in v) for k, v in results.items()}
    above = {k: max(r["peak_mib"] - r["base_mib"] for r in v) for k, v in results.items()}
    title = (f"Training, ViT-{args.model} at {args.res}, batch {args.batch}, fp32, AdamW, CPU x"
             f"{torch.get_num_threads()} threads, torch {torch.__version__}; {args.steps} steps x {args.rounds} "
             f"rounds per implementation (first 2 steps of each run are warm-up)")
    label = {"timm": "timm model, minimal loop (in-memory tensors)", "ours": "vit-serve train (whole loop, digits)"}
    rows = [{"implementation": label[k], "images/s": round(ips[k], 2), "vs timm": round(ips[k] / ips["timm"], 3),
             "peak RSS MiB": round(peak[k]), "peak above start MiB": round(above[k])} for k in ("timm", "ours")]
    print(f"\n{title}\n")
    print("| implementation | images/s | vs timm | peak RSS MiB | peak above start MiB |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print("| " + " | ".join(str(v) for v in r.values()) + " |")
    ratio = ips["ours"] / ips["timm"]
    checks = [("vit-serve train images/s / timm's", f"{ratio:.3f}", ">= 0.95", ratio >= 0.95)]
    print_checks(checks)
    return ResultsFile.of("train_throughput", [Table.from_dicts(title, rows)], checks, {"runs": results},
                          args).save()

if __name__ == "__main__":
    sys.exit(main())
