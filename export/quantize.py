"""int8 dynamic quantization of an fp32 ONNX graph (onnxruntime.quantization), and what it costs and gains.

Weights of MatMul / Gemm become QInt8 (per output channel), activations are quantized on the fly. Reported against
the fp32 graph on the same inputs: file size (MB), speed (ms/img, onnxruntime CPU, 2 threads, batch 1),
top-1 agreement, and top-1 accuracy of both when labels are given.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from vit_export.onnx_export import INPUT_NAME
from vit_export.parity import session

from vit_serve.checkpoints.io import atomic_write


def quantize_int8(onnx_path: str | Path, out_path: str | Path, overwrite: bool = False) -> Path:
    """Dynamic int8 quantization (QInt8 weights; MatMul and Gemm) of `onnx_path`, written atomically to `out_path`."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out_path = Path(out_path)
    if out_path.exists() and not overwrite:
        raise FileExistsError(f"{out_path} exists; pass --force to replace it")

    def write(tmp: str) -> None:
        quantize_dynamic(
            str(onnx_path), tmp, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul", "Gemm"], per_channel=True
        )

    return atomic_write(out_path, write, overwrite=overwrite)


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
        sess.run(None, {INPUT_NAME: x[i : i + 1]})
    out, t0 = [], time.perf_counter()
    for i in range(len(x)):
        out.append(sess.run(None, {INPUT_NAME: x[i : i + 1]})[0])
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
