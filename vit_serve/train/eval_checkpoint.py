"""`vit-serve eval`: a checkpoint on a dataset's held-out split, at its own or another resolution."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from vit_serve.checkpoints import load
from vit_serve.data import build_dataset, collate_skip
from vit_serve.model import VisionTransformer
from vit_serve.preprocess import PreprocessConfig
from vit_serve.train.augment import eval_transform
from vit_serve.train.evaluate import evaluate, save_confusion_png


def dataset_tensors(data: str, split: str, pre: PreprocessConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole split as model inputs [N, 3, H, W] and labels [N] (unreadable images left out)."""
    ds = build_dataset(data, split, eval_transform(pre))
    items = [it for it in (ds[i] for i in range(len(ds))) if it is not None]
    return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])


def few_shot_on(model: VisionTransformer, data: str, shots: tuple[int, ...], seed: int = 0,
                device: torch.device | str = "cpu") -> dict[int, float]:
    """The paper's few-shot linear accuracy of the model's frozen representation on `data`."""
    from vit_serve.train.fewshot import few_shot_eval

    (xtr, ytr), (xte, yte) = (dataset_tensors(data, s, model.preprocess_cfg) for s in ("train", "test"))
    return few_shot_eval(model, xtr, ytr, xte, yte, shots=shots, seed=seed, device=device)


@dataclass(frozen=True)
class CheckpointEval:
    """What `vit-serve eval` reports of a checkpoint: its held-out metrics at the resolution it ran at.

    `to_dict()` is the JSON the command prints and writes to eval.json (few_shot only when asked for);
    also readable by key (`report["top1"]`), as the dict it replaces was.
    """

    checkpoint: str
    data: str
    resolution: list[int]
    top1: float
    top5: float
    loss: float
    n: int
    skipped: int
    few_shot: dict[int, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.few_shot is None:
            del d["few_shot"]
        return d

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]


def run_eval(checkpoint: str, data: str = "digits", res: tuple[int, int] | None = None, out: str | None = None,
             few_shot: tuple[int, ...] = (), batch_size: int = 128, workers: int = 0) -> CheckpointEval:
    """Top-1, top-5 (and the confusion matrix PNG, few-shot accuracies) of `checkpoint` on `data`."""
    model = load(checkpoint)
    if res:
        model.set_resolution(*res)
    pre = model.preprocess_cfg
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    ds = build_dataset(data, "test", eval_transform(pre))
    loader = DataLoader(ds, batch_size=batch_size, num_workers=workers, collate_fn=collate_skip)
    scores = evaluate(model, loader, device=device)
    report = CheckpointEval(checkpoint=checkpoint, data=data, resolution=list(model.cfg.img_size), top1=scores.top1,
                            top5=scores.top5, loss=scores.loss, n=scores.n, skipped=scores.skipped,
                            few_shot=few_shot_on(model, data, few_shot, device=device) if few_shot else None)
    if out:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        save_confusion_png(scores.confusion, model.labels or [], folder / "confusion.png",
                           f"{Path(checkpoint).name}: top-1 {100 * scores.top1:.2f}%")
        (folder / "eval.json").write_text(json.dumps(report.to_dict(), indent=2))
    return report
