"""Token merging (ToMe): images/s on PyTorch, onnxruntime fp32 and int8, agreement and digits top-1 for each r.

    python benchmarks/tome.py [--model S/16] [--res 224] [--batch 8] [--r 0,4,8,13,16] [--threads 2]
        [--rounds 3] [--digits-steps 600] [--torch-only] [--tiny]

One run, two models:
1. Speed and agreement: a random-weight ViT (`--model` at `--res`, 1000 classes, `export_onnx.nontrivial_weights`:
   timm's init with a seeded N(0, 0.1) head and class token, so the logits are not all 0) with
   `VisionTransformer.set_token_merging(r)` for each r in `--r` (the same r in every layer; 16 is about the largest
   for ViT-S/16, 12 x 16 of its 196 patches). Images/s at `--batch` of PyTorch eager (fp32, no_grad, `--threads`
   intra-op threads), of onnxruntime fp32 on a static-resolution export of each r
   (`vit_export.onnx_export.export_onnx`, the merging in the graph) and of onnxruntime int8 (dynamic quantization
   of that export, `vit_export.quantize.quantize_int8`), the same threads: medians over `--rounds` interleaved
   rounds (every r and runtime in each round, the order reversed every other round, so the machine's drift hits
   all alike), each with its ratio to r=0 on the same runtime. Agreement with r=0 (PyTorch fp32): top-1 and the
   logits' mean |delta| on 48 held-out crops of the photos `upload_corpus.photos()` ships (astronaut, chelsea,
   coffee, rocket, grace_hopper; crops at seeded random places and scales), for PyTorch and for onnxruntime int8.
   Random weights make agreement a stability measure, not accuracy.
2. Accuracy: a small ViT (32 px, patch 4: 64 patches + [class], width 64, depth 4) trained at the start of the run
   on scikit-learn's digits (`vit_serve.data.digits_tensors`: 8x8 scans upscaled to 32 px, the fixed stratified
   split, 1438 train / 359 test; AdamW, lr 3e-3 warmed up over 10% of the steps then cosine, `--digits-steps`
   steps of 64 with shifts of up to one scan pixel; about a minute on 2 cores), without ToMe; ToMe is then
   applied off the shelf (proportional attention). Its test top-1 for each row, PyTorch fp32 and onnxruntime
   int8. The rows' r are the large model's; the digits model, 4 layers and 64 patches, gets the r that leaves the
   same fraction of its patch tokens after the last layer (the nearest; the smallest such r), shown as
   "digits r": the same share of the image's patches survives, which is what r trades. (64 / 4 = 16 patches a
   layer against ViT-S/16's 196 / 12 = 16.3, so the r mostly coincide.)

Target (issue 23): ToMe on onnxruntime (fp32), r=13 >= 1.5x r=0 at batch 8. `--tiny`: a tiny random model and a
tiny digits model, for the smoke test (tests/benchmarks/test_tome_bench.py).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from export_onnx import cpu_info, images_per_s, nontrivial_weights  # benchmarks/ is first on sys.path
from results_file import record_printed
from upload_corpus import photos

from vit_serve.config import ViTConfig
from vit_serve.model import VisionTransformer, create_model
from vit_serve.tome import parse_r, tokens_after

TARGET_R, TARGET = 13, 1.5
DIGITS_RES = 32
DIGITS_MODEL = dict(patch_size=4, embed_dim=64, depth=4, num_heads=4, mlp_dim=128)
TINY_MODEL = dict(patch_size=4, embed_dim=32, depth=2, num_heads=2, mlp_dim=64)  # --tiny: both models
RUNTIMES = ("torch", "onnxruntime fp32", "onnxruntime int8")


def photo_crops(res: int, n: int = 48) -> torch.Tensor:
    """n crops [n, 3, res, res] of `upload_corpus.photos()` at seeded random places and scales, ImageNet-normalised."""
    from PIL import Image

    imgs = list(photos().values())
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        img = imgs[i % len(imgs)]
        s = int(min(img.size) * rng.uniform(0.4, 1.0))
        x0, y0 = rng.integers(0, img.width - s + 1), rng.integers(0, img.height - s + 1)
        crop = img.crop((x0, y0, x0 + s, y0 + s)).resize((res, res), Image.Resampling.BICUBIC)
        out.append((np.asarray(crop, np.float32) / 255 - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225])
    return torch.from_numpy(np.stack(out).astype(np.float32)).permute(0, 3, 1, 2).contiguous()


def patches_left(model: VisionTransformer, r: int) -> int:
    """Patch tokens (prefix tokens not counted) after the last layer with r merged per layer."""
    n0 = model.grid_size[0] * model.grid_size[1] + model.num_prefix_tokens
    return tokens_after(n0, parse_r(len(model.blocks), r), model.num_prefix_tokens)[-1] - model.num_prefix_tokens


def matched_r(fraction: float, model: VisionTransformer) -> int:
    """The smallest r whose patches left after `model`'s last layer are the nearest to `fraction` of its patches
    (past half the patches a layer, r changes nothing: the merge is capped there)."""
    n = model.grid_size[0] * model.grid_size[1]
    return min(range(n // 2 + 1), key=lambda r: (abs(patches_left(model, r) / n - fraction), r))


def train_digits(steps: int, arch: dict, batch: int = 64, lr: float = 3e-3, seed: int = 0):
    """A ViT trained on the digits' train split; returns (model in eval mode, test inputs, test labels, seconds)."""
    from vit_serve.data import digits_tensors
    from vit_serve.preprocess import PreprocessConfig

    cfg = PreprocessConfig(input_size=(DIGITS_RES, DIGITS_RES), mean=(0.5,) * 3, std=(0.5,) * 3, crop_pct=1.0)
    x, y = digits_tensors("train", cfg)
    xt, yt = digits_tensors("test", cfg)
    torch.manual_seed(seed)
    model = create_model(ViTConfig(img_size=(DIGITS_RES, DIGITS_RES), num_classes=10, **arch))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    warm = max(1, steps // 10)

    def factor(s: int) -> float:  # linear warm-up over 10% of the steps, then cosine decay to 0
        return (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    g = torch.Generator().manual_seed(seed)
    pad = DIGITS_RES // 8  # one scan pixel
    xp = F.pad(x, (pad,) * 4, value=float(x.min()))  # the background's value
    t0 = time.perf_counter()
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(x), (batch,), generator=g)
        dx, dy = torch.randint(0, 2 * pad + 1, (2,), generator=g).tolist()
        loss = F.cross_entropy(model(xp[idx, :, dy:dy + DIGITS_RES, dx:dx + DIGITS_RES]), y[idx],
                               label_smoothing=0.1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return model.eval(), xt, yt, time.perf_counter() - t0


def export_pair(model: VisionTransformer, folder: Path, name: str) -> tuple[Path, Path]:
    """The fp32 export of `model` (its ToMe setting in the graph) and its dynamic int8 quantization."""
    from vit_export.onnx_export import export_onnx
    from vit_export.quantize import quantize_int8

    fp32 = export_onnx(model, folder / f"{name}.onnx")
    return fp32, quantize_int8(fp32, folder / f"{name}_int8.onnx")


def ort_run(sess, x: np.ndarray) -> np.ndarray:
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def run(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="S/16")
    ap.add_argument("--res", type=int, default=None, help="the random model's resolution (224; --tiny: 32)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--r", default="0,4,8,13,16", help="a comma list of r (0 first: the baseline)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=3, help="calls per measurement")
    ap.add_argument("--digits-steps", type=int, default=None, help="digits training steps (600; --tiny: 200)")
    ap.add_argument("--torch-only", action="store_true", help="no onnxruntime columns (no exports)")
    ap.add_argument("--tiny", action="store_true", help="tiny models in place of --model and the digits ViT")
    ap.add_argument("--onnx", action="store_true", help=argparse.SUPPRESS)  # old command lines: now the default
    args = ap.parse_args(argv)
    rs = [int(v) for v in args.r.split(",")]
    if not rs or rs[0] != 0 or min(rs) < 0 or len(set(rs)) != len(rs):
        ap.error("--r: a comma list of distinct whole numbers >= 0 starting with 0 (the baseline)")
    res = args.res or (32 if args.tiny else 224)
    steps = args.digits_steps if args.digits_steps is not None else (200 if args.tiny else 600)
    onnx = not args.torch_only
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)

    digits_arch = TINY_MODEL if args.tiny else DIGITS_MODEL
    digits, xt, yt, t_train = train_digits(steps, digits_arch)
    print(f"  digits ViT trained: {steps} steps in {t_train:.0f} s", file=sys.stderr)

    torch.manual_seed(0)
    name = "tiny" if args.tiny else args.model
    if args.tiny:
        model = create_model(ViTConfig(img_size=(res, res), num_classes=1000, **TINY_MODEL))
    else:
        model = create_model(args.model, num_classes=1000, img_size=(res, res))
    model = nontrivial_weights(model).eval()
    n_patches = model.grid_size[0] * model.grid_size[1]
    crops = photo_crops(res)
    x = torch.randn(args.batch, 3, res, res, generator=torch.Generator().manual_seed(0))
    d_r = {r: matched_r(patches_left(model, r) / n_patches, digits) for r in rs}

    with tempfile.TemporaryDirectory(prefix="tome-bench-") as tmp:
        folder = Path(tmp)
        from vit_export.parity import session

        logits, logits8, sessions, parity = {}, {}, {}, {}
        for r in rs:
            model.set_token_merging(r)
            with torch.no_grad():
                logits[r] = model(crops)
            if onnx:
                fp32, int8 = export_pair(model, folder, f"r{r}")
                sessions[r] = {"onnxruntime fp32": session(fp32, args.threads),
                               "onnxruntime int8": session(int8, args.threads)}
                err = np.abs(ort_run(sessions[r]["onnxruntime fp32"], crops.numpy()) - logits[r].numpy()).max(1)
                parity[r] = float(err.max())
                print(f"  r={r}: onnxruntime fp32 vs PyTorch max |delta| {err.max():.1e} (median over crops "
                      f"{np.median(err):.1e})", file=sys.stderr)
                logits8[r] = torch.from_numpy(ort_run(sessions[r]["onnxruntime int8"], crops.numpy()))
            print(f"  r={r}: ready", file=sys.stderr)

        digits_acc: dict[int, dict[str, float]] = {}
        for dr in sorted(set(d_r.values())):
            digits.set_token_merging(dr)
            with torch.no_grad():
                digits_acc[dr] = {"torch": float((digits(xt).argmax(1) == yt).float().mean())}
            if onnx:
                _, int8 = export_pair(digits, folder, f"digits_r{dr}")
                pred = ort_run(session(int8, args.threads), xt.numpy()).argmax(1)
                digits_acc[dr]["onnxruntime int8"] = float((torch.from_numpy(pred) == yt).float().mean())
        digits.set_token_merging(0)

        cols = list(RUNTIMES if onnx else RUNTIMES[:1])
        speed: dict[str, dict[int, list[float]]] = {c: {r: [] for r in rs} for c in cols}
        xn = x.numpy()
        for rnd in range(args.rounds):
            for r in rs if rnd % 2 == 0 else reversed(rs):
                model.set_token_merging(r)
                with torch.no_grad():
                    speed["torch"][r].append(images_per_s(model, x, args.iters))
                for c in cols[1:]:
                    speed[c][r].append(images_per_s(lambda a, s=sessions[r][c]: ort_run(s, a), xn, args.iters))
            print(f"  round {rnd + 1}/{args.rounds}", file=sys.stderr)
        model.set_token_merging(0)

    med = {c: {r: statistics.median(v) for r, v in d.items()} for c, d in speed.items()}
    print(f"\nCPU: {cpu_info()}")
    print(f"\n{name} at {res}px (random weights), batch {args.batch}, {args.threads} threads, medians of "
          f"{args.rounds} interleaved rounds; agreement with r=0 (PyTorch fp32) on {len(crops)} photo crops"
          + ("; onnxruntime fp32 vs PyTorch, max abs logit delta over the crops: "
             + ", ".join(f"r={r} {v:.1e}" for r, v in parity.items()) if onnx else ""))
    print("\n| r | tokens left | " + " | ".join(f"{c} img/s | {c} / r=0" for c in cols)
          + " | top-1 agreement | mean abs logit delta"
          + (" | int8 top-1 agreement | int8 mean abs logit delta" if onnx else "") + " |")
    print("|---:|---:|" + "---:|---:|" * len(cols) + "---:|---:|" + ("---:|---:|" if onnx else ""))
    for r in rs:
        cells = [f"{float((lg.argmax(1) == logits[0].argmax(1)).float().mean()):.1%} | "
                 f"{float((lg - logits[0]).abs().mean()):.4f}" for lg in [logits[r]] + ([logits8[r]] if onnx else [])]
        print(f"| {r} | {patches_left(model, r) + model.num_prefix_tokens} | "
              + " | ".join(f"{med[c][r]:.1f} | {med[c][r] / med[c][0]:.2f}x" for c in cols)
              + " | " + " | ".join(cells) + " |")

    dcols = ["torch"] + (["onnxruntime int8"] if onnx else [])
    arch = digits_arch
    print(f"\ndigits ViT ({DIGITS_RES}px, patch {arch['patch_size']}, width {arch['embed_dim']}, depth "
          f"{arch['depth']}; trained {steps} steps in {t_train:.0f} s, no ToMe) on the digits test set "
          f"({len(yt)} scans): top-1 with ToMe applied; digits r leaves the row's fraction of the patches")
    print("\n| r | digits r | digits tokens left | " + " | ".join(f"{c} top-1" for c in dcols) + " |")
    print("|---:|---:|---:|" + "---:|" * len(dcols))
    for r in rs:
        dr = d_r[r]
        print(f"| {r} | {dr} | {patches_left(digits, dr) + digits.num_prefix_tokens} | "
              + " | ".join(f"{digits_acc[dr][c]:.2%}" for c in dcols) + " |")

    col = "onnxruntime fp32" if onnx else "torch"
    ok = True
    if TARGET_R in rs:
        ratio = med[col][TARGET_R] / med[col][0]
        ok = ratio >= TARGET
        print(f"\n| check | value | target | |\n|---|---:|---|---|\n| r={TARGET_R} / r=0, {col}, batch {args.batch} | "
              f"{ratio:.3f}x | >= {TARGET}x | {'pass' if ok else 'FAIL'} |")
        print(f"\ntarget (r={TARGET_R} >= {TARGET}x r=0 on {col}): {'holds' if ok else 'does not hold'} in this run")
    else:
        print(f"\ntarget (r={TARGET_R} >= {TARGET}x r=0): not measured, r={TARGET_R} not in --r")
    print(f"\nwall time {time.perf_counter() - t_start:.0f} s")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """`run`, its tables and check saved as benchmarks/results/tome.json."""
    return record_printed("tome", run, argv)


if __name__ == "__main__":
    sys.exit(main())
