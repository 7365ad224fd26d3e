"""The export pipeline as one call: `vit_export.export(model, options) -> ExportResult`.

    import vit_export
    result = vit_export.export("model.safetensors", vit_export.ExportOptions(res=384, formats=("onnx", "triton")))
    result.onnx, result.explain_onnx, result.engine, result.triton, result.ok

Every export starts with the two ONNX graphs (`<name>.onnx`, `<name>_explain.onnx`, each with its manifest), each
checked against PyTorch with onnxruntime; then, when asked for and when those checks pass, a TensorRT engine
(checked against onnxruntime) and the Triton models (`vit_export.triton_repo`). `ExportOptions` holds every choice
and refuses bad ones (`OptionError`, a ValueError naming the option) before any work is done. Progress goes to a
callback (default: the `vit_export` logger at INFO). Checks that fail do not raise: the files are written with the
failure recorded in their manifests, the later formats are skipped, and `ExportResult.ok` is False.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from vit_export.memory import on_young_heap

from vit_serve.config import ViTConfig
from vit_serve.explain import DEFAULT_DISCARD_RATIO, DEFAULT_HEAD_FUSION, HEAD_FUSIONS
from vit_serve.fingerprint import weights_digest
from vit_serve.manifest import EMBEDDING, LOGITS, ExportManifest, Parity, TensorRTBuild
from vit_serve.model import VisionTransformer
from vit_serve.reference_sketch import Reference
from vit_serve.resolution import parse_resolution
from vit_serve.tome import TomeR, parse_tome

if TYPE_CHECKING:
    from vit_export.naflex_graph import WrittenNaFlex
    from vit_export.onnx_export import ExportedGraph
    from vit_export.openvino_ir import WrittenIR
    from vit_export.parity import ParityReport
    from vit_export.text_tower import WrittenTextTower
    from vit_export.triton_repo import WrittenModel

FORMATS = ("onnx", "openvino", "tensorrt", "triton")
PRECISIONS = ("fp32", "fp16", "int8")
SCHEMES = ("dynamic", "static")  # = vit_export.quantize.SCHEMES (not imported: it loads onnxruntime)
MAX_CALIBRATION = 256  # = vit_export.quantize.MAX_CALIBRATION
TRT_PRECISIONS = ("fp16", "bf16", "fp32")
ENSEMBLE_TARGETS = ("onnx", "trt", "py")  # = vit_export.triton_repo.ENSEMBLE_TARGETS
TRITON_DEVICES = ("cpu", "gpu")
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
MIN_OPSET = 17  # LayerNormalization

Resolution = tuple[int, int] | Literal["dynamic"]
Progress = Callable[[str], None]
log = logging.getLogger("vit_export")


class OptionError(ValueError):
    """A bad export option. The message names options as `<field>` in `template`; `render(spell)` spells them
    (the API: the field name; the CLI: its flag)."""

    def __init__(self, option: str, template: str) -> None:
        self.option, self.template = option, template
        super().__init__(self.render())

    def render(self, spell: Callable[[str], str] = str) -> str:
        return re.sub(r"<(\w+)>", lambda m: spell(m[1]), self.template)


class UnsupportedOptionError(OptionError):
    """An option this model's architecture cannot take (token merging with RoPE): refused, as a usage error, before
    anything is written (the CLI exits 2)."""


class OutputExistsError(FileExistsError):
    """An output that is already there, and `force` is off (nothing was written)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        super().__init__(f"{path} exists; pass force=True to replace it")


def parse_formats(text: str | Sequence[str]) -> tuple[str, ...]:
    """"triton, onnx" or ["triton", "onnx"] -> ("onnx", "triton"): known, once each, in pipeline order."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out = [str(f).strip().lower() for f in items if str(f).strip()]
    for f in out:
        if f not in FORMATS:
            raise OptionError("formats", f"unknown format {f!r}; known formats: {', '.join(FORMATS)}")
    return tuple(sorted(set(out), key=FORMATS.index)) or ("onnx",)


OUTPUTS = (LOGITS, EMBEDDING)


def parse_outputs(text: str | Sequence[str]) -> tuple[str, ...]:
    """"logits,embedding" -> ("logits", "embedding"): the logits graph's outputs (logits always among them)."""
    names = tuple(dict.fromkeys(v.strip() for v in (text.split(",") if isinstance(text, str) else text) if v.strip()))
    unknown = [n for n in names if n not in OUTPUTS]
    if unknown or LOGITS not in names:
        raise OptionError("outputs", f"<outputs> takes logits or logits,embedding (got {','.join(names) or 'none'})")
    return names


def parse_batch(value: str | int) -> int | Literal["dynamic"]:
    """"dynamic" or a positive integer (as an int or its digits)."""
    text = str(value).strip()
    if text.lower() == "dynamic":
        return "dynamic"
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise OptionError("batch", f"bad batch {value!r}; use 'dynamic' or a positive integer")


def parse_export_resolution(value: str | int | Sequence[int]) -> Resolution:
    """"dynamic", 384, "384", "224x320" (height x width) or (224, 320)."""
    if isinstance(value, str):
        if value.strip().lower() == "dynamic":
            return "dynamic"
        try:
            return parse_resolution(value)
        except ValueError as e:
            raise OptionError("res", f"{e}, or 'dynamic'") from None
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in pair):
        raise OptionError("res", f"bad resolution {value!r}; use e.g. 384, (384, 512) (height, width) or 'dynamic'")
    return int(pair[0]), int(pair[1])


def _choice(option: str, value: object, choices: Sequence[object]) -> None:
    if value not in choices:
        raise OptionError(option, f"<{option}> {value!r} is not one of {', '.join(map(repr, choices))}")


def _positive(option: str, value: object) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        raise OptionError(option, f"<{option}> must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ExportOptions:
    """Every choice of an export (the flags of `vit-export`, same names with `formats` for --format).

    res: None (the model's own resolution), "dynamic", 384, "224x320" or (224, 320) -> (H, W) or "dynamic".
    patch_size: FlexiViT's resize of the patch embedding to P x P (`VisionTransformer.set_patch_size`), at `res`
    when it is static (one resampling of the position embeddings, to res / P), else at the model's own; the
    manifest records both (`architecture.patch_size`, and the source's in `trained_patch_size`).
    formats: some of onnx, tensorrt, triton (a sequence or a comma list); the ONNX graphs are always written.
    batch: "dynamic" or a fixed N. precision: fp32, fp16 or int8 (onnxruntime quantization, `int8_scheme`).
    out: folder of the ONNX files and engines; repo: the Triton model repository; name: the file stem (default:
    the checkpoint's stem, or "vit" for a model object, then the resolution and a non-fp32 precision).
    check_images: real images for the parity checks; calibration_images: for static int8 (default check_images).
    reference_images: build the model's reference (`vit_serve.reference.reference_from_folder`: OOD scores and
    drift) from the images in this folder, at the export's resolution and token merging; without it the
    checkpoint's own reference is carried when it applies to the graph (same resolution, no token merging). A
    reference that scores the embedding adds the embedding output to the logits graph.
    head_fusion, discard_ratio: the explain graph's rollout; tol: fp32 parity bound on max |Δ logit|.
    outputs: the logits graph's outputs, "logits" or "logits,embedding" (the pre-logits representation, also in
    the Triton models and ensemble).
    text_tower: also write the checkpoint's text tower (`NAME_text.onnx`, its tokenizer and manifest,
    `vit_export.text_tower`), for POST /classify?labels=; the logits graph then has the embedding output too.
    naflex: also write the NaFlex graph of a SigLIP 2 NaFlex model (`NAME_naflex.onnx`: patches, spatial_shapes,
    mask -> logits, embedding; `vit_export.naflex_graph`), checked against `forward_patches` in onnxruntime.
    force: replace existing ONNX files and engines (never a repository's versions: a re-export adds one).
    tome: token merging in the graphs (ToMe, `VisionTransformer.set_token_merging`): r merged per layer (an int),
    one r per layer (a list), (r, inflection), or the CLI's text ("13", "13,13,8", "16:-1"); the default name
    gets "_tome<r>". tome_prop_attn: proportional attention (on: for models trained without ToMe).
    trt_precision: engine precision; max_batch: every Triton model's max_batch_size and the engine's largest
    batch; instances, triton_ensemble (the classifier the ensemble calls), triton_device, queue_delay_us,
    max_queue: the Triton models' settings.
    """

    res: Resolution | int | str | None = None
    patch_size: int | None = None
    formats: tuple[str, ...] | str = ("onnx",)
    batch: int | Literal["dynamic"] = "dynamic"
    precision: str = "fp32"
    out: Path | str = Path("exports")
    repo: Path | str = Path("model_repo")
    name: str | None = None
    opset: int = 18
    check_images: Path | str | None = None
    calibration_images: Path | str | None = None
    int8_scheme: str = "dynamic"
    head_fusion: str = DEFAULT_HEAD_FUSION
    discard_ratio: float = DEFAULT_DISCARD_RATIO
    tol: float = 1e-4
    force: bool = False
    trt_precision: str = "fp16"
    max_batch: int = 16
    instances: int = 1
    triton_ensemble: str | None = None
    triton_device: str = "cpu"
    queue_delay_us: int = 1000
    max_queue: int = 128
    outputs: tuple[str, ...] | str = (LOGITS,)
    text_tower: bool = False
    naflex: bool = False
    tome: TomeR | str | None = None
    tome_prop_attn: bool = True
    reference_images: Path | str | None = None

    def __post_init__(self) -> None:
        def norm(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if self.res is not None:
            norm("res", parse_export_resolution(self.res))
        norm("formats", parse_formats(self.formats))
        norm("batch", parse_batch(self.batch))
        norm("outputs", parse_outputs(self.outputs))
        if isinstance(self.tome, str):
            try:
                norm("tome", parse_tome(self.tome))
            except ValueError as e:
                raise OptionError("tome", f"<tome>: {e}") from None
        if self.text_tower and EMBEDDING not in self.outputs:  # labels are compared with the image embedding
            norm("outputs", (*self.outputs, EMBEDDING))
        for name in ("out", "repo", "check_images", "calibration_images", "reference_images"):
            if getattr(self, name) is not None:
                norm(name, Path(getattr(self, name)))
        _choice("precision", self.precision, PRECISIONS)
        _choice("int8_scheme", self.int8_scheme, SCHEMES)
        _choice("head_fusion", self.head_fusion, HEAD_FUSIONS)
        _choice("trt_precision", self.trt_precision, TRT_PRECISIONS)
        _choice("triton_device", self.triton_device, TRITON_DEVICES)
        if self.triton_ensemble is not None:
            _choice("triton_ensemble", self.triton_ensemble, ENSEMBLE_TARGETS)
        for name in ("max_batch", "instances", "max_queue"):
            _positive(name, getattr(self, name))
        if self.patch_size is not None:
            _positive("patch_size", self.patch_size)
        if not isinstance(self.opset, int) or self.opset < MIN_OPSET:
            raise OptionError("opset", f"<opset> {self.opset} is too old; LayerNormalization needs opset >= 17")
        if not (isinstance(self.discard_ratio, (int, float)) and 0.0 <= self.discard_ratio < 1.0):
            raise OptionError("discard_ratio", f"<discard_ratio> must be in [0, 1), got {self.discard_ratio!r}")
        if not (isinstance(self.tol, (int, float)) and math.isfinite(self.tol) and self.tol > 0):
            raise OptionError("tol", f"<tol> must be a positive number, got {self.tol!r}")
        if not (isinstance(self.queue_delay_us, int) and self.queue_delay_us >= 0):
            raise OptionError("queue_delay_us", f"<queue_delay_us> must be >= 0, got {self.queue_delay_us!r}")
        self._check_combinations()

    def _check_combinations(self) -> None:
        """Combinations refused before any work is done."""
        if "triton" in self.formats and self.batch != "dynamic":
            raise OptionError("batch", f"<formats> triton needs <batch> dynamic (got {self.batch}): Triton's "
                                       "dynamic batcher sends 1 to <max_batch> images per call")
        if "tensorrt" in self.formats and self.batch != "dynamic":
            raise OptionError("batch", f"<formats> tensorrt needs <batch> dynamic (got {self.batch}); <max_batch> "
                                       "sets its limit")
        if "tensorrt" in self.formats and self.precision == "int8":
            raise OptionError("precision", "<formats> tensorrt builds from an fp32 or fp16 graph; <precision> int8 "
                                           "is onnxruntime's quantization (choose the engine's precision with "
                                           "<trt_precision>)")
        if "tensorrt" in self.formats and self.precision == "fp16" and self.trt_precision != "fp16":
            raise OptionError("trt_precision", f"<precision> fp16 builds an fp16 engine from the fp16 graph, not "
                                               f"<trt_precision> {self.trt_precision}: drop one (an fp32 graph, "
                                               f"the default <precision>, builds any <trt_precision>)")
        if "tensorrt" in self.formats and self.res == "dynamic":
            raise OptionError("res", "<formats> tensorrt needs a fixed <res> (e.g. <res> 384): engines are built "
                                     "for one input size, and the dynamic graph's in-graph position-embedding "
                                     "resampling is not built into an engine")
        if "tensorrt" in self.formats and self.text_tower:
            raise OptionError("text_tower", "<text_tower> needs the embedding output, which TensorRT engines do not "
                                            "have: export it for onnx (and triton) without tensorrt")
        if "tensorrt" in self.formats and EMBEDDING in self.outputs:
            raise OptionError("outputs", "<formats> tensorrt builds engines with the logits output only: drop "
                                         "embedding from <outputs>, or export it for onnx / triton without "
                                         "tensorrt")
        if "tensorrt" in self.formats and self.reference_images is not None:
            raise OptionError("reference_images", "<reference_images> needs the embedding output, which TensorRT "
                                                  "engines do not have: export it for onnx (and triton) without "
                                                  "tensorrt")
        if "openvino" in self.formats and self.precision == "fp16":
            raise OptionError("precision", "<formats> openvino writes f32 weights (OpenVINO picks the inference "
                                           "precision: bf16 where the CPU has it) or int8 (<precision> int8, NNCF): "
                                           "drop <precision> fp16")
        if "openvino" in self.formats and self.precision == "int8" and not (
                self.calibration_images or self.check_images):
            raise OptionError("calibration_images", "<formats> openvino with <precision> int8 quantizes with NNCF, "
                                                    "which calibrates on images: pass <calibration_images> DIR (or "
                                                    "<check_images> DIR)")
        if self.calibration_images is not None and self.precision != "int8":
            raise OptionError("calibration_images", "<calibration_images> calibrates static int8: it needs "
                                                    "<precision> int8")
        if self.triton_ensemble == "trt" and "tensorrt" not in self.formats:
            raise OptionError("triton_ensemble", "<triton_ensemble> trt needs <formats> tensorrt (the ensemble "
                                                 "would have no engine)")
        if self.precision == "int8" and self.int8_scheme == "static" and not (
                self.calibration_images or self.check_images):
            raise OptionError("int8_scheme", "<int8_scheme> static needs images to calibrate on: pass "
                                             "<calibration_images> DIR (or <check_images> DIR)")


@dataclass(frozen=True)
class WrittenGraph:
    """An ONNX graph written: its file, its manifest, its parity check against PyTorch, for int8 the side by
    side measurement of the schemes (`vit_export.quantize.compare_schemes`' dict, or sizes only), and the
    manifest as written (`record`)."""

    path: Path
    manifest: Path
    parity: ParityReport
    int8: dict[str, Any] | None = None
    record: ExportManifest | None = None


@dataclass(frozen=True)
class WrittenEngine:
    """A TensorRT engine written: the plan, its manifest, its check against onnxruntime, the typed graph it was
    built from (TensorRT 11) and `vit_export.tensorrt_build.build_engine`'s result."""

    path: Path
    manifest: Path
    parity: Parity
    typed_graph: Path | None
    build: TensorRTBuild


@dataclass(frozen=True)
class ExportResult:
    """What `export` wrote and what its checks found.

    skipped: formats not written because a check failed. tensorrt_unavailable: why TensorRT could not run here
    (the engine is then not built; the rest is written).
    """

    options: ExportOptions
    name: str
    resolution: Resolution
    graph: WrittenGraph
    explain: WrittenGraph
    engine: WrittenEngine | None = None
    triton: tuple[WrittenModel, ...] = ()
    skipped: tuple[str, ...] = ()
    tensorrt_unavailable: str | None = None
    source_checkpoint: Path | None = None
    text: WrittenTextTower | None = None  # `text_tower`: NAME_text.onnx and its manifest
    naflex: WrittenNaFlex | None = None  # `naflex`: NAME_naflex.onnx and its parity
    openvino: WrittenIR | None = None  # `formats` openvino: NAME_openvino/NAME.xml, NAME_explain.xml

    @property
    def onnx(self) -> Path:
        return self.graph.path

    @property
    def explain_onnx(self) -> Path:
        return self.explain.path

    @property
    def manifests(self) -> tuple[Path, ...]:
        engine = () if self.engine is None else (self.engine.manifest,)
        ir = () if self.openvino is None else (self.openvino.manifest, self.openvino.explain_manifest)
        return (self.graph.manifest, self.explain.manifest, *ir, *engine)

    @property
    def graphs_ok(self) -> bool:
        return (self.graph.parity.ok and self.explain.parity.ok and (self.text is None or self.text.ok)
                and (self.naflex is None or self.naflex.ok) and (self.openvino is None or self.openvino.ok))

    @property
    def engine_ok(self) -> bool | None:
        return None if self.engine is None else self.engine.parity.ok

    @property
    def ok(self) -> bool:
        """Every check that ran passed."""
        return self.graphs_ok and self.engine_ok is not False


def find_images(folder: str | os.PathLike, option: str = "check_images") -> list[Path]:
    """The images under `folder` (recursively, sorted); OptionError naming `option` for a missing folder or one
    without images."""
    root = Path(folder)
    if not root.is_dir():
        raise OptionError(option, f"<{option}>: no such folder: {root}")
    images = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_EXTS and p.is_file())
    if not images:
        raise OptionError(option, f"<{option}>: no {'/'.join(e[1:] for e in IMAGE_EXTS)} images in {root}")
    return images


def resolution_tag(res: Resolution) -> str:
    """"dynamic", "384" or "224x320": the part of the default name that says the resolution."""
    return "dynamic" if res == "dynamic" else (f"{res[0]}" if res[0] == res[1] else f"{res[0]}x{res[1]}")


@dataclass(frozen=True)
class _Job:
    """One export's inputs, resolved once: the loaded model, the checkpoint it came from (None for a model
    object), the options, the resolution, the file stem, the check and calibration images, and the progress
    callback."""

    model: VisionTransformer
    checkpoint: Path | None
    opts: ExportOptions
    res: Resolution
    name: str
    images: list[Path] | None
    calibration: list[Path] | None
    say: Progress
    text: Any = None  # the checkpoint's `vit_serve.text.bundle.TextBundle` (`text_tower`)
    reference: Reference | None = None  # what the logits graph's manifest carries (`_reference`)
    source: ViTConfig | None = None  # the model's config before the export resized it (`patch_size`)
    weights: str | None = None  # `vit_serve.fingerprint.weights_digest` of the model as loaded, before resizing

    @property
    def targets(self) -> tuple[Path, Path]:
        """The logits graph and the explain graph this export writes."""
        out = self.opts.out
        return out / f"{self.name}.onnx", out / f"{self.name}_explain.onnx"


@on_young_heap
def export(model: VisionTransformer | str | os.PathLike, options: ExportOptions | None = None, *,
           progress: Progress | None = None) -> ExportResult:
    """Export `model` (a loaded VisionTransformer, or a checkpoint path: loaded with `vit_serve.checkpoints.load`,
    and recorded with its sha256 in the manifests) as `options` say. See the module docstring.

    Raises OptionError (bad options, image folders missing or empty), OutputExistsError (an output exists and
    not `options.force`; nothing is written), CheckpointError (a ValueError: an unreadable checkpoint), and from
    the later formats RuntimeError (a failed TensorRT build), ImportError (an optional dependency missing) or
    ValueError (a repository that refuses the model). Failed parity checks are in the result, not raised.
    """
    job = _job(model, options or ExportOptions(), progress or log.info)
    graph, explain, ir = _write_graphs(job)
    result = ExportResult(job.opts, job.name, job.res, graph, explain, source_checkpoint=job.checkpoint,
                          text=_write_text_tower(job), naflex=_write_naflex(job, graph), openvino=ir)
    later = tuple(f for f in job.opts.formats if f not in ("onnx", "openvino"))
    if not result.graphs_ok:
        return dataclasses.replace(result, skipped=later)
    if "tensorrt" in job.opts.formats:
        engine, reason = _tensorrt(job, graph)
        result = dataclasses.replace(result, engine=engine, tensorrt_unavailable=reason)
    if result.engine_ok is False:
        if "triton" in job.opts.formats:
            job.say("(the engine failed its parity check: the Triton repository is not written)")
            result = dataclasses.replace(result, skipped=("triton",))
        return result
    if "triton" in job.opts.formats:
        result = dataclasses.replace(result, triton=_triton(job, result.engine, result.openvino))
    return result


def _job(model: VisionTransformer | str | os.PathLike, opts: ExportOptions, say: Progress) -> _Job:
    """The model loaded, the images found, the resolution and name settled, and the outputs checked (nothing is
    written yet)."""
    from vit_serve.checkpoints import load
    from vit_serve.manifest import manifest_path

    images = find_images(opts.check_images) if opts.check_images else None
    calibration = (find_images(opts.calibration_images, "calibration_images") if opts.calibration_images
                   else images)
    checkpoint = None if isinstance(model, VisionTransformer) else Path(model)
    if checkpoint is not None:
        model = load(checkpoint)
    assert isinstance(model, VisionTransformer)
    source = model.cfg
    weights = weights_digest(model.state_dict())  # before --patch-size resizes them: the fingerprint's weights
    if checkpoint is None and (opts.patch_size is not None or opts.tome is not None):
        import copy

        model = copy.deepcopy(model)  # the caller's object stays as it was
    if opts.patch_size is not None:
        _set_patch_size(model, opts, say)
    elif isinstance(opts.res, tuple):
        model.check_size(*opts.res)  # ValueError naming the nearest valid sizes
    res: Resolution = opts.res or (int(model.cfg.img_size[0]), int(model.cfg.img_size[1]))  # type: ignore[assignment]
    if opts.tome is not None:
        _set_token_merging(model, opts)
    name = opts.name or f"{checkpoint.stem if checkpoint else 'vit'}_{resolution_tag(res)}" + (
        "" if opts.patch_size is None else f"_p{opts.patch_size}") + (
        "" if opts.precision == "fp32" else f"_{opts.precision}") + tome_tag(opts.tome)
    text = _text_bundle(model, checkpoint) if opts.text_tower else None
    reference = _reference(model, opts, res, say)
    if reference is not None and reference.needs_embedding and EMBEDDING not in opts.outputs:
        opts = dataclasses.replace(opts, outputs=(*opts.outputs, EMBEDDING))
    job = _Job(model, checkpoint, opts, res, name, images, calibration, say, text, reference, source, weights)
    existing = [p for t in job.targets for p in (t, manifest_path(t)) if p.exists()]
    if text is not None:
        from vit_export.text_tower import text_targets

        existing += [p for p in text_targets(opts.out, name) if p.exists()]
    if opts.naflex:
        if "max_patches" not in model.cfg.extra:
            raise OptionError("naflex", "<naflex> needs a NaFlex model (SigLIP 2 NaFlex, e.g. a transformers siglip2 "
                                        "folder); this one takes fixed-size images")
        existing += [p for p in (naflex_target(opts.out, name),) if p.exists()]
    if "openvino" in opts.formats:
        from vit_export.openvino_ir import bin_path, ir_targets

        existing += [p for x in ir_targets(opts.out, name) for p in (x, bin_path(x), manifest_path(x)) if p.exists()]
    if existing and not opts.force:
        raise OutputExistsError(existing[0])
    return job


def naflex_target(out: Path, name: str) -> Path:
    """Where `naflex` writes its graph."""
    return Path(out) / f"{name}_naflex.onnx"


def _write_naflex(job: _Job, graph: WrittenGraph) -> WrittenNaFlex | None:
    """NAME_naflex.onnx (`naflex`), checked against `forward_patches` in onnxruntime, paired with `graph` (the
    logits graph's sha256 in its metadata)."""
    if not job.opts.naflex:
        return None
    from vit_export.naflex_graph import write_naflex

    from vit_serve.manifest import file_sha256

    job.say(f"exporting the NaFlex graph (patch budget {job.model.cfg.max_patches}, opset "
            f"{job.opts.opset}) ...")
    job.opts.out.mkdir(parents=True, exist_ok=True)
    sha = graph.record.file_sha256 if graph.record is not None else file_sha256(graph.path)
    written = write_naflex(job.model, naflex_target(job.opts.out, job.name), job.opts.opset, job.opts.tol,
                           job.opts.force, sha)
    job.say(f"  {written.path.name}: max |Δ| {written.max_abs_diff:.2e} against forward_patches "
            f"({'ok' if written.ok else 'FAILED'}, tol {written.tol:g})")
    return written


def _reference(model: VisionTransformer, opts: ExportOptions, res: Resolution, say: Progress) -> Reference | None:
    """The reference the logits graph's manifest carries: built from `opts.reference_images` as the graph computes
    (at its resolution, with its token merging), else the model's own when it was made for the graph as exported,
    else None (and the reason said)."""
    static = res if isinstance(res, tuple) else None
    if opts.reference_images is not None:
        from vit_serve.reference import reference_from_folder

        if static is not None and static != tuple(model.cfg.img_size):
            import copy

            model = copy.deepcopy(model)
            model.set_resolution(*static)
        say(f"building the reference from {opts.reference_images} ...")
        try:
            ref = reference_from_folder(model, opts.reference_images)
        except (FileNotFoundError, NotADirectoryError, ValueError) as e:
            raise OptionError("reference_images", f"<reference_images>: {e}") from None
        say(f"  reference: {ref.describe()}")
        return ref
    ref = model.reference
    why = None
    if ref is None:
        return None
    if static is not None and static != tuple(model.cfg.img_size):
        why = f"it was made at {model.cfg.img_size[0]}x{model.cfg.img_size[1]}"
    elif opts.tome is not None:
        why = "it was made without token merging"
    elif "tensorrt" in opts.formats:
        why = "TensorRT engines have no embedding output"
    if why:
        say(f"(the checkpoint's reference is not carried: {why}; pass <reference_images> DIR to build one)")
        return None
    return ref


def _set_patch_size(model: VisionTransformer, opts: ExportOptions, say: Progress) -> None:
    """`opts.patch_size` patches (FlexiViT), at `opts.res` when static; OptionError for a patch that does not
    divide the resolution."""
    had_reference, old = model.reference is not None, model.cfg.patch_size
    static = opts.res if isinstance(opts.res, tuple) else None
    try:
        model.set_patch_size(opts.patch_size, static)  # type: ignore[arg-type]
    except ValueError as e:
        raise OptionError("patch_size", f"<patch_size>: {e}") from None
    if had_reference and opts.reference_images is None and opts.patch_size != old:
        say(f"(the checkpoint's reference is not carried: it was made with {old}x{old} patches; pass "
            "<reference_images> DIR to build one)")


def _set_token_merging(model: VisionTransformer, opts: ExportOptions) -> None:
    """`opts.tome` set; OptionError for an r that does not fit the model's depth; UnsupportedOptionError for a
    RoPE model (a merged token has no one position to rotate by)."""
    if model.rope is not None and opts.tome not in (0, [0]):
        raise UnsupportedOptionError("tome", "<tome>: token merging is not supported with RoPE: a merged token "
                                             "has no one position to rotate by (export without <tome>)")
    try:
        model.set_token_merging(opts.tome, prop_attn=opts.tome_prop_attn)  # type: ignore[arg-type]
    except (ValueError, TypeError) as e:
        raise OptionError("tome", f"<tome>: {e}") from None


def tome_tag(tome: TomeR | str | None) -> str:
    """The default name's token-merging part: "" (none), "_tome13", "_tome16i-1" (r with an inflection),
    "_tome13-13-8" (per layer)."""
    if tome is None or tome == 0:
        return ""
    if isinstance(tome, tuple):
        return f"_tome{tome[0]}i{tome[1]:g}"
    if isinstance(tome, list):
        return "_tome" + "-".join(map(str, tome))
    return f"_tome{tome}"


def _text_bundle(model: VisionTransformer, checkpoint: Path | None) -> Any:
    """The checkpoint's text tower (NoTextTowerError without one), its width checked against the image
    embedding's."""
    from vit_export.text_tower import NoTextTowerError, load_text_bundle

    bundle = load_text_bundle(checkpoint)
    if bundle.config.embed_dim != model.cfg.embed_dim_out:
        raise NoTextTowerError(f"{checkpoint}: its text tower embeds into {bundle.config.embed_dim} dimensions, its "
                               f"image model into {model.cfg.embed_dim_out}; they are not one CLIP / SigLIP model")
    return bundle


def _write_text_tower(job: _Job) -> WrittenTextTower | None:
    """NAME_text.onnx, its tokenizer and manifest (`text_tower`), checked against the torch tower."""
    if job.text is None:
        return None
    from vit_export.text_tower import export_text_tower

    job.say(f"exporting the text tower (context length {job.text.config.context_length}, opset {job.opts.opset}) ...")
    written = export_text_tower(job.text, job.checkpoint, job.opts.out, job.name, family=job.model.cfg.family,
                                opset=job.opts.opset, tol=job.opts.tol, overwrite=job.opts.force)
    job.say(f"  parity: text_embeds max |Δ| {written.max_abs_err:.2e} (onnxruntime vs torch, tol {written.tol:g}): "
            f"{'ok' if written.ok else 'FAILED'}")
    job.say(f"wrote {written.path}, {written.manifest.name} and {written.tokenizer_dir.name}/")
    return written


def _write_graphs(job: _Job) -> tuple[WrittenGraph, WrittenGraph, WrittenIR | None]:
    """Both ONNX graphs, each exported, checked, (int8: quantized) and described by its manifest; then, with
    `formats` openvino and both checks passed, their IR (from the fp32 graphs, which int8 keeps in `tmp`)."""
    with tempfile.TemporaryDirectory(prefix="vit-export-") as tmp:
        graph, explain = (_write_graph(job, target, kind == "explain", Path(tmp))
                          for kind, target in zip(("graph", "explain"), job.targets, strict=True))
        ir = None
        if "openvino" in job.opts.formats and graph.parity.ok and explain.parity.ok:
            ir = _write_ir(job, graph, explain, Path(tmp))
        return graph, explain, ir


def _write_ir(job: _Job, graph: WrittenGraph, explain: WrittenGraph, tmp: Path) -> WrittenIR:
    """`formats` openvino: both graphs' IR (`vit_export.openvino_ir.write_ir`) from the fp32 graphs (int8 keeps
    them in `tmp`), calibrated (int8) on at most MAX_CALIBRATION of the calibration images."""
    from vit_export.openvino_ir import GraphWritten, IRJob, write_ir

    opts = job.opts
    picked = None if job.calibration is None else _spread(job.calibration, MAX_CALIBRATION)
    note = None if picked is None else f"{len(picked)} images of {opts.calibration_images or opts.check_images}"
    labels = None if job.images is None else _labels_of(job.images, job.model.labels)
    ir_job = IRJob(job.model, opts.out, job.name, job.res, opts.precision, opts.force, opts.tol, job.images, labels,
                   picked, note, job.say)
    fp32 = [tmp / t.name if opts.precision == "int8" else t for t in job.targets]
    written = [GraphWritten(g.path, g.record, g.parity) for g in (graph, explain)]  # type: ignore[arg-type]
    return write_ir(ir_job, written[0], written[1], fp32[0], fp32[1])


def _write_graph(job: _Job, target: Path, explain: bool, tmp: Path) -> WrittenGraph:
    """Export one graph to `target` (int8: export fp32 into `tmp`, quantize it into place), check it against
    PyTorch and write its manifest."""
    from vit_export.memory import release_memory
    from vit_export.onnx_export import export_graph
    from vit_export.parity import check_parity
    from vit_export.sidecar import build_sidecar

    from vit_serve.manifest import Int8Quantization, write_manifest

    opts, say = job.opts, job.say
    onnx_precision = "fp16" if opts.precision == "fp16" else "fp32"
    dest = tmp / target.name if opts.precision == "int8" else target
    say(f"exporting {'explain graph' if explain else 'graph'} ({resolution_tag(job.res)}, batch {opts.batch}, "
        f"{onnx_precision}, opset {opts.opset}) ...")
    t0 = time.perf_counter()
    exported = export_graph(job.model, dest, res=job.res, batch=opts.batch, opset=opts.opset, explain=explain,
                            head_fusion=opts.head_fusion, discard_ratio=opts.discard_ratio,
                            precision=onnx_precision, overwrite=opts.force,
                            embedding=not explain and EMBEDDING in opts.outputs)
    say(f"  exported in {time.perf_counter() - t0:.1f}s; checking parity with onnxruntime ...")
    release_memory()  # the export's protos and sessions, before the check runs the graph
    report = check_parity(job.model, dest, job.images, tol=opts.tol, info=exported.info)
    say(report.table())
    int8_report = int8 = None
    if opts.precision == "int8":
        int8_report = _quantize(job, exported, target)
        int8 = Int8Quantization(opts.int8_scheme, int8_report,
                                f"parity of the fp32 graph before {opts.int8_scheme} int8 quantization")
    record = build_sidecar(job.model, target, job.checkpoint, report.to_dict(), int8, info=exported.info,
                           io=exported.io, reference=None if explain else job.reference, trained=job.source,
                           weights=job.weights)
    manifest = write_manifest(target, record, overwrite=opts.force)
    say(f"wrote {target} and {manifest.name}")
    return WrittenGraph(target, manifest, report, int8_report, record)


def _tensorrt(job: _Job, graph: WrittenGraph) -> tuple[WrittenEngine | None, str | None]:
    """Build and check the engine from the logits graph: (engine, None), its parity in `engine.parity` (table
    sent to `say`, manifest written with the result); (None, reason) when TensorRT cannot run here."""
    from vit_export.sidecar import engine_sidecar
    from vit_export.tensorrt_build import build_engine, tensorrt_version, unavailable_reason
    from vit_export.tensorrt_compat import check_supported, plan_build

    from vit_serve.manifest import manifest_path, write_manifest

    reason = unavailable_reason()
    if reason is None:
        try:
            check_supported(tensorrt_version())
        except ValueError as e:
            reason = str(e)
    if reason:
        return None, reason
    opts, say, onnx_path = job.opts, job.say, graph.path
    plan_dir = opts.out / f"{job.name}_tensorrt"
    version = tensorrt_version()
    graph_precision = "fp16" if opts.precision == "fp16" else "fp32"
    precision = opts.trt_precision  # an fp16 graph with another engine precision is refused by ExportOptions
    plan = plan_build(version, precision, graph_precision)
    source = onnx_path
    if plan.graph_precision != graph_precision:
        from vit_export.typed_graph import export_typed

        source = plan_dir / f"{onnx_path.stem}_{plan.graph_precision}.onnx"
        say(f"exporting the {plan.graph_precision}-typed graph TensorRT {version} builds from (LayerNorm in fp32) ...")
        export_typed(job.model, source, plan.graph_precision, res=job.res, batch=opts.batch, opset=opts.opset,
                     overwrite=opts.force)
    hi = opts.max_batch
    say(f"building the TensorRT engine ({precision}, batch 1..{hi}) ...")
    build = build_engine(source, plan_dir, precision=precision, batch=(1, max(1, hi // 2), hi), cache_dir=opts.out,
                         progress=say, check_onnx=onnx_path, overwrite=opts.force)
    # `vit-serve serve <plan>` reads the ONNX graph's contract in the engine's manifest (<plan stem>.json).
    built_from = None if source == onnx_path else str(source.relative_to(plan_dir.parent))
    assert graph.record is not None  # `_write_graph` keeps the manifest it wrote
    manifest = engine_sidecar(graph.record, build, built_from)
    written = write_manifest(build.path, manifest, overwrite=opts.force)
    say(f"wrote {build.path} and {manifest_path(build.path).name}")
    assert manifest.tensorrt is not None and manifest.tensorrt.parity is not None
    report_engine_parity(manifest.tensorrt.parity, build.file, say)
    return WrittenEngine(Path(build.path), written, manifest.tensorrt.parity,
                         None if source == onnx_path else source, manifest.tensorrt), None


def report_engine_parity(parity: Parity | dict, engine: str, progress: Progress | None = None) -> bool:
    """Send the engine's parity table (`vit_export.parity`'s layout) to `progress`; True when it passed.

    `parity`: the build's `TensorRTBuild.parity`, or what `tensorrt_build.compare_runtimes` returns.
    """
    from vit_export.parity import ParityReport, ParityRow

    check = parity if isinstance(parity, Parity) else Parity.from_dict(parity, f"the parity check of {engine}")
    names = [f.name for f in dataclasses.fields(ParityRow)]  # fields the engine check lacks (rollout's) stay None
    rows = [ParityRow(**{n: r.get(n) for n in names}) for r in check.rows]
    report = ParityReport(onnx_path=engine, precision=check.precision, criteria=check.criteria, rows=rows)
    lines = report.table().splitlines()
    # ParityReport's header names onnxruntime vs PyTorch; here the candidate is the engine, the reference ORT.
    lines[0] = (f"parity: {engine} ({check.candidate or 'engine'} {check.precision} vs "
                f"{check.reference}; {check.criteria})")
    (progress or log.info)("\n".join(lines))
    return report.ok


def _triton(job: _Job, engine: WrittenEngine | None, ir: WrittenIR | None = None) -> tuple[WrittenModel, ...]:
    from vit_export.triton_repo import write_repository

    opts, say = job.opts, job.say
    ensemble = opts.triton_ensemble
    if ensemble == "trt" and engine is None:
        ensemble = "onnx"
        say("(no TensorRT engine: the ensemble calls the onnxruntime model)")
    written = write_repository(
        *job.targets,
        opts.repo,
        job.name,
        None if engine is None else engine.build,
        max_batch=opts.max_batch,
        instances=opts.instances,
        ensemble_target=ensemble,
        onnx_device=opts.triton_device,
        queue_delay_us=opts.queue_delay_us,
        max_queue=opts.max_queue,
        openvino=None if ir is None else ir.path,
    )
    say(f"Triton model repository {opts.repo}:")
    for w in written:
        say(f"  {w.model:<28} version {w.version}  {w.path}")
    return tuple(written)


def _labels_of(images: list[Path], labels: list[str] | None) -> list[int] | None:
    """Class indices from parent folder names, when every image sits in a folder named after a label."""
    if not labels:
        return None
    index = {name: i for i, name in enumerate(labels)}
    found = [index.get(p.parent.name) for p in images]
    return None if any(i is None for i in found) else found  # type: ignore[return-value]


def _quantize(job: _Job, fp32: ExportedGraph, target: Path) -> dict:
    """Write the chosen int8 scheme of the `fp32` graph to `target`; measure every scheme that can be built here
    side by side."""
    import torch
    from vit_export.quantize import compare_schemes, quantize_int8, quantize_static_int8

    from vit_serve.checkpoints.io import atomic_write
    from vit_serve.preprocess import PreprocessConfig, preprocess_batch

    model, opts, say, images, calibration = job.model, job.opts, job.say, job.images, job.calibration
    fp32_path, res = fp32.path, fp32.info.resolution
    h, w = model.cfg.img_size if res in ("dynamic", None) else res
    pre = (model.preprocess_cfg or PreprocessConfig(input_size=model.cfg.img_size)).with_size(h, w)
    batch = opts.batch if isinstance(opts.batch, int) else 8
    paths = {"dynamic": fp32_path.with_name(f"{fp32_path.stem}_dynamic.onnx")}
    if calibration:
        paths["static"] = fp32_path.with_name(f"{fp32_path.stem}_static.onnx")
    note = None
    for scheme, path in paths.items():
        if scheme == "dynamic":
            say("  quantizing to int8, dynamic (QUInt8 MatMul/Gemm weights per channel) ...")
            quantize_int8(fp32_path, path, overwrite=True)
        else:
            assert calibration is not None
            picked = _spread(calibration, MAX_CALIBRATION)
            note = f"{len(picked)} images of {opts.calibration_images or opts.check_images}"
            say(f"  quantizing to int8, static (QDQ, calibrated on {note}) ...")
            quantize_static_int8(fp32_path, path, preprocess_batch(picked, pre).numpy(), batch=batch, overwrite=True)
    chosen = paths[opts.int8_scheme]
    if isinstance(opts.batch, int) and opts.batch != 1:
        say("  (fixed batch != 1: int8 speed/agreement not measured at batch 1)")
        sizes = {f"{k}_mb": p.stat().st_size / 1e6 for k, p in paths.items()}
        out = {"fp32_mb": fp32_path.stat().st_size / 1e6, **sizes}
    else:
        x = torch.randn(16, 3, h, w, generator=torch.Generator().manual_seed(0))
        labels = None
        if images:
            x = preprocess_batch(images, pre)
            labels = _labels_of(images, model.labels)
        rep = compare_schemes(fp32_path, paths, x.numpy(), labels, calibration=note)
        say(rep.table())
        out = rep.to_dict()
    atomic_write(target, lambda tmp: shutil.copyfile(chosen, tmp), overwrite=opts.force)
    return out


def _spread(items: list[Path], n: int) -> list[Path]:
    """At most n items, evenly spaced (every class folder of a sorted tree gets its share)."""
    if len(items) <= n:
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


__all__ = ["ExportOptions", "ExportResult", "OptionError", "OutputExistsError", "WrittenEngine", "WrittenGraph",
           "export", "report_engine_parity"]
