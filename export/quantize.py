"""int8 quantization of an fp32 ONNX graph (onnxruntime.quantization), and what it costs and gains.

Two schemes, because which one wins depends on the CPU (int8 dot-product instructions such as AVX-512 VNNI make
the integer kernels fast; without them dynamic int8 can be no faster than fp32):
- dynamic: MatMul / Gemm weights QUInt8 per output channel, activations quantized on the fly (`quantize_int8`);
- static: QDQ (QuantizeLinear / DequantizeLinear pairs, U8U8), weights QUInt8 per channel, activation ranges
  calibrated once on real images (`quantize_static_int8`); only the MatMul / Gemm nodes with constant weights
  are quantized (attention's activation-by-activation products stay fp32).
Both are U8U8 (unsigned weights): on x86 CPUs without VNNI (AVX2, plain AVX-512) onnxruntime's u8 x s8 kernels
use VPMADDUBSW, whose 16-bit pairwise sums saturate. Measured on the digits scans on an AVX2-only CPU, top-1
agreement with fp32: s8 weights 65% (dynamic) / 77% (static); s8 weights in 7 bits (reduce_range) 91% / 90%;
u8 weights 97.5% / 95.3%. A graph is exported once and served on any CPU, so the choice cannot wait for the
serving machine.
Reported against the fp32 graph on the same inputs: file size (MB), speed (ms/img, onnxruntime CPU, 2 threads,
batch 1), top-1 agreement, and top-1 accuracy of each when labels are given (`compare_int8`, `compare_schemes`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
from vit_export.parity import session

from vit_serve.checkpoints.io import atomic_write
from vit_serve.manifest import PIXEL_VALUES

SCHEMES = ("dynamic", "static")
MAX_CALIBRATION = 256  # images; MinMax ranges settle long before this


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """onnxruntime.quantization warns on the root logger ("consider pre-processing") at every call."""
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def quantize_int8(onnx_path: str | Path, out_path: str | Path, overwrite: bool = False) -> Path:
    """Dynamic int8 quantization (QUInt8 weights; MatMul and Gemm) of `onnx_path`, written atomically to `out_path`."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out_path = Path(out_path)
    if out_path.exists() and not overwrite:
        raise FileExistsError(f"{out_path} exists; pass --force to replace it")

    def write(tmp: str) -> None:
        with _quiet():
            quantize_dynamic(
                str(onnx_path), tmp, weight_type=QuantType.QUInt8, op_types_to_quantize=["MatMul", "Gemm"],
                per_channel=True,
            )

    return atomic_write(out_path, write, overwrite=overwrite)


def weight_matmuls(onnx_path: str | Path) -> list[str]:
    """Names of the MatMul / Gemm nodes whose second input is a constant (the linear layers' weights)."""
    proto = onnx.load(str(onnx_path))
    consts = {i.name for i in proto.graph.initializer}
    consts |= {o for n in proto.graph.node if n.op_type == "Constant" for o in n.output}
    return [n.name for n in proto.graph.node if n.op_type in ("MatMul", "Gemm") and len(n.input) > 1
            and n.input[1] in consts]


class _Batches:
    """onnxruntime's CalibrationDataReader protocol over an [N, 3, H, W] array, `batch` images per call (a fixed
    batch graph needs exactly its batch: the images are cycled to fill the last one)."""

    def __init__(self, x: np.ndarray, batch: int) -> None:
        n = -(-len(x) // batch) * batch
        x = x[np.arange(n) % len(x)]
        self.chunks = [x[i : i + batch] for i in range(0, n, batch)]

    def get_next(self) -> dict[str, np.ndarray] | None:
        return {PIXEL_VALUES: self.chunks.pop(0)} if self.chunks else None

    def rewind(self) -> None:  # pragma: no cover - part of the protocol, unused by MinMax
        pass


def quantize_static_int8(
    onnx_path: str | Path, out_path: str | Path, calibration: np.ndarray, batch: int = 8, overwrite: bool = False
) -> Path:
    """Static int8 (QDQ, U8U8, per-channel weights, MinMax activation ranges over `calibration` [N, 3, H, W]
    float32, preprocessed like the model's inputs) of `onnx_path`, written atomically to `out_path`."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    out_path = Path(out_path)
    if out_path.exists() and not overwrite:
        raise FileExistsError(f"{out_path} exists; pass --force to replace it")
    x = np.ascontiguousarray(calibration, dtype=np.float32)
    if x.ndim != 4 or not len(x):
        raise ValueError(f"calibration needs a non-empty [N, 3, H, W] batch, got shape {x.shape}")
    nodes = weight_matmuls(onnx_path)

    def write(tmp: str) -> None:
        with _quiet():
            quantize_static(
                str(onnx_path),
                tmp,
                _Batches(x, batch),
                quant_format=QuantFormat.QDQ,
                activation_type=QuantType.QUInt8,
                weight_type=QuantType.QUInt8,
                per_channel=True,
                nodes_to_quantize=nodes,
                calibrate_method=CalibrationMethod.MinMax,
            )

    return atomic_write(out_path, write, overwrite=overwrite)


@dataclass
class SchemeRow:
    """One graph of a `SchemeReport`: size MB, ms/img at batch 1, top-1 agreement with fp32, accuracy."""

    graph: str
    mb: float
    ms: float
    agreement: float
    accuracy: float | None = None


@dataclass
class SchemeReport:
    """fp32 and each int8 scheme side by side on the same `n` inputs; `calibration` says what static saw."""

    n: int
    threads: int
    rows: list[SchemeRow]
    calibration: str | None = None

    def table(self) -> str:
        acc = lambda a: "-" if a is None else f"{a:.1%}"  # noqa: E731
        base = self.rows[0]
        lines = [
            f"int8 schemes (onnxruntime CPU, {self.threads} threads, batch 1; {self.n} inputs"
            + (f"; static calibrated on {self.calibration})" if self.calibration else ")"),
            f"{'graph':<13} {'size MB':>8} {'ms/img':>8} {'speed-up':>9} {'top-1 agr.':>11} {'top-1 acc':>10}",
        ]
        for r in self.rows:
            lines.append(
                f"{r.graph:<13} {r.mb:>8.2f} {r.ms:>8.2f} {base.ms / r.ms:>8.2f}x {r.agreement:>11.1%} "
                f"{acc(r.accuracy):>10}"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return asdict(self)


def compare_schemes(
    fp32_path: str | Path,
    int8_paths: dict[str, str | Path],
    inputs: np.ndarray,
    labels: Sequence[int] | None = None,
    threads: int = 2,
    calibration: str | None = None,
) -> SchemeReport:
    """fp32 and every int8 graph in `int8_paths` ({scheme: path}) on `inputs` [N, 3, H, W]: size, speed (batch 1),
    top-1 agreement with fp32, and accuracy when `labels` are given."""
    x = np.ascontiguousarray(inputs, dtype=np.float32)
    y = None if labels is None else np.asarray(labels)
    ref, ms = _logits_and_ms(Path(fp32_path), x, threads)
    top_ref = ref.argmax(-1)
    rows = [SchemeRow("fp32", Path(fp32_path).stat().st_size / 1e6, ms, 1.0,
                      None if y is None else float((top_ref == y).mean()))]
    for scheme, path in int8_paths.items():
        out, ms = _logits_and_ms(Path(path), x, threads)
        top = out.argmax(-1)
        rows.append(SchemeRow(f"int8 {scheme}", Path(path).stat().st_size / 1e6, ms, float((top == top_ref).mean()),
                              None if y is None else float((top == y).mean())))
    return SchemeReport(len(x), threads, rows, calibration)


@dataclass
class QuantReport:
    """fp32 vs int8: sizes (MB), ms/img at batch 1, top-1 agreement, accuracies (None without labels)."""

    fp32_mb: float
    int8_mb: float
    fp32_ms: float
    int8_ms: float
    agreement: float
    n: int
    fp32_accuracy: float | None = None
    int8_accuracy: float | None = None

    def table(self) -> str:
        acc = lambda a: "-" if a is None else f"{a:.1%}"  # noqa: E731
        return "\n".join(
            [
                f"int8 (onnxruntime CPU, 2 threads, batch 1; {self.n} inputs)",
                f"{'model':<6} {'size MB':>9} {'ms/img':>8} {'top-1 acc':>10}",
                f"{'fp32':<6} {self.fp32_mb:>9.2f} {self.fp32_ms:>8.2f} {acc(self.fp32_accuracy):>10}",
                f"{'int8':<6} {self.int8_mb:>9.2f} {self.int8_ms:>8.2f} {acc(self.int8_accuracy):>10}",
                f"speed-up {self.fp32_ms / self.int8_ms:.2f}x, size {self.int8_mb / self.fp32_mb:.0%} of fp32, "
                f"top-1 agreement with fp32 {self.agreement:.1%}",
            ]
        )

    def to_dict(self) -> dict:
        return asdict(self)


def _logits_and_ms(path: Path, x: np.ndarray, threads: int, warmup: int = 2) -> tuple[np.ndarray, float]:
    sess = session(path, threads)
    for i in range(min(warmup, len(x))):
        sess.run(None, {PIXEL_VALUES: x[i : i + 1]})
    out, t0 = [], time.perf_counter()
    for i in range(len(x)):
        out.append(sess.run(None, {PIXEL_VALUES: x[i : i + 1]})[0])
    return np.concatenate(out), (time.perf_counter() - t0) * 1000 / len(x)


def compare_int8(
    fp32_path: str | Path,
    int8_path: str | Path,
    inputs: np.ndarray,
    labels: Sequence[int] | None = None,
    threads: int = 2,
) -> QuantReport:
    """Size, speed (batch 1) and top-1 agreement of the int8 graph vs fp32 on `inputs` [N, 3, H, W] float32."""
    fp32_path, int8_path = Path(fp32_path), Path(int8_path)
    x = np.ascontiguousarray(inputs, dtype=np.float32)
    a, ms_a = _logits_and_ms(fp32_path, x, threads)
    b, ms_b = _logits_and_ms(int8_path, x, threads)
    top_a, top_b = a.argmax(-1), b.argmax(-1)
    rep = QuantReport(
        fp32_path.stat().st_size / 1e6,
        int8_path.stat().st_size / 1e6,
        ms_a,
        ms_b,
        float((top_a == top_b).mean()),
        len(x),
    )
    if labels is not None:
        y = np.asarray(labels)
        rep.fp32_accuracy, rep.int8_accuracy = float((top_a == y).mean()), float((top_b == y).mean())
    return rep
