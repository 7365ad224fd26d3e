"""Parity of an exported ONNX graph (onnxruntime, CPU, 2 threads) against the PyTorch model it came from.

Reference: the PyTorch model at the same input size (position embeddings resampled with its own mode, which is
what a static export bakes in). Inputs: random N(0, 1) batches and real images preprocessed with the model's
contract (`vit_serve.preprocess`). For an explain graph, its rollout map is also compared with
`vit_serve.explain.rollout` on the PyTorch attentions.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from vit_export.onnx_export import INPUT_NAME, export_info

from vit_serve.explain import rollout
from vit_serve.model import VisionTransformer
from vit_serve.preprocess import PreprocessConfig, preprocess_batch

FP16_MIN_COSINE = 0.9999
ROLLOUT_TOL = 1e-5


def session(onnx_path: str | Path, threads: int = 2):
    """An onnxruntime CPU session with `threads` intra-op threads."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])


@dataclass
class ParityRow:
    """One comparison: inputs, resolution, batch, max |Δ logit|, min cosine, top-1 agreement, rollout max |Δ|."""

    inputs: str
    res: str
    batch: int
    max_abs: float
    cosine: float
    top1: float
    rollout_max_abs: float | None
    ok: bool


@dataclass
class ParityReport:
    """Rows of `ParityRow`s and the criteria they were judged by; `ok` when every row passes."""

    onnx_path: str
    precision: str
    criteria: str
    rows: list[ParityRow] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r.ok for r in self.rows)

    def table(self) -> str:
        """The rows as a printable table."""
        head = (
            f"{'inputs':<8} {'res':>9} {'batch':>5} {'max|Δlogit|':>12} {'cosine':>10} {'top-1':>7} "
            f"{'rollout|Δ|':>11}  ok"
        )
        lines = [
            f"parity: {Path(self.onnx_path).name} (onnxruntime CPU vs PyTorch, {self.precision}; {self.criteria})",
            head,
        ]
        for r in self.rows:
            ro = "-" if r.rollout_max_abs is None else f"{r.rollout_max_abs:.2e}"
            lines.append(
                f"{r.inputs:<8} {r.res:>9} {r.batch:>5} {r.max_abs:>12.2e} {r.cosine:>10.7f} "
                f"{r.top1:>6.0%} {ro:>11}  {'yes' if r.ok else 'NO'}"
            )
        lines.append(f"parity {'passed' if self.ok else 'FAILED'}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "onnx": Path(self.onnx_path).name,
            "precision": self.precision,
            "criteria": self.criteria,
            "ok": self.ok,
            "rows": [asdict(r) for r in self.rows],
        }


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    num = (a * b).sum(-1)
    den = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    cos = np.where(den > 0, num / np.maximum(den, 1e-300), np.where(np.abs(a - b).max(-1) == 0, 1.0, 0.0))
    return float(cos.min())


def default_resolutions(model: VisionTransformer, info: dict) -> list[tuple[int, int]]:
    """Static graphs: their own resolution. Dynamic: the model's, and 1.5x and a non-square size."""
    if info.get("resolution") not in (None, "dynamic"):
        return [tuple(info["resolution"])]
    h, w = model.cfg.img_size
    p = model.cfg.patch_size
    return [(h, w), (h * 3 // 2 // p * p, w * 3 // 2 // p * p), (h, max(p, w * 3 // 4 // p * p))]


def check_parity(
    model: VisionTransformer,
    onnx_path: str | Path,
    images: Sequence[str | os.PathLike] | None = None,
    batch_sizes: Sequence[int] = (1, 8),
    tol: float = 1e-4,
    resolutions: Sequence[tuple[int, int]] | None = None,
    seed: int = 0,
    threads: int = 2,
) -> ParityReport:
    """Run the ONNX graph and `model` on the same inputs and compare.

    Per resolution (default: the graph's own; for dynamic graphs three sizes) and batch size: a random
    N(0, 1) batch, and the real `images` (if any) preprocessed by `vit_serve.preprocess` with the model's
    contract at that size. fp32: ok when max |Δ logit| <= tol (and rollout |Δ| <= 1e-5 for an explain graph);
    fp16 graphs: ok when top-1 agreement is 100% and the minimum cosine >= 0.9999.
    """
    info = export_info(onnx_path)
    precision = info.get("precision", "fp32")
    explain = bool(info.get("explain"))
    fixed_batch = info.get("batch") if isinstance(info.get("batch"), int) else None
    criteria = f"top-1 = 100%, cosine >= {FP16_MIN_COSINE}" if precision == "fp16" else f"max |Δ logit| <= {tol:g}"
    if explain and precision == "fp32":
        criteria += f", rollout |Δ| <= {ROLLOUT_TOL:g}"
    report = ParityReport(str(onnx_path), precision, criteria)
    sess = session(onnx_path, threads)
    model = model.eval()
    pre = model.preprocess_cfg or PreprocessConfig(input_size=model.cfg.img_size)
    g = torch.Generator().manual_seed(seed)
    batch_sizes = [fixed_batch] if fixed_batch else list(batch_sizes)
    for h, w in resolutions or default_resolutions(model, info):
        real = preprocess_batch(list(images), pre.with_size(h, w)) if images else None
        for b in batch_sizes:
            cases = [("random", torch.randn(b, 3, h, w, generator=g))]
            if real is not None and len(real):
                idx = torch.arange(b) % len(real)  # cycle the images to fill the batch
                cases.append(("images", real[idx]))
            for kind, x in cases:
                report.rows.append(_compare(model, sess, x, kind, precision, tol, info))
    return report


@torch.no_grad()
def _compare(
    model: VisionTransformer, sess, x: torch.Tensor, kind: str, precision: str, tol: float, info: dict
) -> ParityRow:
    outs = sess.run(None, {INPUT_NAME: x.numpy()})
    got = outs[0]
    ro_err = None
    if info.get("explain"):
        ref_t, attentions = model(x, return_attention=True)
        p = model.cfg.patch_size
        heat = rollout(
            attentions,
            (x.shape[-2] // p, x.shape[-1] // p),
            model.num_prefix_tokens,
            model.cfg.pool,
            info.get("head_fusion", "mean"),
            info.get("discard_ratio", 0.9),
        )
        ro_err = float(np.abs(outs[1] - heat.map.numpy()).max())
    else:
        ref_t = model(x)
    ref = ref_t.numpy()
    max_abs = float(np.abs(got - ref).max())
    cos = _cosine(got, ref)
    top1 = float((got.argmax(-1) == ref.argmax(-1)).mean())
    ok = top1 == 1.0 and cos >= FP16_MIN_COSINE if precision == "fp16" else max_abs <= tol
    if ro_err is not None and precision == "fp32":  # fp16 attentions: the rollout is reported, not judged
        ok = ok and ro_err <= ROLLOUT_TOL
    return ParityRow(kind, f"{x.shape[-2]}x{x.shape[-1]}", x.shape[0], max_abs, cos, top1, ro_err, bool(ok))
