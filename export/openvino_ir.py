"""OpenVINO IR (`.xml` + `.bin`) of an exported ONNX graph: f32 as converted, or int8 by NNCF's post-training
quantization, and what int8 costs against fp32.

    <out>/<name>_openvino/<name>.xml, .bin, .json            the logits graph (int8 with --precision int8)
    <out>/<name>_openvino/<name>_explain.xml, .bin, .json    the explain graph (always f32: see below)

The IR gets its own folder because its manifest (`<name>.json`, format "openvino", the .xml's sha256, the .bin's in
`openvino.bin_sha256`) would otherwise be the ONNX graph's. The weights are stored as they are (f32, no fp16
compression): the precision it runs at is the runtime's choice (OpenVINO's CPU plugin picks bf16 where the CPU has
it), the IR only fixes what was quantized.

int8 (`quantize_ir`): NNCF's post-training quantization with `ModelType.TRANSFORMER` (its transformer preset:
LayerNorm, softmax and GELU stay in higher precision; SmoothQuant on the linear layers' inputs), calibrated on
real images preprocessed as the model's inputs. The explain graph stays f32: its rollout zeroes each layer's
attention below a quantile, a discontinuous function that quantized attention would move, and it is the path that
explains, not the path that has to be fast. `compare_ir` measures the int8 IR against the fp32 graph (both in
OpenVINO at f32 inference precision, so the numbers are the quantization's, not bf16's): top-1 agreement, the
mean cosine of the logits (and the embedding), accuracy with labels, ms/img at batch 1, judged by
`vit_serve.accuracy_bounds` (int8: >= 98% agreement, cosine >= 0.99).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from vit_serve import signal_stack
from vit_serve.accuracy_bounds import AccuracyCheck, judge
from vit_serve.manifest import EMBEDDING, LOGITS, PIXEL_VALUES

if TYPE_CHECKING:
    from vit_export.parity import ParityReport

    from vit_serve.manifest import ExportManifest
    from vit_serve.model import VisionTransformer

IR_SUFFIX = "_openvino"
IR_PRECISIONS = ("fp32", "int8")


def ir_folder(out: str | os.PathLike, name: str) -> Path:
    """Where `vit-export --format openvino` writes the IR of the export `name`."""
    return Path(out) / f"{name}{IR_SUFFIX}"


def bin_path(xml_path: str | os.PathLike) -> Path:
    return Path(xml_path).with_suffix(".bin")


def _save(model, xml_path: Path, overwrite: bool) -> Path:
    """Save an `ov.Model` as xml_path (+ .bin), both or neither: written into a hidden folder beside them, then
    renamed into place (.bin first: a reader that finds the .xml finds its weights)."""
    import openvino as ov

    xml_path = Path(xml_path)
    targets = (bin_path(xml_path), xml_path)
    if not overwrite and any(p.exists() for p in targets):
        raise FileExistsError(f"{next(p for p in targets if p.exists())} exists; pass --force to replace it")
    xml_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{xml_path.stem}.", dir=xml_path.parent))
    try:
        ov.save_model(model, str(tmp / xml_path.name), compress_to_fp16=False)
        for target in targets:
            os.replace(tmp / target.name, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return xml_path


def convert_ir(onnx_path: str | os.PathLike, xml_path: str | os.PathLike, overwrite: bool = False) -> Path:
    """The ONNX graph as IR (weights as they are), written to `xml_path` and its .bin."""
    import openvino as ov

    return _save(ov.convert_model(str(onnx_path)), Path(xml_path), overwrite)


def quantize_ir(onnx_path: str | os.PathLike, xml_path: str | os.PathLike, calibration: np.ndarray,
                overwrite: bool = False) -> Path:
    """int8 IR of the fp32 ONNX graph by NNCF post-training quantization (transformer preset), its activation
    ranges from `calibration` ([N, 3, H, W] float32, preprocessed as the model's inputs; one image per step)."""
    import nncf
    import openvino as ov

    x = np.ascontiguousarray(calibration, dtype=np.float32)
    if x.ndim != 4 or not len(x):
        raise ValueError(f"calibration needs a non-empty [N, 3, H, W] batch, got shape {x.shape}")
    model = ov.convert_model(str(onnx_path))
    data = nncf.Dataset([{PIXEL_VALUES: x[i : i + 1]} for i in range(len(x))])
    with signal_stack.kept():  # NNCF compiles the model to collect its statistics (see vit_serve.signal_stack)
        quantized = nncf.quantize(model, data, model_type=nncf.ModelType.TRANSFORMER, subset_size=len(x))
    return _save(quantized, Path(xml_path), overwrite)


class IRRunner:
    """A graph (.onnx or .xml) compiled by OpenVINO's CPU plugin at f32 inference precision; `run(x)` -> {output
    name: array}."""

    def __init__(self, path: str | os.PathLike, threads: int = 2) -> None:
        from vit_serve.runtime.backends.openvino import compile_model

        self.compiled = compile_model(path, {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": threads})
        self.names = [o.get_any_name() for o in self.compiled.outputs]

    def run(self, x: np.ndarray) -> dict[str, np.ndarray]:
        result = self.compiled({PIXEL_VALUES: x})
        return {n: np.asarray(result[o]) for n, o in zip(self.names, self.compiled.outputs, strict=True)}


def _run_all(path: Path, x: np.ndarray, threads: int, warmup: int = 2) -> tuple[dict[str, np.ndarray], float]:
    """Every output of `path` on `x`, one image at a time, and ms/img."""
    runner = IRRunner(path, threads)
    for i in range(min(warmup, len(x))):
        runner.run(x[i : i + 1])
    outs: list[dict[str, np.ndarray]] = []
    t0 = time.perf_counter()
    for i in range(len(x)):
        outs.append(runner.run(x[i : i + 1]))
    ms = (time.perf_counter() - t0) * 1000 / len(x)
    return {k: np.concatenate([o[k] for o in outs]) for k in runner.names}, ms


def _size_mb(path: Path) -> float:
    extra = bin_path(path) if path.suffix == ".xml" else None
    return (path.stat().st_size + (extra.stat().st_size if extra and extra.is_file() else 0)) / 1e6


@dataclass(frozen=True)
class IRRow:
    """One graph: size MB (.xml + .bin), ms/img at batch 1, top-1 accuracy (with labels)."""

    graph: str
    mb: float
    ms: float
    accuracy: float | None = None


@dataclass(frozen=True)
class IRReport:
    """fp32 and the int8 IR on the same `n` inputs, and the int8 IR judged against fp32 (`check`)."""

    n: int
    threads: int
    rows: tuple[IRRow, IRRow]
    check: AccuracyCheck
    calibration: str | None = None

    def table(self) -> str:
        acc = lambda a: "-" if a is None else f"{a:.1%}"  # noqa: E731
        lines = [f"OpenVINO int8 (NNCF, transformer preset; CPU f32 inference, {self.threads} threads, batch 1; "
                 f"{self.n} inputs" + (f"; calibrated on {self.calibration})" if self.calibration else ")"),
                 f"{'graph':<10} {'size MB':>8} {'ms/img':>8} {'speed-up':>9} {'top-1 acc':>10}"]
        base = self.rows[0]
        for r in self.rows:
            lines.append(f"{r.graph:<10} {r.mb:>8.2f} {r.ms:>8.2f} {base.ms / r.ms:>8.2f}x {acc(r.accuracy):>10}")
        lines.append(f"against fp32: {self.check.describe()}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"n": self.n, "threads": self.threads, "rows": [asdict(r) for r in self.rows],
                "check": self.check.to_dict(), "calibration": self.calibration}


def compare_ir(fp32_path: str | os.PathLike, int8_xml: str | os.PathLike, inputs: np.ndarray,
               labels: Sequence[int] | None = None, threads: int = 2, calibration: str | None = None) -> IRReport:
    """The int8 IR against the fp32 graph on `inputs` [N, 3, H, W]: sizes, speed, accuracy, and top-1 agreement
    and cosine (logits, and the embedding when the graph has one) judged by the int8 bounds."""
    x = np.ascontiguousarray(inputs, dtype=np.float32)
    ref, ms_ref = _run_all(Path(fp32_path), x, threads)
    got, ms_got = _run_all(Path(int8_xml), x, threads)
    emb = (ref[EMBEDDING], got[EMBEDDING]) if EMBEDDING in ref and EMBEDDING in got else None
    check = judge(ref[LOGITS], got[LOGITS], "int8", emb)
    y = None if labels is None else np.asarray(labels)
    acc = lambda out: None if y is None else float((out[LOGITS].argmax(-1) == y).mean())  # noqa: E731
    rows = (IRRow("fp32", _size_mb(Path(fp32_path)), ms_ref, acc(ref)),
            IRRow("int8 IR", _size_mb(Path(int8_xml)), ms_got, acc(got)))
    return IRReport(len(x), threads, rows, check, calibration)


@dataclass(frozen=True)
class IRJob:
    """What `write_ir` needs of an export: the model, where and under which name, the precision, the parity
    bound, the check images (and their labels), the calibration images (at most `MAX_CALIBRATION`, with what
    they are, for the report) and the progress callback."""

    model: VisionTransformer
    out: Path
    name: str
    res: tuple[int, int] | str
    precision: str
    force: bool
    tol: float
    images: list[Path] | None
    labels: list[int] | None
    calibration: list[Path] | None
    calibration_note: str | None
    say: Callable[[str], None]


@dataclass(frozen=True)
class GraphWritten:
    """An ONNX graph as `write_ir` reads it: its file, its manifest as written, its parity check."""

    path: Path
    record: ExportManifest
    parity: ParityReport


@dataclass(frozen=True)
class WrittenIR:
    """The OpenVINO IR of both graphs: the logits graph's .xml (f32, or int8 by NNCF) and manifest, its parity
    (f32: the IR in OpenVINO against PyTorch; int8: the fp32 ONNX graph's), NNCF's int8 measurement against fp32
    (`IRReport.to_dict`, None for f32), and the explain graph's (always f32)."""

    path: Path
    manifest: Path
    parity: ParityReport
    explain: Path
    explain_manifest: Path
    explain_parity: ParityReport
    int8: dict | None = None

    @property
    def ok(self) -> bool:
        return self.parity.ok and self.explain_parity.ok


def ir_targets(out: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """The logits graph's and the explain graph's .xml that `vit-export --format openvino` writes."""
    folder = ir_folder(out, name)
    return folder / f"{name}.xml", folder / f"{name}_explain.xml"


def _manifest(written: GraphWritten, xml: Path, parity: ParityReport, int8: dict | None, force: bool) -> Path:
    """The IR's manifest: the ONNX graph's, for the .xml (format openvino, its sha256, its precision, its check)."""
    from vit_serve.manifest import Int8Quantization, Parity, file_sha256, write_manifest

    quant = None if int8 is None else Int8Quantization(
        "nncf", int8, "parity of the fp32 graph (onnxruntime) before NNCF int8 quantization")
    record = dataclasses.replace(
        written.record, file=xml.name, file_sha256=file_sha256(xml), format="openvino",
        precision="int8" if int8 is not None else "fp32", parity=Parity.from_dict(parity.to_dict(), xml.name),
        int8=quant, source_onnx=f"../{written.path.name}")
    return write_manifest(xml, record, overwrite=force)


def _int8(job: IRJob, fp32_graph: Path, xml: Path) -> dict:
    """NNCF int8 of `fp32_graph` into `xml`, calibrated on the job's images, measured against fp32."""
    import torch

    from vit_serve.preprocess import PreprocessConfig, preprocess_batch

    model, say = job.model, job.say
    h, w = model.cfg.img_size if job.res == "dynamic" else job.res
    pre = (model.preprocess_cfg or PreprocessConfig(input_size=model.cfg.img_size)).with_size(h, w)
    assert job.calibration  # ExportOptions refuses openvino int8 without images
    note = job.calibration_note
    say(f"  quantizing the IR to int8 with NNCF (transformer preset, calibrated on {note}) ...")
    quantize_ir(fp32_graph, xml, preprocess_batch(job.calibration, pre).numpy(), overwrite=job.force)
    x = torch.randn(16, 3, h, w, generator=torch.Generator().manual_seed(0))
    if job.images:
        x = preprocess_batch(job.images, pre)
    report = compare_ir(fp32_graph, xml, x.numpy(), job.labels if job.images else None, calibration=note)
    say(report.table())
    if not report.check.ok:
        say("  (the int8 IR is below the int8 bounds: a gateway refuses it at load unless forced)")
    return report.to_dict()


def write_ir(job: IRJob, graph: GraphWritten, explain: GraphWritten, fp32_graph: Path, fp32_explain: Path
             ) -> WrittenIR:
    """`vit-export --format openvino`: both graphs' IR and manifests in `ir_folder`; the logits graph int8 (NNCF)
    with `precision` int8, else f32 and checked against PyTorch in OpenVINO, as the explain graph always is."""
    from vit_export.graph_info import GraphInfo
    from vit_export.parity import check_parity

    say = job.say
    xml, explain_xml = ir_targets(job.out, job.name)
    int8 = None
    if job.precision == "int8":
        int8 = _int8(job, fp32_graph, xml)
        parity = graph.parity
    else:
        convert_ir(fp32_graph, xml, overwrite=job.force)
        parity = check_parity(job.model, xml, job.images, tol=job.tol, runtime="openvino",
                              info=GraphInfo.read(fp32_graph))
        say(parity.table())
    convert_ir(fp32_explain, explain_xml, overwrite=job.force)
    explain_parity = check_parity(job.model, explain_xml, job.images, tol=job.tol, runtime="openvino",
                                  info=GraphInfo.read(fp32_explain))
    say(explain_parity.table())
    manifest = _manifest(graph, xml, parity, int8, job.force)
    explain_manifest = _manifest(explain, explain_xml, explain_parity, None, job.force)
    say(f"wrote {xml.parent}/: {xml.name}, {explain_xml.name} (+ .bin, .json)")
    return WrittenIR(xml, manifest, parity, explain_xml, explain_manifest, explain_parity, int8)
