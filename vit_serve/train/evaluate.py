"""Classification evaluation: top-1 / top-5 accuracy, mean loss, the confusion matrix, and a readable PNG of it.

The ViT paper reports top-1 accuracy on the held-out split after fine-tuning (§4.1, Table 2); top-5 and the
confusion matrix are diagnostics. Everything here is pure except :func:`evaluate` (runs the model) and
:func:`save_confusion_png` (writes a file).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "EvalResult", "confusion_counts", "confusion_matrix", "default_step", "evaluate", "save_confusion_png",
    "topk_accuracy",
]


def _topk_correct(logits: torch.Tensor, y: torch.Tensor, ks: Sequence[int]) -> dict[int, int]:
    """Number of rows whose true class is among the k highest logits, for each k (k clamped to K)."""
    if logits.ndim != 2 or y.ndim != 1 or logits.shape[0] != y.shape[0]:
        raise ValueError(f"expected logits [B, K] and y [B], got {tuple(logits.shape)} and {tuple(y.shape)}")
    if any(k < 1 for k in ks):
        raise ValueError(f"k must be >= 1, got {tuple(ks)}")
    num_classes = logits.shape[1]
    kmax = min(max(ks), num_classes) if ks else 0
    if kmax == 0 or logits.shape[0] == 0:
        return {k: 0 for k in ks}
    top = logits.topk(kmax, dim=1).indices  # [B, kmax], best first
    hit = top == y.to(top.device).view(-1, 1)
    return {k: int(hit[:, : min(k, num_classes)].any(dim=1).sum()) for k in ks}


def topk_accuracy(logits: torch.Tensor, y: torch.Tensor, ks: Sequence[int] = (1, 5)) -> dict[int, float]:
    """Fraction of rows whose label is among the top-k logits: logits [B, K], y [B] -> {k: accuracy}.

    k larger than K is clamped to K (so top-5 on a 3-class problem is top-3, i.e. 1.0). An empty batch gives 0.
    """
    counts = _topk_correct(logits, y, ks)
    n = logits.shape[0]
    return {k: (c / n if n else 0.0) for k, c in counts.items()}


def confusion_counts(pred: torch.Tensor, y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Counts [K, K] (int64, on the inputs' device) of (true, predicted) pairs, ids assumed in [0, K).

    Static shapes (an `index_add_` into a fixed K*K vector, not `bincount`, whose output length depends on the
    data): on XLA one evaluation batch is one graph of fixed shape, compiled once and reused.
    """
    k = int(num_classes)
    flat = y.reshape(-1).long() * k + pred.reshape(-1).long().to(y.device)
    counts = torch.zeros(k * k, dtype=torch.long, device=y.device)
    return counts.index_add_(0, flat, torch.ones_like(flat)).reshape(k, k)


def confusion_matrix(pred: torch.Tensor, y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Counts [K, K] (int64, on the CPU): rows are the true class, columns the predicted one (= sklearn's
    convention). ValueError for ids outside [0, K)."""
    pred = pred.reshape(-1).long()
    y = y.reshape(-1).long().to(pred.device)
    if pred.shape != y.shape:
        raise ValueError(f"pred and y differ in length: {pred.numel()} vs {y.numel()}")
    if pred.numel() and (min(int(pred.min()), int(y.min())) < 0 or max(int(pred.max()), int(y.max())) >= num_classes):
        raise ValueError(f"class ids must lie in [0, {num_classes})")
    return confusion_counts(pred, y, num_classes).cpu()


def default_step(device: torch.device) -> Callable[[], None] | None:
    """What `evaluate` calls after each batch on `device`: on XLA the graph cut (`xla.sync`), so that each batch
    runs as its own graph instead of the whole validation set tracing into one; elsewhere nothing."""
    if device.type == "xla":
        from vit_serve.train import xla

        return xla.sync
    return None


def _unpack(batch) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
        raise ValueError("a loader must yield (x, y) or (x, y, n_skipped)")
    skipped = int(batch[2]) if len(batch) == 3 and batch[2] is not None else 0
    return batch[0], batch[1], skipped


@dataclass(frozen=True)
class EvalResult:
    """Classification metrics of one evaluation over a whole set.

    top1, top5 (top-k with k = min(5, K)), loss (mean cross-entropy; nan for an empty set), n (images scored),
    skipped (images the loader dropped as unreadable), confusion (LongTensor [K, K] on the CPU, rows = true,
    cols = predicted). Also readable by key (`result["top1"]`), as the dict it replaces was.
    """

    top1: float
    top5: float
    loss: float
    n: int
    skipped: int
    confusion: torch.Tensor

    def to_dict(self) -> dict[str, Any]:
        """The fields by name, in declaration order (the confusion matrix stays a tensor)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __getitem__(self, key: str) -> Any:
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)


class _Tally:
    """The running sums of one evaluation, kept on the device (one synchronisation at the end)."""

    def __init__(self, device: torch.device, num_classes: int | None) -> None:
        self.device = device
        self.correct = torch.zeros(2, dtype=torch.long, device=device)  # top-1, top-5 hits
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.cm = None if num_classes is None else torch.zeros(num_classes, num_classes, dtype=torch.long,
                                                                device=device)
        self.num_classes, self.n, self.skipped = num_classes or 0, 0, 0

    def add(self, logits: torch.Tensor, y: torch.Tensor) -> None:
        """Count one batch: logits [B, K] float32, y [B] int64, both on the device."""
        k = logits.shape[1]
        if self.cm is None:
            self.num_classes, self.cm = k, torch.zeros(k, k, dtype=torch.long, device=self.device)
        elif k != self.num_classes:
            raise ValueError(f"the model returned {k} classes after {self.num_classes}")
        self.loss_sum += F.cross_entropy(logits, y, reduction="sum").double()  # also rejects labels outside [0, K)
        top = logits.topk(min(5, k), dim=1).indices
        hit = top == y[:, None]
        self.correct[0] += hit[:, 0].sum()
        self.correct[1] += hit.any(dim=1).sum()
        self.cm += confusion_counts(top[:, 0], y, k)
        self.n += y.shape[0]

    def reduce(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Sum the counts (one packed vector), then the loss, over the processes."""
        counts = reduce(torch.cat([self.correct, torch.tensor([self.n, self.skipped], device=self.device),
                                   self.cm.reshape(-1)]))
        self.loss_sum = reduce(self.loss_sum)
        self.correct, (self.n, self.skipped), self.cm = counts[:2], counts[2:4].tolist(), counts[4:]

    def result(self) -> EvalResult:
        n, k = self.n, self.num_classes
        c1, c5 = self.correct.tolist()
        confusion = torch.zeros(0, 0, dtype=torch.long) if self.cm is None else self.cm.reshape(k, k).cpu()
        return EvalResult(top1=c1 / n if n else 0.0, top5=c5 / n if n else 0.0,
                          loss=float(self.loss_sum) / n if n else float("nan"), n=n, skipped=self.skipped,
                          confusion=confusion)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    loader: Iterable,
    device: str | torch.device = "cpu",
    amp_dtype: torch.dtype | None = None,
    num_classes: int | None = None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    step: Callable[[], None] | None = None,
) -> EvalResult:
    """Run `model` over `loader` in eval mode; its classification metrics as an :class:`EvalResult`.

    The loader yields (x [B, C, H, W], y [B]) or (x, y, n_skipped) (the count of unreadable images dropped
    from that batch); a batch with x None is skipped (its n_skipped still counts). Batches are moved to
    `device`; the model must already be there. `amp_dtype` (e.g. torch.bfloat16) runs the forward under
    autocast; the loss is computed in float32. The model's train/eval mode is restored afterwards.

    Sharded evaluation: each process runs its own share of the set and passes `reduce` (a sum over the
    processes, e.g. `distributed.sum_across`) and `num_classes` (a shard may be empty); the counts, the loss
    sum and the confusion matrix are summed before the ratios are taken, so every process gets the result
    of the whole set.

    `step` is called after each batch the model ran on (default `default_step(device)`: `xla.sync` on XLA, so
    that one batch is one graph of fixed shapes, compiled once).
    """
    device = torch.device(device)
    step = step if step is not None else default_step(device)
    was_training = model.training
    model.eval()
    if reduce is not None and num_classes is None:
        raise ValueError("a sharded evaluation (reduce=...) needs num_classes")
    tally = _Tally(device, num_classes)
    try:
        for batch in loader:
            x, y, s = _unpack(batch)
            tally.skipped += s
            if x is None or y is None or x.shape[0] == 0:
                continue
            x = x.to(device, non_blocking=True)
            ctx = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else contextlib.nullcontext()
            with ctx:
                logits = model(x)
            tally.add(logits.float(), y.to(device, non_blocking=True).long())
            if step is not None:
                step()
    finally:
        model.train(was_training)
    if reduce is not None:
        tally.reduce(reduce)
    return tally.result()


def save_confusion_png(
    cm: torch.Tensor,
    labels: Sequence[str] | None,
    path: str | os.PathLike,
    title: str = "confusion matrix",
) -> Path:
    """Write the confusion matrix `cm` [K, K] (rows = true) as a PNG, atomically (temp file + rename).

    Colour is each cell's fraction of its true class (rows normalised, so rare classes stay visible); counts
    are printed in the cells for K <= 20; tick labels come from `labels` (thinned and rotated for K > 30).
    Uses matplotlib's Agg canvas directly (no pyplot, no global backend change).
    """
    counts = torch.as_tensor(cm).detach().cpu().long()
    if counts.ndim != 2 or counts.shape[0] != counts.shape[1]:
        raise ValueError(f"cm must be square [K, K], got {tuple(counts.shape)}")
    k = counts.shape[0]
    names = [str(i) for i in range(k)] if labels is None else [str(s) for s in labels]
    if len(names) != k:
        raise ValueError(f"{len(names)} labels for a {k}-class confusion matrix")
    fig = _confusion_figure(counts, names, title)
    return _write_png(fig, Path(path))


def _confusion_figure(counts: torch.Tensor, names: list[str], title: str):
    """The matplotlib Figure of counts [K, K] with K tick names: the row-normalised image, colour bar, title."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    k = counts.shape[0]
    frac = (counts.double() / counts.sum(dim=1, keepdim=True).clamp(min=1)).numpy()
    side = min(max(5.0, 0.32 * k + 2.5), 14.0)
    fig = Figure(figsize=(side + 1.2, side), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    # Sharp cells while they span pixels; beyond that, average (nearest would silently drop rows).
    interp = "nearest" if k <= 200 else "antialiased"
    im = ax.imshow(frac, cmap="Blues", vmin=0.0, vmax=1.0, interpolation=interp)
    cbar = fig.colorbar(im, ax=ax, shrink=0.8)
    cbar.set_label("fraction of the true class")
    total = int(counts.sum())
    acc = float(counts.diagonal().sum()) / total if total else 0.0
    ax.set_title(f"{title}\n(n={total}, accuracy {100 * acc:.1f}%)")
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    _set_ticks(ax, names)
    if k <= 20:
        _write_counts(ax, counts, frac)
    return fig


def _set_ticks(ax, names: list[str]) -> None:
    """At most ~30 tick labels per axis, long names shortened, rotated when they would collide."""
    k = len(names)
    step = 1 if k <= 30 else -(-k // 30)
    ticks = list(range(0, k, step))
    short = [n if len(n) <= 18 else n[:17] + "…" for n in names]
    if k > 30:
        rot, ha, mode = 90, "center", "default"
    elif max((len(s) for s in short), default=0) > 3:
        rot, ha, mode = 45, "right", "anchor"
    else:
        rot, ha, mode = 0, "center", "default"
    fs_ticks = 9 if k <= 30 else 7
    ax.set_xticks(ticks, [short[i] for i in ticks], rotation=rot, ha=ha, rotation_mode=mode, fontsize=fs_ticks)
    ax.set_yticks(ticks, [short[i] for i in ticks], fontsize=fs_ticks)


def _write_counts(ax, counts: torch.Tensor, frac) -> None:
    """Each non-zero count [K, K] in its cell, white on the dark cells (fraction `frac` [K, K] above 0.5)."""
    k = counts.shape[0]
    fs = 10 if k <= 10 else 8
    for i in range(k):
        for j in range(k):
            c = int(counts[i, j])
            if c:
                ax.text(j, i, str(c), ha="center", va="center", fontsize=fs,
                        color="white" if frac[i, j] > 0.5 else "black")


def _write_png(fig, path: Path) -> Path:
    """Save `fig` as a PNG at `path` atomically (temp file + rename), with ordinary file permissions."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file ordinary permissions
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path
