"""`vit-serve eval`: a checkpoint on a dataset's held-out split, at its own or another resolution."""

from __future__ import annotations

import json
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


def run_eval(checkpoint: str, data: str = "digits", res: tuple[int, int] | None = None, out: str | None = None,
             few_shot: tuple[int, ...] = (), batch_size: int = 128, workers: int = 0) -> dict[str, Any]:
    """Top-1, top-5 (and the confusion matrix PNG, few-shot accuracies) of `checkpoint` on `data`."""
    model = load(checkpoint)
    if res:
        model.set_resolution(*res)
    pre = model.preprocess_cfg
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    ds = build_dataset(data, "test", eval_transform(pre))
    loader = DataLoader(ds, batch_size=batch_size, num_workers=workers, collate_fn=collate_skip)
    res_ = evaluate(model, loader, device=device)
    result: dict[str, Any] = {"checkpoint": checkpoint, "data": data, "resolution": list(model.cfg.img_size),
                              "top1": res_["top1"], "top5": res_["top5"], "loss": res_["loss"], "n": res_["n"],
                              "skipped": res_.get("skipped", 0)}
    if few_shot:
        result["few_shot"] = few_shot_on(model, data, few_shot, device=device)
    if out:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        save_confusion_png(res_["confusion"], model.labels or [], folder / "confusion.png",
                           f"{Path(checkpoint).name}: top-1 {100 * res_['top1']:.2f}%")
        (folder / "eval.json").write_text(json.dumps(result, indent=2))
    return result
