"""The `vit-export` command: parse, call the library, print. Errors are one line and a non-zero exit.

    vit-export CKPT [--res 384 | 224x320 | dynamic] [--format onnx,tensorrt,triton] [--batch dynamic|N]
               [--precision fp32|fp16|int8] [--out DIR] [--repo DIR] [--name NAME] [--opset 18]
               [--check-images DIR] [--calibration-images DIR] [--int8-scheme dynamic|static] [--force]
               [--trt-precision fp16|bf16|fp32] [--max-batch 16] [--instances 1]
               [--triton-ensemble onnx|trt|py] [--triton-device cpu|gpu]

Where things go:
    <out>/<name>.onnx, <out>/<name>_explain.onnx (+ <name>.json sidecars)   always (every format starts here)
    <out>/<name>_tensorrt/model_sm<XY>.plan                                --format tensorrt
    <out>/<name>_tensorrt/<name>_<fp16|bf16>.onnx   the typed graph TensorRT 11 builds from (strongly typed only)
    <out>/tensorrt_sm<XY>_trt<version>.cache                               TensorRT's timing cache
    <repo>/<name>_{onnx,explain_onnx,trt,py,explain_py,preprocess,ensemble}/ --format triton (versions added)

Exit codes: 0 done; 1 error or failed parity check (of the ONNX graphs: the engine and the Triton repository
are then not written; of the engine: it is written with the failure in its sidecar, the repository is not);
2 bad usage; 3 TensorRT was asked for but cannot run here (no tensorrt package, no CUDA GPU, or a TensorRT
outside 10.x-11.x): everything else is written.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from vit_serve.cli import _Parser, parse_res

FORMATS = ("onnx", "tensorrt", "triton")
SCHEMES = ("dynamic", "static")
MAX_CALIBRATION = 256  # = vit_export.quantize.MAX_CALIBRATION (not imported: --help must not load onnxruntime)
EXIT_NO_TENSORRT = 3
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
        if f not in FORMATS:
            raise argparse.ArgumentTypeError(f"unknown format {f!r}; known formats: {', '.join(FORMATS)}")
    return sorted(set(out), key=FORMATS.index) or ["onnx"]


def _positive(text: str) -> int:
    if text.strip().isdigit() and int(text) > 0:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="vit-export",
        description="Export a vit-serve checkpoint to ONNX (plus an explain graph with attention rollout), "
        "verified against PyTorch with onnxruntime; optionally a TensorRT engine and a Triton model repository.",
        epilog="Layout: the ONNX files and sidecars always go to --out (<name>.onnx, <name>_explain.onnx); "
        "tensorrt adds <out>/<name>_tensorrt/model_sm<XY>.plan (and a timing cache per GPU architecture and "
        "TensorRT version in --out); triton writes the models <name>_onnx, "
        "<name>_explain_onnx, <name>_trt (with an engine), <name>_py, <name>_explain_py, <name>_preprocess and "
        "<name>_ensemble into --repo, adding a version when a model exists. Exit codes: 0 done, 1 error or "
        "failed parity (of the ONNX graphs or the engine), 2 bad usage, 3 tensorrt requested but unavailable "
        "here (everything else written).",
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
        help="comma list of onnx, tensorrt, triton (default onnx; the ONNX files are always written)",
    )
    p.add_argument("--batch", type=_batch, default="dynamic", help="'dynamic' (default) or a fixed batch size")
    p.add_argument("--precision", choices=("fp32", "fp16", "int8"), default="fp32")
    p.add_argument("--out", default="exports", help="folder of the ONNX files and engines (default: exports)")
    p.add_argument("--repo", default="model_repo", help="Triton model repository (default: model_repo)")
    p.add_argument("--name", help="file name stem (default: the checkpoint's name and the resolution)")
    p.add_argument("--opset", type=int, default=18, help="ONNX opset, >= 17 (default 18)")
    p.add_argument(
        "--check-images",
        metavar="DIR",
        help="real images for the parity check (sub-folders named after labels give int8 accuracy)",
    )
    q = p.add_argument_group("int8 (--precision int8)")
    q.add_argument(
        "--int8-scheme",
        choices=SCHEMES,
        default="dynamic",
        help="the int8 graph written: dynamic (weights int8, activations quantized on the fly) or static (QDQ, "
        "activation ranges calibrated on images); both are measured side by side when images are given",
    )
    q.add_argument(
        "--calibration-images",
        metavar="DIR",
        help=f"images that calibrate static int8 (default: --check-images; at most {MAX_CALIBRATION} are used)",
    )
    p.add_argument("--head-fusion", choices=("mean", "max", "min"), default="mean", help="explain graph rollout")
    p.add_argument("--discard-ratio", type=float, default=0.9, help="explain graph rollout (default 0.9)")
    p.add_argument("--tol", type=float, default=1e-4, help="fp32 parity: max |Δ logit| (default 1e-4)")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace existing ONNX files and engines (never a repository's versions: a re-export adds one)",
    )
    trt = p.add_argument_group("tensorrt")
    trt.add_argument(
        "--trt-precision",
        choices=("fp16", "bf16", "fp32"),
        default="fp16",
        help="engine precision (default fp16; normalisation layers stay fp32)",
    )
    tri = p.add_argument_group("triton")
    tri.add_argument(
        "--max-batch",
        type=_positive,
        default=16,
        help="max_batch_size of every model, and the engine's largest batch (default 16)",
    )
    tri.add_argument("--instances", type=_positive, default=1, help="instances of each model (default 1)")
    tri.add_argument(
        "--triton-ensemble",
        choices=("onnx", "trt", "py"),
        help="the classifier the <name>_ensemble model calls (default: trt with an engine, else onnx)",
    )
    tri.add_argument(
        "--triton-device",
        choices=("cpu", "gpu"),
        default="cpu",
        help="instance kind of the onnxruntime models (default cpu; TensorRT is always gpu)",
    )
    tri.add_argument(
        "--queue-delay-us",
        type=int,
        default=1000,
        help="dynamic batching: longest wait to fill a batch, microseconds (default 1000)",
    )
    tri.add_argument(
        "--max-queue",
        type=_positive,
        default=128,
        help="dynamic batching: requests that may wait; more are rejected (default 128)",
    )
    return p


def _find_images(folder: str, flag: str = "--check-images") -> list[Path]:
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"{flag}: no such folder: {root}")
    images = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_EXTS and p.is_file())
    if not images:
        raise ValueError(f"{flag}: no {'/'.join(e[1:] for e in IMAGE_EXTS)} images in {root}")
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
    from vit_export.sidecar import build_sidecar

    from vit_serve.checkpoints import load
    from vit_serve.manifest import Int8Quantization, manifest_path, write_manifest

    if args.opset < 17:
        raise ValueError(f"--opset {args.opset} is too old; LayerNormalization needs opset >= 17")
    _check_formats(args)
    images = _find_images(args.check_images) if args.check_images else None
    calibration = _find_images(args.calibration_images, "--calibration-images") if args.calibration_images else images
    if args.precision == "int8" and args.int8_scheme == "static" and not calibration:
        raise ValueError("--int8-scheme static needs images to calibrate on: pass --calibration-images DIR "
                         "(or --check-images DIR)")
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
    existing = [p for t in targets for p in (t, manifest_path(t)) if p.exists()]
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
            int8 = None
            if args.precision == "int8":
                int8 = Int8Quantization(
                    args.int8_scheme,
                    _quantize(model, dest, target, images, calibration, args),
                    f"parity of the fp32 graph before {args.int8_scheme} int8 quantization",
                )
            write_manifest(
                target, build_sidecar(model, target, args.checkpoint, report.to_dict(), int8), overwrite=args.force
            )
            _say(f"wrote {target} and {manifest_path(target).name}")
    if failed:
        later = [f for f in args.format if f != "onnx"]
        print(
            "vit-export: error: parity check failed (table above); the files are written with the failure "
            "recorded in their sidecars" + (f"; {' and '.join(later)} skipped" if later else ""),
            file=sys.stderr,
        )
        return 1
    code, engine = 0, None
    if "tensorrt" in args.format:
        engine, code = _tensorrt(model, targets[0], out / f"{name}_tensorrt", res, args)
    if code == 1:
        if "triton" in args.format:
            _say("(the engine failed its parity check: the Triton repository is not written)")
        return 1
    if "triton" in args.format:
        _triton(targets, name, engine, args)
    return code


def _check_formats(args: argparse.Namespace) -> None:
    """Combinations refused before any work is done."""
    if "triton" in args.format and args.batch != "dynamic":
        raise ValueError(
            f"--format triton needs --batch dynamic (got {args.batch}): Triton's dynamic batcher sends 1 to "
            "--max-batch images per call"
        )
    if "tensorrt" in args.format and args.batch != "dynamic":
        raise ValueError(f"--format tensorrt needs --batch dynamic (got {args.batch}); --max-batch sets its limit")
    if "tensorrt" in args.format and args.precision == "int8":
        raise ValueError(
            "--format tensorrt builds from an fp32 or fp16 graph; --precision int8 is onnxruntime's "
            "quantization (choose the engine's precision with --trt-precision)"
        )
    if "tensorrt" in args.format and args.res == "dynamic":
        raise ValueError(
            "--format tensorrt needs a fixed --res (e.g. --res 384): engines are built for one input size, and "
            "the dynamic graph's in-graph position-embedding resampling is not built into an engine"
        )
    if args.calibration_images and args.precision != "int8":
        raise ValueError("--calibration-images calibrates static int8: it needs --precision int8")
    if args.triton_ensemble == "trt" and "tensorrt" not in args.format:
        raise ValueError("--triton-ensemble trt needs --format tensorrt (the ensemble would have no engine)")


def _tensorrt(
    model, onnx_path: Path, plan_dir: Path, res: tuple[int, int], args: argparse.Namespace
) -> tuple[dict | None, int]:
    """Build and check the engine: (info, 0); (info, 1) when it fails its parity check (table printed, sidecar
    written with the failure); (None, 3) with a one-line message when TensorRT cannot run here."""
    from vit_export.sidecar import engine_sidecar
    from vit_export.tensorrt_build import build_engine, tensorrt_version, unavailable_reason
    from vit_export.tensorrt_compat import check_supported, plan_build

    reason = unavailable_reason()
    if reason is None:
        try:
            check_supported(tensorrt_version())
        except ValueError as e:
            reason = str(e)
    if reason:
        print(f"vit-export: tensorrt: {reason}; the ONNX files are written", file=sys.stderr)
        return None, EXIT_NO_TENSORRT
    version = tensorrt_version()
    graph_precision = "fp16" if args.precision == "fp16" else "fp32"
    precision = "fp16" if args.precision == "fp16" else args.trt_precision
    plan = plan_build(version, precision, graph_precision)
    source = onnx_path
    if plan.graph_precision != graph_precision:
        from vit_export.typed_graph import export_typed

        source = plan_dir / f"{onnx_path.stem}_{plan.graph_precision}.onnx"
        _say(f"exporting the {plan.graph_precision}-typed graph TensorRT {version} builds from (LayerNorm in fp32) ...")
        export_typed(model, source, plan.graph_precision, res=res, batch=args.batch, opset=args.opset,
                     overwrite=args.force)
    hi = args.max_batch
    _say(f"building the TensorRT engine ({precision}, batch 1..{hi}) ...")
    info = build_engine(
        source,
        plan_dir,
        precision=precision,
        batch=(1, max(1, hi // 2), hi),
        cache_dir=Path(args.out),
        progress=_say,
        check_onnx=onnx_path,
        overwrite=args.force,
    )
    from vit_serve.manifest import manifest_path, read_manifest, write_manifest

    # `vit-serve serve <plan>` reads the ONNX graph's contract in the engine's manifest (<plan stem>.json).
    built_from = None if source == onnx_path else str(source.relative_to(plan_dir.parent))
    write_manifest(info["path"], engine_sidecar(read_manifest(onnx_path), info, built_from), overwrite=args.force)
    _say(f"wrote {info['path']} and {manifest_path(info['path']).name}")
    return info, 0 if report_engine_parity(info["parity"], info["file"]) else 1


def report_engine_parity(parity: dict, engine: str) -> bool:
    """Print the engine's parity table (`vit_export.parity`'s layout); on failure also the one-line error.

    `parity`: what `tensorrt_build.compare_runtimes` returns. True when it passed.
    """
    import dataclasses

    from vit_export.parity import ParityReport, ParityRow

    from vit_serve.manifest import Parity

    check = Parity.from_dict(parity, f"the parity check of {engine}")
    names = [f.name for f in dataclasses.fields(ParityRow)]  # fields the engine check lacks (rollout's) stay None
    rows = [ParityRow(**{n: r.get(n) for n in names}) for r in check.rows]
    report = ParityReport(onnx_path=engine, precision=check.precision, criteria=check.criteria, rows=rows)
    lines = report.table().splitlines()
    # ParityReport's header names onnxruntime vs PyTorch; here the candidate is the engine, the reference ORT.
    lines[0] = (f"parity: {engine} ({check.candidate or 'engine'} {check.precision} vs "
                f"{check.reference}; {check.criteria})")
    _say("\n".join(lines))
    if not report.ok:
        print(f"vit-export: error: the engine {engine} failed its parity check against {check.reference} "
              "(table above); it is written with the failure recorded in its sidecar", file=sys.stderr)
    return report.ok


def _triton(targets: list[Path], name: str, engine: dict | None, args: argparse.Namespace) -> None:
    from vit_export.triton_repo import write_repository

    ensemble = args.triton_ensemble
    if ensemble == "trt" and engine is None:
        ensemble = "onnx"
        _say("(no TensorRT engine: the ensemble calls the onnxruntime model)")
    written = write_repository(
        targets[0],
        targets[1],
        args.repo,
        name,
        engine,
        max_batch=args.max_batch,
        instances=args.instances,
        ensemble_target=ensemble,
        onnx_device=args.triton_device,
        queue_delay_us=args.queue_delay_us,
        max_queue=args.max_queue,
    )
    _say(f"Triton model repository {args.repo}:")
    for w in written:
        _say(f"  {w.model:<28} version {w.version}  {w.path}")


def _quantize(
    model, fp32_path: Path, target: Path, images: list[Path] | None, calibration: list[Path] | None,
    args: argparse.Namespace,
) -> dict:
    """Write the chosen int8 scheme to `target`; measure every scheme that can be built here side by side."""
    import torch
    from vit_export.onnx_export import export_info
    from vit_export.quantize import compare_schemes, quantize_int8, quantize_static_int8

    from vit_serve.preprocess import PreprocessConfig, preprocess_batch

    res = export_info(fp32_path)["resolution"]
    h, w = model.cfg.img_size if res == "dynamic" else res
    pre = (model.preprocess_cfg or PreprocessConfig(input_size=model.cfg.img_size)).with_size(h, w)
    batch = args.batch if isinstance(args.batch, int) else 8
    paths = {"dynamic": fp32_path.with_name(f"{fp32_path.stem}_dynamic.onnx")}
    if calibration:
        paths["static"] = fp32_path.with_name(f"{fp32_path.stem}_static.onnx")
    note = None
    for scheme, path in paths.items():
        if scheme == "dynamic":
            _say("  quantizing to int8, dynamic (QInt8 MatMul/Gemm weights per channel) ...")
            quantize_int8(fp32_path, path, overwrite=True)
        else:
            picked = _spread(calibration, MAX_CALIBRATION)
            note = f"{len(picked)} images of {args.calibration_images or args.check_images}"
            _say(f"  quantizing to int8, static (QDQ, calibrated on {note}) ...")
            quantize_static_int8(fp32_path, path, preprocess_batch(picked, pre).numpy(), batch=batch, overwrite=True)
    target_tmp = paths[args.int8_scheme]
    if isinstance(args.batch, int) and args.batch != 1:
        _say("  (fixed batch != 1: int8 speed/agreement not measured at batch 1)")
        sizes = {f"{k}_mb": p.stat().st_size / 1e6 for k, p in paths.items()}
        out = {"fp32_mb": fp32_path.stat().st_size / 1e6, **sizes}
    else:
        x = torch.randn(16, 3, h, w, generator=torch.Generator().manual_seed(0))
        labels = None
        if images:
            x = preprocess_batch(images, pre)
            labels = _labels_of(images, model.labels)
        rep = compare_schemes(fp32_path, paths, x.numpy(), labels, calibration=note)
        _say(rep.table())
        out = rep.to_dict()
    _install(target_tmp, target, args.force)
    return out


def _spread(items: list[Path], n: int) -> list[Path]:
    """At most n items, evenly spaced (every class folder of a sorted tree gets its share)."""
    if len(items) <= n:
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def _install(src: Path, dest: Path, overwrite: bool) -> None:
    import shutil

    from vit_serve.checkpoints.io import atomic_write

    atomic_write(dest, lambda tmp: shutil.copyfile(src, tmp), overwrite=overwrite)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (ValueError, FileExistsError, FileNotFoundError, OSError, RuntimeError, ImportError) as e:
        # CheckpointError and bad sizes are ValueErrors with a message written for the user; RuntimeError:
        # a TensorRT build that failed; ImportError: an optional dependency (tritonclient, tensorrt) missing.
        print(f"vit-export: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
