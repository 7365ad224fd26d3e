"""Parity of an exported ONNX graph (onnxruntime, CPU, 2 threads) against the PyTorch model it came from.

Reference: the PyTorch model at the same input size (position embeddings resampled with its own mode, which is
what a static export bakes in). Inputs: random N(0, 1) batches and real images preprocessed with the model's
contract (`vit_serve.preprocess`). For an explain graph, its rollout map is also compared with
`vit_serve.explain.rollout` on the PyTorch attentions (`vit_serve.explain.explain_forward`: with token merging,
through the PyTorch pass's merges).

The rollout map is a discontinuous function of the attention weights: each layer zeroes the weights below a
threshold (the discard ratio's quantile), so a weight within rounding of that threshold may be kept by one
correct runtime and dropped by another, moving the map by up to ~1e-3 at a cell (a [class]-row weight of the
last layer). The check therefore says how far the map is from PyTorch's beyond what such flips can explain:
`rollout_envelope` bounds, cell by cell, how much flipping any subset of the near-threshold weights can move the
map (to first order, exact for one flip), and a row passes when |Δ| <= 1e-5 + 2 x that bound everywhere. The
table also gives the number of near-threshold weights, the map's cosine and the agreement of its top-5 cells.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from vit_export.graph_info import GraphInfo
from vit_export.memory import on_young_heap, release_memory
from vit_export.onnx_export import heads_fused

from vit_serve.explain import DEFAULT_DISCARD_RATIO, DEFAULT_HEAD_FUSION, explain_forward, rollout
from vit_serve.manifest import PIXEL_VALUES, RolloutSettings
from vit_serve.model import VisionTransformer
from vit_serve.preprocess import PreprocessConfig, preprocess_batch
from vit_serve.tome import LayerMerge

FP16_MIN_COSINE = 0.9999
ROLLOUT_TOL = 1e-5
# A fused attention weight within this relative distance of its layer's discard threshold may fall on either side
# in another runtime: 20x the largest discrepancy measured between onnxruntime and PyTorch in the fused attention
# of a 12-layer ViT-S/16 (5.4e-7 relative; float32's epsilon is 1.2e-7).
NEAR_THRESHOLD_REL = 1e-5
# The envelope is first order in the flips (exact for one flip); 2x covers their interactions.
ENVELOPE_SLACK = 2.0
TOP_CELLS = 5
# The largest batch checked at a dynamic graph's sizes other than its first (the model's own), where every batch
# size runs: the batch axis is checked there, and the larger sizes, whose attention grows with the square of the
# tokens, at batch 1 and 2 (a batch above 1 still reaches every size) in bounded memory.
OTHER_SIZES_MAX_BATCH = 2
RUNTIMES = ("onnxruntime", "openvino")


def session(onnx_path: str | Path, threads: int = 2, arena: bool = True):
    """An onnxruntime CPU session with `threads` intra-op threads. Without `arena` (memory-lean), each run's
    intermediate tensors go back to the system when it ends (onnxruntime's arena keeps the largest run's for the
    session's life: a check that runs one size after another would hold the largest run's memory to the end), and
    nodes run in priority order."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    if not arena:
        opts.enable_cpu_mem_arena = False
        opts.enable_mem_pattern = False  # a pattern is planned per input shape and kept
        # The default order runs the whole encoder before the explain graph's rollout and so holds every layer's
        # attention at once (1.8 GB for a ViT-B at 8 x 384); by priority each layer's is consumed and freed in
        # turn (0.7 GB). The same ops on the same inputs: the outputs do not change.
        opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    return ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])


class OpenVINOSession:
    """An OpenVINO CPU model behind onnxruntime's `run(None, feed)` call, in float32 (OpenVINO's CPU plugin
    otherwise infers in bf16 wherever the processor has AMX or AVX512-BF16)."""

    def __init__(self, onnx_path: str | Path, threads: int = 2) -> None:
        from vit_serve.runtime.backends.openvino import compile_model

        self.model = compile_model(onnx_path, {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": threads})

    def run(self, output_names: None, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        result = self.model(feed)
        return [np.asarray(result[o]) for o in self.model.outputs]


def runtime_session(onnx_path: str | Path, runtime: str = "onnxruntime", threads: int = 2, arena: bool = True):
    """A CPU session of `runtime` ("onnxruntime" or "openvino") with `run(None, feed) -> [outputs]`; `arena`:
    onnxruntime's memory arena (`session`)."""
    if runtime == "onnxruntime":
        return session(onnx_path, threads, arena)
    if runtime == "openvino":
        return OpenVINOSession(onnx_path, threads)
    raise ValueError(f"unknown runtime {runtime!r}; expected one of {', '.join(RUNTIMES)}")


@dataclass
class ParityRow:
    """One comparison: inputs, resolution, batch, max |Δ logit|, min cosine, top-1 agreement, rollout max |Δ|,
    and for a rollout map: the number of near-threshold attention weights (over the batch and layers), the largest
    |Δ| beyond what flipping them explains (the judged number), the map's minimum cosine and top-5 cell agreement;
    for a graph with an embedding output, its max |Δ| and minimum cosine (judged as the logits are)."""

    inputs: str
    res: str
    batch: int
    max_abs: float
    cosine: float
    top1: float
    rollout_max_abs: float | None
    ok: bool
    rollout_near: int | None = None
    rollout_beyond: float | None = None
    rollout_cosine: float | None = None
    rollout_top: float | None = None
    embedding_max_abs: float | None = None
    embedding_cosine: float | None = None


@dataclass
class ParityReport:
    """Rows of `ParityRow`s and the criteria they were judged by; `ok` when every row passes."""

    onnx_path: str
    precision: str
    criteria: str
    rows: list[ParityRow] = field(default_factory=list)
    runtime: str = "onnxruntime"
    patch_size: int | None = None  # the model's (a column of the table: --res and --patch-size side by side)

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r.ok for r in self.rows)

    def table(self) -> str:
        """The rows as a printable table."""
        embedding = any(r.embedding_max_abs is not None for r in self.rows)
        head = (
            f"{'inputs':<8} {'res':>9} {'patch':>5} {'batch':>5} {'max|Δlogit|':>12} {'cosine':>10} {'top-1':>7} "
            f"{'rollout|Δ|':>11} {'near':>5} {'beyond':>9} {'map cos':>10} {'top-5':>6}"
            + (f" {'embed|Δ|':>9} {'emb cos':>10}" if embedding else "") + "  ok"
        )
        lines = [
            f"parity: {Path(self.onnx_path).name} ({self.runtime} CPU vs PyTorch, {self.precision}; {self.criteria})",
            head,
        ]

        def fmt(v: float | None, spec: str) -> str:
            return "-" if v is None else format(v, spec)

        for r in self.rows:
            lines.append(
                f"{r.inputs:<8} {r.res:>9} {fmt(self.patch_size, 'd'):>5} {r.batch:>5} {r.max_abs:>12.2e} "
                f"{r.cosine:>10.7f} "
                f"{r.top1:>6.0%} {fmt(r.rollout_max_abs, '.2e'):>11} {fmt(r.rollout_near, 'd'):>5} "
                f"{fmt(r.rollout_beyond, '.2e'):>9} {fmt(r.rollout_cosine, '.7f'):>10} {fmt(r.rollout_top, '.0%'):>6}"
                + (f" {fmt(r.embedding_max_abs, '.2e'):>9} {fmt(r.embedding_cosine, '.7f'):>10}" if embedding else "")
                + f"  {'yes' if r.ok else 'NO'}"
            )
        if any(r.rollout_near for r in self.rows):
            lines.append(
                "(near: attention weights within rounding of a discard threshold, which a correct runtime may keep "
                "or drop; beyond: rollout |Δ| beyond what flipping them can explain)"
            )
        lines.append(f"parity {'passed' if self.ok else 'FAILED'}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "onnx": Path(self.onnx_path).name,
            "runtime": self.runtime,
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


def judge_logits(ref: np.ndarray, got: np.ndarray, *, zero_max_abs: float, max_abs: float | None = None,
                 cosine_min: float | None = None, top1_min: float | None = None) -> bool:
    """The verdict on logits `got` [B, K] against `ref`: finite, and per row max |Δ| <= max_abs, cosine >=
    cosine_min, top-1 agreement over the rows >= top1_min (each when given).

    A row whose reference is all zero (a freshly reset head) has no direction: its cosine is 0 (or 0/0) and its
    top-1 a tie broken by noise, so it is judged by max |Δ| <= zero_max_abs alone."""
    ref = np.asarray(ref, np.float64)
    got = np.asarray(got, np.float64)
    if ref.shape != got.shape or not np.isfinite(got).all():
        return False
    ref, got = ref.reshape(-1, ref.shape[-1]), got.reshape(-1, got.shape[-1])
    delta = np.abs(ref - got).max(-1, initial=0.0)
    zero = ~np.any(ref != 0, axis=-1)
    if (delta[zero] > zero_max_abs).any():
        return False
    r, g, d = ref[~zero], got[~zero], delta[~zero]
    if not len(r):
        return True
    if max_abs is not None and d.max() > max_abs:
        return False
    if cosine_min is not None:
        den = np.linalg.norm(r, axis=-1) * np.linalg.norm(g, axis=-1)
        cos = np.where(den > 0, (r * g).sum(-1) / np.maximum(den, 1e-300), 0.0)
        if cos.min() < cosine_min:
            return False
    return top1_min is None or float(np.mean(r.argmax(-1) == g.argmax(-1))) >= top1_min


def default_resolutions(model: VisionTransformer, info: GraphInfo | None) -> list[tuple[int, int]]:
    """Static graphs: their own resolution. Dynamic (or unrecorded): the model's, and 1.5x and a non-square size
    (sides raised to a token-merging graph's `min_grid`)."""
    res = None if info is None else info.resolution
    if res not in (None, "dynamic"):
        return [(res[0], res[1])]
    h, w = model.cfg.img_size
    p = model.cfg.patch_size
    tm = None if info is None else info.token_merging
    lo = p * (tm.min_grid or 1) if tm is not None else p
    sizes = [(h, w), (h * 3 // 2 // p * p, w * 3 // 2 // p * p), (h, w * 3 // 4 // p * p)]
    return list(dict.fromkeys((max(lo, a), max(lo, b)) for a, b in sizes))


@torch.no_grad()
def rollout_envelope(
    attentions: Sequence[torch.Tensor],
    num_prefix_tokens: int = 1,
    pool: str = "token",
    head_fusion: str = DEFAULT_HEAD_FUSION,
    discard_ratio: float = DEFAULT_DISCARD_RATIO,
    near_rel: float = NEAR_THRESHOLD_REL,
    images: Sequence[int] | None = None,
    merges: Sequence[LayerMerge] | None = None,
) -> tuple[list[int], torch.Tensor]:
    """How far rounding at the discard thresholds can move `vit_serve.explain.rollout`'s map, per image and cell.

    attentions: L tensors [B, heads, N, N] (PyTorch's; MAP models: the pool's probe [B, heads, 1, N] last, whose
    fused row is then q, `vit_serve.explain.probe_query`). A weight is near-threshold when its fused value a is within
    near_rel of its layer's threshold t (|a - t| <= near_rel * t; t = the smallest kept weight, read off
    `discard_lowest`'s own decisions). Flipping one such weight (i, j) of layer l, w = a, changes that layer's
    row-normalised matrix Â_l in row i only, by σw (e_j - Â_l[i]) / (s_i + σw) (σ = +1 keeps a dropped weight,
    -1 drops a kept one; s_i the row sum), so the map q^T Â_L ... Â_1 moves by exactly
    b_l[i] σw / (s_i + σw) (F_{l-1}[j] - F_l[i]), with b_l^T = q^T Â_L ... Â_{l+1} and F_l = Â_l ... Â_1
    (q: the [class] row, or the mean of the patch rows for GAP models). The envelope is the sum of those moves'
    magnitudes over all near-threshold weights: any subset of flips moves each cell by at most that, to first
    order. images: the batch indices that need an envelope (default all; the others get zeros).

    With token merges (`merges`, as `rollout` takes them), layer l's attention is [B, heads, T_l, T_l] and its
    merge the row-stochastic matrix M_l [T_{l+1}, T_l] (each group's size-weighted average): F_l = M_l Â_l F_{l-1},
    b_l^T = q^T M_L Â_L ... Â_{l+1} M_l, and the move's F_l[i] is (Â_l F_{l-1})[i], before the merge; q then
    weighs the final tokens (GAP: by size).

    Returns (near-threshold weight count per image, envelope [B, gh * gw] float64).
    """
    from vit_serve.explain import discard_lowest, final_sizes, fuse_heads, probe_query, split_probe
    from vit_serve.tome import merge_wavg

    attentions, probe = split_probe(attentions, pool)
    p, batch, n0 = num_prefix_tokens, attentions[0].shape[0], attentions[0].shape[-1]
    # exactly what rollout thresholds (attentions fused already, `heads_fused`'s [B, 1, N, N], are their own fusion)
    fused = [a.float()[:, 0] if a.shape[1] == 1 else fuse_heads(a.float(), head_fusion) for a in attentions]
    kept = [discard_lowest(f, discard_ratio, p > 0) for f in fused] if discard_ratio > 0 else fused
    near: list[torch.Tensor] = []  # per layer [B, T_l * T_l] bool
    for f, k in zip(fused, kept, strict=True):
        n = f.shape[-1]
        not_first = torch.ones(n * n, dtype=torch.bool)
        if p > 0:
            not_first[0] = False  # [0, 0] is never discarded: no threshold applies to it
        flat, kflat = f.reshape(batch, -1), k.reshape(batch, -1)
        dropped = (kflat == 0) & (flat != 0)
        candidates = torch.where(~dropped & not_first, flat, torch.full_like(flat, float("inf")))
        threshold = candidates.amin(dim=-1, keepdim=True)
        m = ((flat - threshold).abs() <= near_rel * threshold) & not_first
        near.append(m & dropped.any(dim=-1, keepdim=True))  # a layer that dropped nothing has no threshold
    counts = [int(sum(int(m[b].sum()) for m in near)) for b in range(batch)]
    mats: list[torch.Tensor | None] = []  # per layer M_l [B, T_{l+1}, T_l], None where nothing merged
    for f, merge in zip(fused, merges or [None] * len(fused), strict=True):
        if merge is None or merge.matching is None:
            mats.append(None)
            continue
        n = f.shape[-1]
        size = None if merge.size is None else merge.size.double()
        mats.append(merge_wavg(merge.matching, torch.eye(n, dtype=torch.float64).expand(batch, n, n), size)[0])
    sizes = final_sizes(attentions, merges)
    envelope = torch.zeros(batch, n0 - p, dtype=torch.float64)
    for b in range(batch) if images is None else images:
        if counts[b] == 0:
            continue
        sums, hat = [], []
        for k in kept:
            row = k[b].double() + torch.eye(k.shape[-1], dtype=torch.float64)
            sums.append(row.sum(dim=-1))
            hat.append(row / sums[-1][:, None])
        forward = [torch.eye(n0, dtype=torch.float64)]  # F_0 .. F_L, each after its layer's merge
        before = []  # Â_l F_{l-1}: layer l's rows before its merge
        for a, mat in zip(hat, mats, strict=True):
            before.append(a @ forward[-1])
            forward.append(before[-1] if mat is None else mat[b] @ before[-1])
        t = forward[-1].shape[0]
        q = torch.zeros(t, dtype=torch.float64)
        if pool == "token":
            q[0] = 1.0
        elif probe is not None:
            q = probe_query(probe[b:b + 1].float(), head_fusion)[0].double()
        elif sizes is not None:
            q[p:] = sizes[b, p:, 0].double() / sizes[b, p:, 0].double().sum()
        else:
            q[p:] = 1.0 / (t - p)
        back = q  # b_L = q (M_L); b_{l-1} = b_l Â_l (M_{l-1})
        for layer in reversed(range(len(hat))):
            if mats[layer] is not None:
                back = back @ mats[layer][b]
            n = hat[layer].shape[-1]
            idx = near[layer][b].nonzero()[:, 0]
            if len(idx):
                i, j = idx // n, idx % n
                w = fused[layer][b].reshape(-1)[idx].double()
                sigma = torch.where(kept[layer][b].reshape(-1)[idx] != 0, -1.0, 1.0).double()
                coeff = (back[i] * w / (sums[layer][i] + sigma * w)).abs()
                moves = (forward[layer][j, p:] - before[layer][i, p:]).abs()
                envelope[b] += (coeff[:, None] * moves).sum(dim=0)
            back = back @ hat[layer]
    return counts, envelope


def _top_agreement(got: np.ndarray, ref: np.ndarray, k: int = TOP_CELLS) -> float:
    """Smallest share, over images [B, cells], of the reference's top-k cells that are among the candidate's."""
    k = min(k, ref.shape[-1])
    top_ref = np.argsort(-ref, axis=-1)[:, :k]
    top_got = np.argsort(-got, axis=-1)[:, :k]
    return float(min(len(set(a) & set(b)) / k for a, b in zip(top_ref, top_got, strict=True)))


@on_young_heap
def check_parity(
    model: VisionTransformer,
    onnx_path: str | Path,
    images: Sequence[str | os.PathLike] | None = None,
    batch_sizes: Sequence[int] = (1, 8),
    tol: float = 1e-4,
    resolutions: Sequence[tuple[int, int]] | None = None,
    seed: int = 0,
    threads: int = 2,
    runtime: str = "onnxruntime",
    info: GraphInfo | None = None,
) -> ParityReport:
    """Run the ONNX graph (in `runtime`: "onnxruntime" or "openvino") and `model` on the same inputs and compare.

    Per resolution (default: the graph's own; for dynamic graphs three sizes, the model's first) and batch size:
    a random N(0, 1) batch, and the real `images` (if any) preprocessed by `vit_serve.preprocess` with the model's
    contract at that size. Every batch size runs at the first resolution; the others (a dynamic graph's larger and
    non-square sizes) run at the batch sizes capped at `OTHER_SIZES_MAX_BATCH` (1 and 2 for the default (1, 8)):
    the batch axis is checked at the model's own size, and every size still at a batch above 1, without the
    memory of a large batch at the largest size. fp32: ok when max |Δ logit| <= tol, and for an explain graph
    when the rollout map is within 1e-5 of PyTorch's beyond what near-threshold weights explain
    (`rollout_envelope`); fp16 graphs: ok when top-1 agreement is 100% and the minimum cosine >= 0.9999.
    info: the graph's `GraphInfo` when the caller has it (`export_graph`'s), else read from the file.

    Memory: one run at a time, each compared as soon as it is made and released before the next (onnxruntime
    without its arena, which would keep the largest run's memory; PyTorch's attentions fused per layer as they
    are produced, `heads_fused`), so the check's peak is that of its largest single run.
    """
    info = info or GraphInfo.read(onnx_path) or GraphInfo()
    precision = info.precision
    criteria = f"top-1 = 100%, cosine >= {FP16_MIN_COSINE}" if precision == "fp16" else f"max |Δ logit| <= {tol:g}"
    if info.explain and precision == "fp32":
        criteria += f", rollout |Δ| <= {ROLLOUT_TOL:g} beyond near-threshold flips"
    if info.embedding:
        criteria += ", the same for the embedding"
    report = ParityReport(str(onnx_path), precision, criteria, runtime=runtime, patch_size=model.cfg.patch_size)
    sess = runtime_session(onnx_path, runtime, threads, arena=False)
    model = model.eval()
    pre = model.preprocess_cfg or PreprocessConfig(input_size=model.cfg.img_size)
    g = torch.Generator().manual_seed(seed)
    for i, (h, w) in enumerate(resolutions or default_resolutions(model, info)):
        sizes = _batches_at(i, list(batch_sizes), info.fixed_batch)
        # only the images a batch uses are decoded (cycled to fill it): a large folder is not held at every size
        real = preprocess_batch(list(images)[:max(sizes)], pre.with_size(h, w)) if images else None
        for b in sizes:
            for kind in ("random", "images") if real is not None and len(real) else ("random",):
                if kind == "random":
                    x = torch.randn(b, 3, h, w, generator=g)
                else:
                    assert real is not None
                    x = real[torch.arange(b) % len(real)]
                outs = sess.run(None, {PIXEL_VALUES: x.numpy()})
                report.rows.append(compare_outputs(model, x, outs, kind, precision, tol, info))
                del outs, x
                release_memory()
        del real
    del sess
    release_memory()
    return report


def _batches_at(index: int, batch_sizes: list[int], fixed: int | None) -> list[int]:
    """The batch sizes checked at the `index`-th resolution: a fixed-batch graph's own; all at the first; at the
    others each capped at OTHER_SIZES_MAX_BATCH (once each)."""
    if fixed:
        return [fixed]
    if index == 0:
        return batch_sizes
    return list(dict.fromkeys(min(b, OTHER_SIZES_MAX_BATCH) for b in batch_sizes))


@dataclass
class RolloutComparison:
    """A rollout map against PyTorch's: max |Δ|, near-threshold weights, |Δ| beyond their envelope, cosine, top-k."""

    max_abs: float
    near: int
    beyond: float
    cosine: float
    top: float

    @property
    def ok(self) -> bool:
        return self.beyond <= ROLLOUT_TOL


def compare_rollout(
    got: np.ndarray,
    attentions: Sequence[torch.Tensor],
    grid: tuple[int, int],
    num_prefix_tokens: int = 1,
    pool: str = "token",
    head_fusion: str = DEFAULT_HEAD_FUSION,
    discard_ratio: float = DEFAULT_DISCARD_RATIO,
    merges: Sequence[LayerMerge] | None = None,
    reference: torch.Tensor | None = None,
) -> RolloutComparison:
    """A runtime's rollout map `got` [B, gh, gw] against `vit_serve.explain.rollout` on PyTorch's `attentions`
    (and, with token merging, the same pass's `merges`: `vit_serve.explain.explain_forward`). `reference`: that
    map when the caller has it already (`explain_forward`'s heatmap, the same call), so it is not computed twice.

    beyond: the largest max(|Δ| - 2 x envelope, 0) over images and cells, where the envelope (see
    `rollout_envelope`) is computed only for images whose |Δ| exceeds 1e-5 (elsewhere it is not needed).
    """
    if reference is None:
        reference = rollout(attentions, grid, num_prefix_tokens, pool, head_fusion, discard_ratio, merges).map
    ref = reference.numpy()
    batch = ref.shape[0]
    got, ref = got.reshape(batch, -1), ref.reshape(batch, -1)
    diff = np.abs(got.astype(np.float64) - ref)
    over = [b for b in range(batch) if diff[b].max() > ROLLOUT_TOL]
    counts, envelope = rollout_envelope(attentions, num_prefix_tokens, pool, head_fusion, discard_ratio, images=over,
                                        merges=merges)
    beyond = np.maximum(diff - ENVELOPE_SLACK * envelope.numpy(), 0.0)
    return RolloutComparison(float(diff.max()), sum(counts), float(beyond.max()), _cosine(got, ref),
                             _top_agreement(got, ref))


@torch.no_grad()
def compare_outputs(
    model: VisionTransformer, x: torch.Tensor, outs: Sequence[np.ndarray], kind: str, precision: str, tol: float,
    info: GraphInfo,
) -> ParityRow:
    """One row: a runtime's outputs `outs` (logits, and the rollout map for an explain graph or the embedding for
    a graph with one) on inputs `x` against `model`'s."""
    got = outs[0]
    ro = None
    emb_abs = emb_cos = None
    if info.embedding:
        ref_t, embedding = model.forward_embedding(x)
        emb_abs = float(np.abs(outs[1] - embedding.numpy()).max())
        emb_cos = _cosine(outs[1], embedding.numpy())
    elif info.explain:
        settings = info.rollout or RolloutSettings()
        with heads_fused(model, settings.head_fusion):  # [B, 1, N, N] per layer: the rollout's own fusion
            e = explain_forward(model, x, settings.head_fusion, settings.discard_ratio)
        ref_t = e.logits
        p = model.cfg.patch_size
        ro = compare_rollout(
            outs[1],
            e.attentions,
            (x.shape[-2] // p, x.shape[-1] // p),
            model.num_prefix_tokens,
            model.cfg.pool,
            settings.head_fusion,
            settings.discard_ratio,
            e.merges,
            reference=e.heatmap.map,  # explain_forward's own `rollout` of these attentions, with these settings
        )
    else:
        ref_t = model(x)
    ref = ref_t.numpy()
    max_abs = float(np.abs(got - ref).max())
    cos = _cosine(got, ref)
    top1 = float((got.argmax(-1) == ref.argmax(-1)).mean())
    if precision == "fp16":
        ok = judge_logits(ref, got, zero_max_abs=tol, cosine_min=FP16_MIN_COSINE, top1_min=1.0)
    else:
        ok = judge_logits(ref, got, zero_max_abs=tol, max_abs=tol)
    if emb_abs is not None:
        ok = ok and (emb_cos >= FP16_MIN_COSINE if precision == "fp16" else emb_abs <= tol)
    if ro is not None and precision == "fp32":  # fp16 attentions: the rollout is reported, not judged
        ok = ok and ro.ok
    res = f"{x.shape[-2]}x{x.shape[-1]}"
    if ro is None:
        return ParityRow(kind, res, x.shape[0], max_abs, cos, top1, None, bool(ok), embedding_max_abs=emb_abs,
                         embedding_cosine=emb_cos)
    return ParityRow(kind, res, x.shape[0], max_abs, cos, top1, ro.max_abs, bool(ok), ro.near, ro.beyond,
                     ro.cosine, ro.top)
