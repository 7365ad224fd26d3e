"""The `vit-export` command: parse, call the library, print. Errors are one line and a non-zero exit.

    vit-export CKPT [--res 384 | 224x320 | dynamic] [--format onnx] [--batch dynamic|N]
               [--precision fp32|fp16|int8] [--out DIR] [--name NAME] [--opset 18] [--check-images DIR] [--force]

Writes <out>/<name>.onnx and <out>/<name>_explain.onnx, each with a <name>.json sidecar, after a parity check
against PyTorch (onnxruntime, CPU). A failed parity check prints its table and exits 1.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from vit_serve.cli import _Parser, parse_res

FORMATS = ("onnx",)
NOT_YET = ("tensorrt", "triton")  # tracked by the export issue; not in this release
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


def _res(text: str) -> tuple[int, int] | str:
    return "dynamic" if text.strip().lower() == "dynamic" else parse_res(text)


def _batch(text: str) -> str | int:
    if text.strip().lower() == "dynamic":
        return "dynamic"
    if text.strip().isdigit() and int(text) > 0:
        return int(text)
    raise argparse.ArgumentTypeError(f"bad batch {text!r}; use 'dynamic' or a positive integer")


def _formats(text: str) -> list[str]:
    out = [f.strip().lower() for f in text.split(",") if f.strip()]
    for f in out:
        if f in NOT_YET:
            raise argparse.ArgumentTypeError(
                f"format {f!r} is not available in this release yet; known formats: "
                f"onnx (available), tensorrt and triton (not available in this release "
                f"yet)"
            )
        if f not in FORMATS:
            raise argparse.ArgumentTypeError(
                f"unknown format {f!r}; known formats: onnx (available), tensorrt and "
                f"triton (not available in this release yet)"
            )
    return out or ["onnx"]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="vit-export",
        description="Export a vit-serve checkpoint to ONNX (plus an explain graph with "
        "attention rollout), verified against PyTorch with onnxruntime.",
    )
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint (any format `vit-serve convert` reads)")
    p.add_argument(
        "--res",
        type=_res,
        default=None,
        help="384, 224x320 (height x width) or 'dynamic' (default: the checkpoint's own resolution)",
    )
    p.add_argument(
        "--format",
        type=_formats,
        default=["onnx"],
        help="onnx (tensorrt and triton are not available in this release yet)",
    )
    p.add_argument("--batch", type=_batch, default="dynamic", help="'dynamic' (default) or a fixed batch size")
    p.add_argument("--precision", choices=("fp32", "fp16", "int8"), default="fp32")
    p.add_argument("--out", default="exports", help="output folder (default: exports)")
    p.add_argument("--name", help="file name stem (default: the checkpoint's name and the resolution)")
    p.add_argument("--opset", type=int, default=18, help="ONNX opset, >= 17 (default 18)")
    p.add_argument(
        "--check-images",
        metavar="DIR",
        help="real images for the parity check (sub-folders named after labels give int8 accuracy)",
    )
    p.add_argument("--head-fusion", choices=("mean", "max", "min"), default="mean", help="explain graph rollout")
    p.add_argument("--discard-ratio", type=float, default=0.9, help="explain graph rollout (default 0.9)")
    p.add_argument("--tol", type=float, default=1e-4, help="fp32 parity: max |Δ logit| (default 1e-4)")
    p.add_argument("--force", action="store_true", help="replace existing output files")
    return p


def _find_images(folder: str) -> list[Path]:
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"--check-images: no such folder: {root}")
    images = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_EXTS and p.is_file())
    if not images:
        raise ValueError(f"--check-images: no {'/'.join(e[1:] for e in IMAGE_EXTS)} images in {root}")
    return images


def _labels_of(images: list[Path], labels: list[str] | None) -> list[int] | None:
    """Class indices from parent folder names, when every image sits in a folder named after a label."""
    if not labels:
        return None
    index = {name: i for i, name in enumerate(labels)}
    found = [index.get(p.parent.name) for p in images]
    return None if any(i is None for i in found) else found


def _say(msg: str) -> None:
    print(msg, flush=True)


def _run(args: argparse.Namespace) -> int:
    from vit_export.onnx_export import export_onnx
    from vit_export.parity import check_parity
    from vit_export.sidecar import build_sidecar, sidecar_path, write_sidecar

    from vit_serve.checkpoints import load

    if args.opset < 17:
        raise ValueError(f"--opset {args.opset} is too old; LayerNormalization needs opset >= 17")
    images = _find_images(args.check_images) if args.check_images else None
    model = load(args.checkpoint)
    if isinstance(args.res, tuple):
        model.check_size(*args.res)  # ValueError naming the nearest valid sizes
    res = args.res or tuple(model.cfg.img_size)
    tag = "dynamic" if res == "dynamic" else (f"{res[0]}" if res[0] == res[1] else f"{res[0]}x{res[1]}")
    name = args.name or f"{Path(args.checkpoint).stem}_{tag}" + (
        "" if args.precision == "fp32" else f"_{args.precision}"
    )
    out = Path(args.out)
    targets = [out / f"{name}.onnx", out / f"{name}_explain.onnx"]
    existing = [p for t in targets for p in (t, sidecar_path(t)) if p.exists()]
    if existing and not args.force:
        raise FileExistsError(f"{existing[0]} exists; pass --force to replace it")

    onnx_precision = "fp16" if args.precision == "fp16" else "fp32"
    failed = False
    with tempfile.TemporaryDirectory(prefix="vit-export-") as tmp:
        for target, explain in zip(targets, (False, True), strict=True):
            kind = "explain graph" if explain else "graph"
            # int8: export fp32 beside the temp dir, quantize it into place.
            dest = Path(tmp) / target.name if args.precision == "int8" else target
            _say(f"exporting {kind} ({tag}, batch {args.batch}, {onnx_precision}, opset {args.opset}) ...")
            t0 = time.perf_counter()
            export_onnx(
                model,
                dest,
                res=res,
                batch=args.batch,
                opset=args.opset,
                explain=explain,
                head_fusion=args.head_fusion,
                discard_ratio=args.discard_ratio,
                precision=onnx_precision,
                overwrite=args.force,
            )
            _say(f"  exported in {time.perf_counter() - t0:.1f}s; checking parity with onnxruntime ...")
            report = check_parity(model, dest, images, tol=args.tol)
            _say(report.table())
            failed |= not report.ok
            extra = {}
            if args.precision == "int8":
                extra = {
                    "precision": "int8",
                    "int8": _quantize(model, dest, target, images, args),
                    "parity_note": "parity of the fp32 graph before dynamic int8 quantization",
                }
            write_sidecar(
                target, build_sidecar(model, target, args.checkpoint, report.to_dict(), extra), overwrite=args.force
            )
            _say(f"wrote {target} and {sidecar_path(target).name}")
    if failed:
        print(
            "vit-export: error: parity check failed (table above); the files are written with the failure "
            "recorded in their sidecars",
            file=sys.stderr,
        )
        return 1
    return 0


def _quantize(model, fp32_path: Path, target: Path, images: list[Path] | None, args: argparse.Namespace) -> dict:
    import torch
    from vit_export.onnx_export import export_info
    from vit_export.quantize import compare_int8, quantize_int8

    from vit_serve.preprocess import PreprocessConfig, preprocess_batch

    _say("  quantizing to int8 (dynamic, QInt8 MatMul/Gemm weights) ...")
    quantize_int8(fp32_path, target, overwrite=args.force)
    res = export_info(fp32_path)["resolution"]
    h, w = model.cfg.img_size if res == "dynamic" else res
    pre = (model.preprocess_cfg or PreprocessConfig(input_size=model.cfg.img_size)).with_size(h, w)
    x = torch.randn(16, 3, h, w, generator=torch.Generator().manual_seed(0))
    labels = None
    if images:
        x = preprocess_batch(images, pre)
        labels = _labels_of(images, model.labels)
    if isinstance(args.batch, int) and args.batch != 1:
        _say("  (fixed batch != 1: int8 speed/agreement not measured at batch 1)")
        return {"fp32_mb": fp32_path.stat().st_size / 1e6, "int8_mb": target.stat().st_size / 1e6}
    rep = compare_int8(fp32_path, target, x.numpy(), labels)
    _say(rep.table())
    return rep.to_dict()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (ValueError, FileExistsError, FileNotFoundError, OSError) as e:
        # CheckpointError and bad sizes are ValueErrors with a message written for the user.
        print(f"vit-export: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
