"""vit_serve.train.evaluate: top-k, confusion matrix (against scikit-learn), the eval loop, the PNG."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from vit_serve.train.evaluate import confusion_matrix, evaluate, save_confusion_png, topk_accuracy


def test_topk_accuracy_by_hand():
    logits = torch.tensor(
        [
            [0.9, 0.1, 0.0, 0.0, 0.0, 0.0],  # true 0: top-1
            [0.1, 0.2, 0.9, 0.0, 0.0, 0.0],  # true 1: second
            [0.6, 0.5, 0.4, 0.3, 0.2, 0.1],  # true 5: last, outside the top-5
            [0.0, 0.1, 0.2, 0.3, 0.4, 0.5],  # true 1: fifth
        ]
    )
    y = torch.tensor([0, 1, 5, 1])
    acc = topk_accuracy(logits, y, ks=(1, 2, 5, 6))
    assert acc == {1: 0.25, 2: 0.5, 5: 0.75, 6: 1.0}
    # k beyond the number of classes is clamped: top-5 of a 3-class problem is always right.
    assert topk_accuracy(torch.randn(7, 3), torch.randint(0, 3, (7,)), ks=(1, 5))[5] == 1.0
    with pytest.raises(ValueError):
        topk_accuracy(logits, y[:3])


def test_confusion_matrix_equals_sklearn():
    from sklearn.metrics import confusion_matrix as sk_confusion

    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 7, (500,), generator=g)
    pred = torch.where(torch.rand(500, generator=g) < 0.6, y, torch.randint(0, 7, (500,), generator=g))
    pred[pred == 6] = 5  # a class never predicted
    cm = confusion_matrix(pred, y, 7)
    assert cm.dtype == torch.long and cm.shape == (7, 7)
    np.testing.assert_array_equal(cm.numpy(), sk_confusion(y.numpy(), pred.numpy(), labels=list(range(7))))
    assert cm[2, 3] == int(((y == 2) & (pred == 3)).sum())  # rows = true, cols = predicted
    with pytest.raises(ValueError):
        confusion_matrix(torch.tensor([7]), torch.tensor([0]), 7)


class _Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(12, 4)
        self.drop = torch.nn.Dropout(0.5)  # must be off in evaluation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(x.flatten(1)))


def test_evaluate_matches_direct_computation():
    model = _Linear().train()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50, 3, 2, 2, generator=g)
    y = torch.randint(0, 4, (50,), generator=g)
    loader = [(x[:20], y[:20]), (None, None, 3), (x[20:], y[20:], 2), (x[:0], y[:0])]
    out = evaluate(model, loader)
    assert model.training  # mode restored
    with torch.no_grad():
        logits = model.eval()(x)
    assert out["n"] == 50 and out["skipped"] == 5
    assert out["top1"] == pytest.approx(float((logits.argmax(1) == y).float().mean()))
    assert out["top5"] == 1.0  # k = min(5, 4 classes)
    assert out["loss"] == pytest.approx(float(F.cross_entropy(logits, y)), rel=1e-6)
    assert torch.equal(out["confusion"], confusion_matrix(logits.argmax(1), y, 4))
    assert int(out["confusion"].sum()) == 50


def test_evaluate_autocast_bf16():
    model = _Linear()
    x, y = torch.randn(16, 3, 2, 2), torch.randint(0, 4, (16,))
    ref = evaluate(model, [(x, y)])
    out = evaluate(model, [(x, y)], device="cpu", amp_dtype=torch.bfloat16)
    assert out["n"] == 16 and abs(out["loss"] - ref["loss"]) < 0.05


@pytest.mark.parametrize("k", [10, 40])
def test_save_confusion_png(tmp_path, k):
    g = torch.Generator().manual_seed(k)
    y = torch.randint(0, k, (800,), generator=g)
    pred = torch.where(torch.rand(800, generator=g) < 0.7, y, torch.randint(0, k, (800,), generator=g))
    cm = confusion_matrix(pred, y, k)
    path = tmp_path / "sub" / "cm.png"
    out = save_confusion_png(cm, [f"class {i}" for i in range(k)], path, title="test")
    assert out == path and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as im:
        assert im.width >= 400 and im.height >= 400
    save_confusion_png(cm, None, path, title="again")  # overwrites in place
    assert sorted(p.name for p in path.parent.iterdir()) == ["cm.png"]  # no temp file left behind
    with pytest.raises(ValueError):
        save_confusion_png(cm, ["a", "b"], tmp_path / "bad.png", title="bad")
    assert not (tmp_path / "bad.png").exists()
