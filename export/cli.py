"""The `vit-export` command: the flags as `vit_export.ExportOptions`, then `vit_export.export`, printed.

Errors are one line and a non-zero exit.

    vit-export CKPT [--res 384 | 224x320 | dynamic] [--format onnx,openvino,tensorrt,triton] [--batch dynamic|N]
               [--precision fp32|fp16|int8] [--outputs logits[,embedding]] [--out DIR] [--repo DIR] [--name NAME]
               [--opset 18]
               [--check-images DIR] [--calibration-images DIR] [--int8-scheme dynamic|static] [--force]
               [--trt-precision fp16|bf16|fp32] [--max-batch 16] [--instances 1]
               [--triton-ensemble onnx|trt|py] [--triton-device cpu|gpu] [--tome R] [--no-tome-prop-attn]
               [--reference-images DIR]

Where things go:
    <out>/<name>.onnx, <out>/<name>_explain.onnx (+ <name>.json sidecars)   always (every format starts here)
    <out>/<name>_text.onnx, <name>_text.json, <name>_text_tokenizer/        --text-tower (CLIP / SigLIP)
    <out>/<name>_naflex.onnx   patches, spatial_shapes, mask -> logits, embedding   --naflex (SigLIP 2 NaFlex)
    <out>/<name>_openvino/<name>.xml, <name>_explain.xml (+ .bin, .json)   --format openvino (int8: NNCF)
    <out>/<name>_tensorrt/model_sm<XY>.plan                                --format tensorrt
    <out>/<name>_tensorrt/<name>_<fp16|bf16>.onnx   the typed graph TensorRT 11 builds from (strongly typed only)
    <out>/tensorrt_sm<XY>_trt<version>.cache                               TensorRT's timing cache
    <repo>/<name>_{onnx,explain_onnx,trt,py,explain_py,preprocess,ensemble}/ --format triton (versions added;
        <name>_openvino/ with --format openvino too)

Exit codes: 0 done; 1 error or failed parity check (of the ONNX graphs: the engine and the Triton repository
are then not written; of the engine: it is written with the failure in its sidecar, the repository is not);
2 bad usage or an option the architecture cannot take (--tome with RoPE); 3 TensorRT was asked for but cannot
run here (no tensorrt package, no CUDA GPU, or a TensorRT outside 10.x-11.x): everything else is written.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from vit_export.pipeline import (
    ENSEMBLE_TARGETS,
    FORMATS,
    MAX_CALIBRATION,
    PRECISIONS,
    SCHEMES,
    TRITON_DEVICES,
    TRT_PRECISIONS,
    ExportOptions,
    ExportResult,
    OptionError,
    OutputExistsError,
    UnsupportedOptionError,
    export,
    parse_batch,
    parse_export_resolution,
    parse_formats,
    parse_outputs,
)

from vit_serve.cli_parser import OneLineParser, argument_type
from vit_serve.explain import HEAD_FUSIONS
from vit_serve.manifest import LOGITS
from vit_serve.tome_schedule import parse_tome

EXIT_NO_TENSORRT = 3
FLAGS = {"formats": "format"}  # ExportOptions fields whose flag is not their name


def _flag(option: str) -> str:
    """An `ExportOptions` field as its flag: max_batch -> --max-batch."""
    return "--" + FLAGS.get(option, option).replace("_", "-")


def _formats(text: str) -> list[str]:
    return list(parse_formats(text))


def _positive(text: str) -> int:
    if text.strip().isdigit() and int(text) > 0:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="vit-export",
        description="Export a vit-serve checkpoint to ONNX (plus an explain graph with attention rollout), "
        "verified against PyTorch with onnxruntime; optionally a TensorRT engine and a Triton model repository.",
        epilog="Layout: the ONNX files and sidecars always go to --out (<name>.onnx, <name>_explain.onnx); "
        "openvino adds the OpenVINO IR of both in <out>/<name>_openvino/ (<name>.xml + .bin + .json; with "
        "--precision int8 the logits graph quantized by NNCF on --calibration-images); "
        "tensorrt adds <out>/<name>_tensorrt/model_sm<XY>.plan (and a timing cache per GPU architecture and "
        "TensorRT version in --out); triton writes the models <name>_onnx, "
        "<name>_explain_onnx, <name>_trt (with an engine), <name>_py, <name>_explain_py, <name>_preprocess and "
        "<name>_ensemble (and <name>_openvino with openvino) into --repo, adding a version when a model exists. "
        "Exit codes: 0 done, 1 error or "
        "failed parity (of the ONNX graphs or the engine), 2 bad usage (or --tome with RoPE), 3 tensorrt "
        "requested but unavailable here (everything else written).",
    )
    _add_graph_flags(p)
    _add_tome_flags(p)
    _add_int8_flags(p)
    _add_reference_flags(p)
    _add_check_flags(p)
    _add_tensorrt_flags(p)
    _add_triton_flags(p)
    return p


def _add_graph_flags(p: argparse.ArgumentParser) -> None:
    """The checkpoint, what the ONNX graphs are and where they go."""
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint (any format `vit-serve convert` reads)")
    p.add_argument(
        "--res",
        type=argument_type(parse_export_resolution),
        default=None,
        help="384, 224x320 (height x width) or 'dynamic' (default: the checkpoint's own resolution)",
    )
    p.add_argument("--patch-size", type=_positive, metavar="P",
                   help="FlexiViT: resize the patch embedding to P x P (pseudo-inverse) and resample the position "
                        "embeddings once, to the resolution / P; P must divide --res (default: the checkpoint's "
                        "patch)")
    p.add_argument(
        "--format",
        type=argument_type(_formats),
        default=["onnx"],
        help=f"comma list of {', '.join(FORMATS)} (default onnx; the ONNX files are always written)",
    )
    p.add_argument("--batch", type=argument_type(parse_batch), default="dynamic",
                   help="'dynamic' (default) or a fixed batch size")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32")
    p.add_argument("--outputs", type=argument_type(parse_outputs), default=(LOGITS,),
                   help="the graph's outputs: logits (default) or logits,embedding (the pre-logits image "
                        "representation, forward_head(pre_logits=True), also in the Triton models)")
    p.add_argument("--text-tower", action="store_true",
                   help="also write the checkpoint's text tower (CLIP / SigLIP): <name>_text.onnx (input_ids -> "
                        "text_embeds), its tokenizer files and manifest, for POST /classify?labels=; adds the "
                        "embedding output")
    p.add_argument("--naflex", action="store_true",
                   help="also write the NaFlex graph of a SigLIP 2 NaFlex model: <name>_naflex.onnx (patches, "
                        "spatial_shapes, mask -> logits, embedding; any batch and patch budget)")
    p.add_argument("--out", default="exports", help="folder of the ONNX files and engines (default: exports)")
    p.add_argument("--repo", default="model_repo", help="Triton model repository (default: model_repo)")
    p.add_argument("--name", help="file name stem (default: the checkpoint's name and the resolution)")
    p.add_argument("--opset", type=int, default=18, help="ONNX opset, >= 17 (default 18)")
    p.add_argument(
        "--check-images",
        metavar="DIR",
        help="real images for the parity check (sub-folders named after labels give int8 accuracy)",
    )


def _add_tome_flags(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("token merging (ToMe)")
    t.add_argument("--tome", type=argument_type(parse_tome), metavar="R",
                   help="merge R tokens in every layer, in the graph (13), one R per layer (13,13,8) or R with "
                        "the schedule's inflection (16:-1); the default name gets _tome<R>; a dynamic-resolution "
                        "graph then takes sides from the smallest grid on which every merge is whole (its "
                        "manifest's token_merging.min_grid)")
    t.add_argument("--no-tome-prop-attn", dest="tome_prop_attn", action="store_false",
                   help="plain attention over merged tokens (default: proportional attention, for models "
                        "trained without ToMe)")


def _add_int8_flags(p: argparse.ArgumentParser) -> None:
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
        help=f"images that calibrate static int8 and OpenVINO's int8 (NNCF; --format openvino) (default: "
             f"--check-images; at most {MAX_CALIBRATION} are used)",
    )


def _add_reference_flags(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("monitoring (OOD scores and drift in the gateway)")
    m.add_argument(
        "--reference-images",
        metavar="DIR",
        help="in-distribution images the model's reference is built from (half fit, half calibrate) at the "
             "export's resolution (default: the checkpoint's own, when it applies to the export)",
    )


def _add_check_flags(p: argparse.ArgumentParser) -> None:
    """The explain graph's rollout, the parity bound, and --force."""
    p.add_argument("--head-fusion", choices=HEAD_FUSIONS, default="mean", help="explain graph rollout")
    p.add_argument("--discard-ratio", type=float, default=0.9, help="explain graph rollout (default 0.9)")
    p.add_argument("--tol", type=float, default=1e-4, help="fp32 parity: max |Δ logit| (default 1e-4)")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace existing ONNX files and engines (never a repository's versions: a re-export adds one)",
    )


def _add_tensorrt_flags(p: argparse.ArgumentParser) -> None:
    trt = p.add_argument_group("tensorrt")
    trt.add_argument(
        "--trt-precision",
        choices=TRT_PRECISIONS,
        default="fp16",
        help="engine precision (default fp16; normalisation layers stay fp32)",
    )


def _add_triton_flags(p: argparse.ArgumentParser) -> None:
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
        choices=ENSEMBLE_TARGETS,
        help="the classifier the <name>_ensemble model calls (default: trt with an engine, else onnx)",
    )
    tri.add_argument(
        "--triton-device",
        choices=TRITON_DEVICES,
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


def options(args: argparse.Namespace) -> ExportOptions:
    """The parsed flags as `ExportOptions` (OptionError for refused combinations)."""
    return ExportOptions(
        res=args.res, patch_size=args.patch_size, formats=tuple(args.format), batch=args.batch,
        precision=args.precision, out=args.out, repo=args.repo, name=args.name, opset=args.opset,
        check_images=args.check_images,
        calibration_images=args.calibration_images, int8_scheme=args.int8_scheme, head_fusion=args.head_fusion,
        discard_ratio=args.discard_ratio, tol=args.tol, force=args.force, trt_precision=args.trt_precision,
        max_batch=args.max_batch, instances=args.instances, triton_ensemble=args.triton_ensemble,
        triton_device=args.triton_device, queue_delay_us=args.queue_delay_us, max_queue=args.max_queue,
        outputs=args.outputs, text_tower=args.text_tower, tome=args.tome, tome_prop_attn=args.tome_prop_attn,
        reference_images=args.reference_images, naflex=args.naflex,
    )


def _say(msg: str) -> None:
    print(msg, flush=True)


def _error(msg: str) -> None:
    print(f"vit-export: error: {' '.join(msg.split())}", file=sys.stderr)


def _exit_code(result: ExportResult) -> int:
    """The outcome's one-line message on stderr, and its exit code."""
    if not result.graphs_ok:
        skipped = f"; {' and '.join(result.skipped)} skipped" if result.skipped else ""
        _error("parity check failed (table above); the files are written with the failure recorded in their "
               "sidecars" + skipped)
        return 1
    if result.engine is not None and not result.engine.parity.ok:
        _error(f"the engine {result.engine.path.name} failed its parity check against "
               f"{result.engine.parity.reference} (table above); it is written with the failure recorded in its "
               "sidecar")
        return 1
    if result.tensorrt_unavailable:
        print(f"vit-export: tensorrt: {result.tensorrt_unavailable}; the ONNX files are written", file=sys.stderr)
        return EXIT_NO_TENSORRT
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from vit_export.text_tower import NoTextTowerError

    args = build_parser().parse_args(argv)
    try:
        return _exit_code(export(args.checkpoint, options(args), progress=_say))
    except NoTextTowerError as e:  # a usage error: nothing written
        _error(str(e))
        return 2
    except UnsupportedOptionError as e:  # what the architecture cannot take: a usage error, nothing written
        _error(e.render(_flag))
        return 2
    except OptionError as e:
        _error(e.render(_flag))
    except OutputExistsError as e:
        _error(f"{e.path} exists; pass --force to replace it")
    except (ValueError, FileExistsError, FileNotFoundError, OSError, RuntimeError, ImportError) as e:
        # CheckpointError and bad sizes are ValueErrors with a message written for the user; RuntimeError:
        # a TensorRT build that failed; ImportError: an optional dependency (tritonclient, tensorrt) missing.
        _error(str(e))
    return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
