"""Forward throughput and peak memory: vit-serve vs timm, same config, same weights, one run.

    python benchmarks/forward.py [--model S/16] [--res 224] [--batch 8] [--rounds 7] [--iters 5]

Prints one table: images/s (median over interleaved rounds), ratio to timm, and each implementation's
peak resident memory measured in its own fresh process. CPU, fp32. Targets (issue): fused >= 0.97x timm,
explicit-attention path <= 1.3x the fused path's time, peak memory no more than timm's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, a sibling, also when loaded by path
from results_file import ResultsFile, Table, print_checks

TIMM_NAMES = {"Ti/16": "vit_tiny_patch16_224", "S/16": "vit_small_patch16_224", "B/16": "vit_base_patch16_224"}


def build(impl: str, model: str, res: int):
    """The timm reference, or ours loaded with the weights of a timm model seeded identically."""
    import timm

    from vit_serve.checkpoints.converted import build_model
    from vit_serve.checkpoints.timm_state import convert_timm

    torch.manual_seed(0)
    ref = timm.create_model(TIMM_NAMES[model], pretrained=False, img_size=res).eval()
    if impl == "timm":
        return ref, {}
    ours = build_model(convert_timm(ref.state_dict(), TIMM_NAMES[model]))
    del ref
    return ours, {"return_attention": True} if impl == "explicit" else {}


def _proc_status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_memory(impl: str, model: str, res: int, batch: int) -> None:
    """Child process: resident memory of the built model, and the peak during three forwards (Linux)."""
    if impl == "timm":
        import timm

        net, kw = timm.create_model(TIMM_NAMES[model], pretrained=False, img_size=res).eval(), {}
    else:
        import vit_serve

        net = vit_serve.create_model(TIMM_NAMES[model], img_size=res).eval()
        kw = {"return_attention": True} if impl == "explicit" else {}
    x = torch.randn(batch, 3, res, res)
    with open("/proc/self/clear_refs", "w") as f:  # reset the high-water mark (VmHWM) to the current RSS
        f.write("5")
    base = _proc_status_mib("VmRSS")
    with torch.inference_mode():
        for _ in range(3):
            net(x, **kw)
    print(json.dumps({"built_mib": base, "peak_mib": _proc_status_mib("VmHWM")}))


def main() -> int | None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="S/16", choices=list(TIMM_NAMES))
    ap.add_argument("--res", type=int, default=224)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--_memory", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._memory:
        return peak_memory(args._memory, args.model, args.res, args.batch)

    impls = ["timm", "fused", "explicit"]
    nets = {i: build(i, args.model, args.res) for i in impls}
    x = torch.randn(args.batch, 3, args.res, args.res)
    with torch.inference_mode():
        ref = nets["timm"][0](x)
        for i in ("fused", "explicit"):
            out = nets[i][0](x, **nets[i][1])
            out = out[0] if isinstance(out, tuple) else out
            assert (out - ref).abs().max() < 1e-4, f"{i} disagrees with timm"
        times: dict[str, list[float]] = {i: [] for i in impls}
        for _ in range(2):  # warm-up
            for i in impls:
                nets[i][0](x, **nets[i][1])
        for _ in range(args.rounds):  # interleaved, so machine noise hits every implementation alike
            for i in impls:
                net, kw = nets[i]
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    net(x, **kw)
                times[i].append((time.perf_counter() - t0) / args.iters)

    mem = {}
    for i in impls:
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--res", str(args.res),
                              "--batch", str(args.batch), "--_memory", i], capture_output=True, text=True,
                             check=True)
        mem[i] = json.loads(out.stdout.strip().splitlines()[-1])

    med = {i: statistics.median(t) for i, t in times.items()}
    ips = {i: args.batch / med[i] for i in impls}
    label = {"timm": "timm VisionTransformer", "fused": "vit-serve (fused SDPA)",
             "explicit": "vit-serve (explicit, return_attention)"}
    title = (f"Forward, ViT-{args.model} at {args.res}, batch {args.batch}, fp32, CPU x{torch.get_num_threads()} "
             f"threads, torch {torch.__version__}; median of {args.rounds} rounds x {args.iters} iterations")
    rows = [{"implementation": label[i], "images/s": round(ips[i], 2), "vs timm": round(ips[i] / ips["timm"], 3),
             "time vs fused": round(med[i] / med["fused"], 3), "peak RSS MiB": round(mem[i]["peak_mib"]),
             "forward peak above model MiB": round(mem[i]["peak_mib"] - mem[i]["built_mib"])} for i in impls]
    print(f"\n{title}\n")
    print("| " + " | ".join(rows[0]) + " |\n|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print("| " + " | ".join(f"{v}x" if k in ("vs timm", "time vs fused") else str(v) for k, v in r.items())
              + " |")
    fused, explicit = ips["fused"] / ips["timm"], med["explicit"] / med["fused"]
    checks = [("fused images/s / timm's", f"{fused:.3f}", ">= 0.97", fused >= 0.97),
              ("explicit-attention time / fused time", f"{explicit:.3f}", "<= 1.3", explicit <= 1.3),
              ("fused peak RSS / timm's (MiB)", f"{mem['fused']['peak_mib']:.0f} / {mem['timm']['peak_mib']:.0f}",
               "<= 1", mem["fused"]["peak_mib"] <= mem["timm"]["peak_mib"])]
    print_checks(checks)
    return ResultsFile.of("forward", [Table.from_dicts(title, rows)], checks, {"median_s": med}, args).save()

if __name__ == "__main__":
    sys.exit(main())
