"""What a run shows and leaves behind: a progress bar, metrics.jsonl (and TensorBoard when installed),
and at the end a PNG of the curves and a summary table."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


class Progress:
    """Progress bar with loss, lr, images/s and ETA (tqdm when installed, else a line per log interval)."""

    def __init__(self, total: int, start: int = 0, enabled: bool = True) -> None:
        self.total, self.enabled = total, enabled
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                pass
        self.t0, self.s0 = time.perf_counter(), start

    def update(self, step: int, n: int, **info: float) -> None:
        if not self.enabled:
            return
        text = " ".join(f"{k}={v:.4g}" for k, v in info.items())
        if self.bar is not None:
            self.bar.update(n)
            self.bar.set_postfix_str(text, refresh=False)
        else:
            rate = (step - self.s0) / max(time.perf_counter() - self.t0, 1e-9)
            eta = (self.total - step) / max(rate, 1e-9)
            print(f"step {step}/{self.total} {text} eta={eta:.0f}s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class MetricsLog:
    """Append-only JSON lines (one record per log step or evaluation), mirrored to TensorBoard if present."""

    def __init__(self, out: Path, enabled: bool = True) -> None:
        self.path = out / "metrics.jsonl"
        self.enabled = enabled
        self.tb = None
        if enabled:
            out.mkdir(parents=True, exist_ok=True)
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out / "tensorboard"))
            except (ImportError, ModuleNotFoundError):
                pass

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_curves(records: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Loss (train) and top-1 (validation) against step, as one PNG. Needs matplotlib; else skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_top1" in r]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    if val and "val_loss" in val[0]:
        ax1.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    ax1.set(xlabel="step", ylabel="loss", title="loss")
    ax1.legend()
    if val:
        ax2.plot([r["step"] for r in val], [100 * r["val_top1"] for r in val], "o-", label="top-1")
        ax2.plot([r["step"] for r in val], [100 * r["val_top5"] for r in val], "s--", label="top-5")
        ax2.legend()
    ax2.set(xlabel="step", ylabel="validation accuracy (%)", title="accuracy")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary_table(rows: dict[str, str]) -> str:
    width = max(len(k) for k in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows.items())
