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

import torch

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


def main() -> None:
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
    print(f"\nForward, ViT-{args.model} at {args.res}, batch {args.batch}, fp32, CPU x{torch.get_num_threads()} "
          f"threads, torch {torch.__version__}; median of {args.rounds} rounds x {args.iters} iterations\n")
    print("| implementation | images/s | vs timm | time vs fused | peak RSS MiB | forward peak above model MiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for i in impls:
        m = mem[i]
        print(f"| {label[i]} | {ips[i]:.1f} | {ips[i] / ips['timm']:.3f}x | {med[i] / med['fused']:.3f}x | "
              f"{m['peak_mib']:.0f} | {m['peak_mib'] - m['built_mib']:.0f} |")


if __name__ == "__main__":
    main()
