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
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = ["confusion_counts", "confusion_matrix", "default_step", "evaluate", "save_confusion_png", "topk_accuracy"]


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


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    loader: Iterable,
    device: str | torch.device = "cpu",
    amp_dtype: torch.dtype | None = None,
    num_classes: int | None = None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    step: Callable[[], None] | None = None,
) -> dict:
    """Run `model` over `loader` in eval mode and return classification metrics.

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

    Returns {"top1", "top5" (top-k with k = min(5, K)), "loss" (mean cross-entropy), "n" (images scored),
    "skipped" (sum of n_skipped), "confusion" (LongTensor [K, K], rows = true, cols = predicted)}.
    """
    device = torch.device(device)
    step = step if step is not None else default_step(device)
    was_training = model.training
    model.eval()
    # Accumulated on the device; one synchronisation at the end.
    correct = torch.zeros(2, dtype=torch.long, device=device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    if reduce is not None and num_classes is None:
        raise ValueError("a sharded evaluation (reduce=...) needs num_classes")
    cm = None if num_classes is None else torch.zeros(num_classes, num_classes, dtype=torch.long, device=device)
    n, skipped, num_classes = 0, 0, num_classes or 0
    try:
        for batch in loader:
            x, y, s = _unpack(batch)
            skipped += s
            if x is None or y is None or x.shape[0] == 0:
                continue
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True).long()
            ctx = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else contextlib.nullcontext()
            with ctx:
                logits = model(x)
            logits = logits.float()
            k = logits.shape[1]
            if cm is None:
                num_classes, cm = k, torch.zeros(k, k, dtype=torch.long, device=device)
            elif k != num_classes:
                raise ValueError(f"the model returned {k} classes after {num_classes}")
            loss_sum += F.cross_entropy(logits, y, reduction="sum").double()  # also rejects labels outside [0, K)
            top = logits.topk(min(5, k), dim=1).indices
            hit = top == y[:, None]
            correct[0] += hit[:, 0].sum()
            correct[1] += hit.any(dim=1).sum()
            cm += confusion_counts(top[:, 0], y, k)
            n += y.shape[0]
            if step is not None:
                step()
    finally:
        model.train(was_training)
    if reduce is not None:
        counts = reduce(torch.cat([correct, torch.tensor([n, skipped], device=device), cm.reshape(-1)]))
        loss_sum = reduce(loss_sum)
        correct, (n, skipped), cm = counts[:2], counts[2:4].tolist(), counts[4:]
    c1, c5 = correct.tolist()
    return {
        "top1": c1 / n if n else 0.0,
        "top5": c5 / n if n else 0.0,
        "loss": float(loss_sum) / n if n else float("nan"),
        "n": n,
        "skipped": skipped,
        "confusion": torch.zeros(0, 0, dtype=torch.long) if cm is None else cm.reshape(num_classes, num_classes).cpu(),
    }


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
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    counts = torch.as_tensor(cm).detach().cpu().long()
    if counts.ndim != 2 or counts.shape[0] != counts.shape[1]:
        raise ValueError(f"cm must be square [K, K], got {tuple(counts.shape)}")
    k = counts.shape[0]
    names = [str(i) for i in range(k)] if labels is None else [str(s) for s in labels]
    if len(names) != k:
        raise ValueError(f"{len(names)} labels for a {k}-class confusion matrix")
    rows = counts.sum(dim=1, keepdim=True).clamp(min=1)
    frac = (counts.double() / rows).numpy()

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

    step = 1 if k <= 30 else -(-k // 30)  # at most ~30 tick labels per axis
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

    if k <= 20:
        fs = 10 if k <= 10 else 8
        for i in range(k):
            for j in range(k):
                c = int(counts[i, j])
                if c:
                    ax.text(
                        j,
                        i,
                        str(c),
                        ha="center",
                        va="center",
                        fontsize=fs,
                        color="white" if frac[i, j] > 0.5 else "black",
                    )

    path = Path(path)
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
