"""Token merging (ToMe): images/s and agreement with r=0 for each r, side by side in one run.

    python benchmarks/tome.py [--model S/16] [--res 224] [--batch 8] [--r 0,4,8,13,16] [--threads 2]
        [--rounds 5] [--onnx]

One random-weight ViT (`--model` at `--res`, 1000 classes, timm's init but a N(0, 0.5) head),
`VisionTransformer.set_token_merging(r)` for each r in `--r`: PyTorch eager (fp32, no_grad, `--threads` intra-op
threads) images/s at `--batch`, medians over `--rounds` interleaved rounds (every r in each round, so the machine's
drift hits all alike); the tokens left after the last layer; and top-1 agreement with r=0 and the logits' mean
|delta| on 48 crops of the real photos scikit-image ships (astronaut, coffee, chelsea, ...). With `--onnx`, each r
is also exported by `vit_export.onnx_export.export_onnx` (static resolution, the merging in the graph) and run by
onnxruntime.

Random weights make agreement a stability measure, not accuracy: what r costs a trained model is for a trained
checkpoint. Target (issue 23): r=13 >= 1.5x r=0 (onnxruntime with --onnx, else PyTorch), batch 8.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from export_onnx import images_per_s  # benchmarks/ is the script's folder, first on sys.path

from vit_serve.model import create_model
from vit_serve.tome import parse_r, tokens_after

TARGET_R, TARGET = 13, 1.5


def photo_crops(res: int, n: int = 48) -> torch.Tensor:
    """n crops [n, 3, res, res] of scikit-image's photos at random places and scales, ImageNet-normalised."""
    from PIL import Image
    from skimage import data

    photos = [data.astronaut(), data.coffee(), data.chelsea(), data.rocket(), data.hubble_deep_field()]
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        img = Image.fromarray(photos[i % len(photos)]).convert("RGB")
        s = int(min(img.size) * rng.uniform(0.4, 1.0))
        x0, y0 = rng.integers(0, img.width - s + 1), rng.integers(0, img.height - s + 1)
        crop = img.crop((x0, y0, x0 + s, y0 + s)).resize((res, res), Image.BICUBIC)
        out.append((np.asarray(crop, np.float32) / 255 - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225])
    return torch.from_numpy(np.stack(out).astype(np.float32)).permute(0, 3, 1, 2).contiguous()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="S/16")
    ap.add_argument("--res", type=int, default=224)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--r", default="0,4,8,13,16", help="a comma list of r (0 first: the baseline)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=3, help="calls per measurement")
    ap.add_argument("--onnx", action="store_true", help="also export each r and run it on onnxruntime")
    args = ap.parse_args(argv)
    rs = [int(v) for v in args.r.split(",")]
    if not rs or rs[0] != 0 or min(rs) < 0:
        ap.error("--r: a comma list of whole numbers >= 0 starting with 0 (the baseline)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = create_model(args.model, num_classes=1000, img_size=(args.res, args.res)).eval()
    with torch.no_grad():  # timm's init zeroes the head: every logit 0, agreement and parity vacuous
        model.head.weight.normal_(0.0, 0.5)
    crops = photo_crops(args.res)
    x = torch.randn(args.batch, 3, args.res, args.res)
    n0 = model.grid_size[0] * model.grid_size[1] + model.num_prefix_tokens

    logits, sessions = {}, {}
    folder = Path(tempfile.mkdtemp(prefix="tome-bench-"))
    for r in rs:
        model.set_token_merging(r)
        with torch.no_grad():
            logits[r] = model(crops)
        if args.onnx:
            from vit_export.onnx_export import export_onnx
            from vit_export.parity import session

            path = export_onnx(model, folder / f"r{r}.onnx")
            sessions[r] = session(path, args.threads)
            got = sessions[r].run(None, {sessions[r].get_inputs()[0].name: crops[:8].numpy()})[0]
            err = float(np.abs(got - logits[r][:8].numpy()).max())
            print(f"  r={r}: exported, onnxruntime vs PyTorch max |delta| {err:.2e}", file=sys.stderr)

    speed: dict[str, dict[int, list[float]]] = {"torch": {r: [] for r in rs}, "onnxruntime": {r: [] for r in rs}}
    for rnd in range(args.rounds):
        for r in rs if rnd % 2 == 0 else reversed(rs):
            model.set_token_merging(r)
            with torch.no_grad():
                speed["torch"][r].append(images_per_s(model, x, args.iters))
            if r in sessions:
                s = sessions[r]
                name = s.get_inputs()[0].name
                speed["onnxruntime"][r].append(images_per_s(lambda a, s=s, n=name: s.run(None, {n: a}),
                                                            x.numpy(), args.iters))
        print(f"  round {rnd + 1}/{args.rounds}", file=sys.stderr)

    med = {k: {r: statistics.median(v) for r, v in d.items() if v} for k, d in speed.items()}
    cols = ["torch"] + (["onnxruntime"] if sessions else [])
    print(f"\n{args.model} at {args.res}px (random weights), batch {args.batch}, fp32, {args.threads} threads, "
          f"medians of {args.rounds} rounds; agreement on {len(crops)} photo crops")
    print("\n| r | tokens after the last layer | " + " | ".join(f"{c} images/s | {c} / r=0" for c in cols)
          + " | top-1 agreement with r=0 | mean abs logit delta |")
    print("|---:|---:|" + "---:|---:|" * len(cols) + "---:|---:|")
    for r in rs:
        left = tokens_after(n0, parse_r(len(model.blocks), r), model.num_prefix_tokens)[-1]
        agree = float((logits[r].argmax(1) == logits[0].argmax(1)).float().mean())
        delta = float((logits[r] - logits[0]).abs().mean())
        print(f"| {r} | {left} | " + " | ".join(f"{med[c][r]:.1f} | {med[c][r] / med[c][0]:.2f}x" for c in cols)
              + f" | {agree:.1%} | {delta:.4f} |")
    col = "onnxruntime" if sessions else "torch"
    if TARGET_R in rs:
        ratio = med[col][TARGET_R] / med[col][0]
        ok = ratio >= TARGET
        print(f"\n| check | value | target | |\n|---|---:|---|---|\n| r={TARGET_R} / r=0, {col}, batch {args.batch} | "
              f"{ratio:.2f}x | >= {TARGET}x | {'pass' if ok else 'FAIL'} |")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
