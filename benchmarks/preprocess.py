"""Preprocessing cost per upload: the exact path (timm's transform) against the fast one, side by side.

    python benchmarks/preprocess.py [--repeats 5] [--size 224] [--threads 1,2,4] [--corpus DIR]

For every file of the upload corpus (benchmarks/upload_corpus.py: 12 MP phone JPEGs, one with an EXIF
orientation, a 4K and a progressive JPEG, a PNG screenshot, a WebP, a thumbnail) it prints the ms per image of
each stage (read, decode, orientation, colour conversion, resize, crop, normalise; the best of --repeats), the
total of `vit_serve.preprocess` itself, the speed-up, and the PSNR / max |Δ| of the fast model input against the
exact one; then images/s with 1, 2 and 4 decode threads. On the fast path the crop is part of the resize (only
the cropped window is filtered), so its crop column is 0. Numbers are for this machine: compare the ratios.
"""

from __future__ import annotations

import argparse
import importlib
import io
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import upload_corpus
from results_file import ResultsFile, Table

P = importlib.import_module("vit_serve.preprocess")  # the module (the package re-exports the function by name)
STAGES = ("read", "decode", "orientation", "colour", "resize", "crop", "normalise")


def stages(path: Path, cfg) -> dict[str, float]:
    """One pass of `vit_serve.preprocess` split into its stages (ms), with the library's own pieces."""
    t = {}
    t0 = time.perf_counter()
    data = path.read_bytes()
    t1 = time.perf_counter()
    img = P._open_and_load(io.BytesIO(data), None, cfg)
    t2 = time.perf_counter()
    img = P._exif_transpose(img)
    t3 = time.perf_counter()
    img = P._to_rgb(img)
    t4 = time.perf_counter()
    if cfg.decode == "fast":
        crop = P.resize_and_crop(img, cfg)  # the window the crop keeps, filtered once
        t5 = t6 = time.perf_counter()
    else:
        resized = P._resize_exact(img, P.resized_size((img.height, img.width), cfg), cfg.interpolation)
        t5 = time.perf_counter()
        crop = P._center_crop(resized, cfg.input_size)
        t6 = time.perf_counter()
    P.to_tensor(crop, cfg)
    t7 = time.perf_counter()
    for name, a, b in zip(STAGES, (t0, t1, t2, t3, t4, t5, t6), (t1, t2, t3, t4, t5, t6, t7), strict=True):
        t[name] = (b - a) * 1e3
    return t


def best_stages(path: Path, cfg, repeats: int) -> dict[str, float]:
    runs = [stages(path, cfg) for _ in range(repeats)]
    return {k: min(r[k] for r in runs) for k in STAGES}


def best_total(data: bytes, cfg, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        P.preprocess(data, cfg)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def psnr(a: torch.Tensor, b: torch.Tensor, cfg) -> float:
    std = torch.tensor(cfg.std).view(3, 1, 1)
    mse = float((((a - b) * std * 255).double() ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def throughput(blobs: list[bytes], cfg, threads: int, rounds: int) -> float:
    work = blobs * rounds
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda b: P.preprocess(b, cfg), blobs))  # warm
        t0 = time.perf_counter()
        list(pool.map(lambda b: P.preprocess(b, cfg), work))
        return len(work) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--threads", default="1,2,4")
    ap.add_argument("--corpus", help="folder for the corpus (default: a cache under the temp folder)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # the normalise stage on one thread, as in a decode worker
    folder = Path(args.corpus or Path(tempfile.gettempdir()) / "vit-serve-upload-corpus")
    paths = upload_corpus.build(folder)
    exact = P.PreprocessConfig(input_size=(args.size, args.size))
    fast = exact.with_decode("fast")
    print(f"vit_serve.preprocess to {args.size}x{args.size} (bicubic, crop_pct {exact.crop_pct}), one thread, "
          f"best of {args.repeats}; fast: FAST_HEADROOM {P.FAST_HEADROOM}, FAST_REDUCING_GAP {P.FAST_REDUCING_GAP}")
    head = f"{'file':24s} {'path':5s} " + " ".join(f"{s[:7]:>7s}" for s in STAGES) + f" {'total':>7s} {'x':>5s}" \
        f" {'PSNR dB':>7s} {'max|Δ|':>6s}"
    print(head)
    print("-" * len(head))
    stage_rows: list[dict] = []
    for name, path in paths.items():
        data = path.read_bytes()
        totals = {}
        for cfg in (exact, fast):
            st = best_stages(path, cfg, args.repeats)
            totals[cfg.decode] = best_total(data, cfg, args.repeats)
            extra = ""
            row = {"file": name, "path": cfg.decode, **{f"{s} ms": round(st[s], 2) for s in STAGES},
                   "total ms": round(totals[cfg.decode], 2), "x": None, "PSNR dB": None, "max |Δ|": None}
            if cfg.decode == "fast":
                x_e, x_f = P.preprocess(data, exact), P.preprocess(data, fast)
                extra = (f" {totals['exact'] / totals['fast']:5.1f}x {psnr(x_f, x_e, exact):7.1f}"
                         f" {float((x_f - x_e).abs().max()):6.3f}")
                row.update({"x": round(totals["exact"] / totals["fast"], 2), "PSNR dB": round(psnr(x_f, x_e, exact), 1),
                            "max |Δ|": round(float((x_f - x_e).abs().max()), 3)})
            stage_rows.append(row)
            print(f"{name if cfg.decode == 'exact' else '':24s} {cfg.decode:5s} "
                  + " ".join(f"{st[s]:7.1f}" for s in STAGES) + f" {totals[cfg.decode]:7.1f}" + extra)
    print("\nimages/s (vit_serve.preprocess in a thread pool; each thread's torch on one thread)")
    threads = [int(t) for t in args.threads.split(",")]
    sets = {"phone 12 MP JPEGs": [paths[n].read_bytes() for n in upload_corpus.PHONE_NAMES],
            "whole corpus": [p.read_bytes() for p in paths.values()]}
    print(f"{'set':20s} {'path':5s} " + " ".join(f"{f'{t} thr':>8s}" for t in threads))
    rate_rows: list[dict] = []
    for label, blobs in sets.items():
        rates = {}
        for cfg in (exact, fast):
            rates[cfg.decode] = [throughput(blobs, cfg, t, max(1, args.repeats // 2)) for t in threads]
            print(f"{label if cfg.decode == 'exact' else '':20s} {cfg.decode:5s} "
                  + " ".join(f"{r:8.1f}" for r in rates[cfg.decode]))
            rate_rows.append({"set": label, "path": cfg.decode,
                              **{f"{t} threads img/s": round(r, 1) for t, r in zip(threads, rates[cfg.decode],
                                                                                    strict=True)}})
        print(f"{'':20s} {'x':5s} " + " ".join(f"{f / e:7.1f}x" for e, f in zip(*rates.values(), strict=True)))
    tables = [Table.from_dicts(f"ms per image by stage, to {args.size}x{args.size}, one thread, best of "
                               f"{args.repeats}; x: exact / fast total, PSNR and max |Δ|: fast against exact",
                               stage_rows),
              Table.from_dicts("images/s, vit_serve.preprocess in a thread pool", rate_rows)]
    # No targets: the paths' costs are reported, each machine's own.
    return ResultsFile.of("preprocess", tables, [], {}, args, argv).save()


if __name__ == "__main__":
    raise SystemExit(main())
