"""vit_serve.train.evaluate: top-k, confusion matrix (against scikit-learn), the eval loop, the PNG.

The XLA-facing parts are checked on the CPU: the confusion counts' output shape under PyTorch's fake-tensor tracer
(`make_fx`, as a lazy-tensor backend sees it: without the data), and the per-batch step hook (`xla.sync` on XLA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from vit_serve.train import xla
from vit_serve.train.evaluate import (
    confusion_counts,
    confusion_matrix,
    default_step,
    evaluate,
    save_confusion_png,
    topk_accuracy,
)


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
    np.testing.assert_array_equal(confusion_counts(pred, y, 7).numpy(), cm.numpy())  # the loop's counter, unchecked


def test_confusion_counts_have_a_shape_known_without_the_data():
    """Traced with fake tensors (no values), the counts are [K, K]: one evaluation batch is one fixed-shape graph
    on XLA. `torch.bincount`'s length depends on the largest id, so its trace has a data-dependent size."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def out_shape(fn) -> tuple:
        y, pred = torch.tensor([0, 2, 1, 2]), torch.tensor([0, 1, 1, 2])
        graph = make_fx(fn, tracing_mode="fake")(pred, y)
        (out,) = [n for n in graph.graph.nodes if n.op == "output"]
        return tuple(out.args[0].meta["val"].shape)

    assert out_shape(lambda p, y: confusion_counts(p, y, 3)) == (3, 3)
    assert all(isinstance(d, int) for d in out_shape(lambda p, y: confusion_counts(p, y, 3)))
    bincount_shape = out_shape(lambda p, y: torch.bincount(y * 3 + p, minlength=9))
    assert not isinstance(bincount_shape[0], int)  # the reference: what the check tells apart


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


class _Counting(_Linear):
    def __init__(self) -> None:
        super().__init__()
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        return super().forward(x)


def test_evaluate_calls_the_step_hook_after_every_batch():
    """On XLA the hook is `xla.sync`: a graph cut after each batch, not one graph over the whole validation set."""
    model = _Counting()
    x, y = torch.randn(30, 3, 2, 2), torch.randint(0, 4, (30,))
    loader = [(x[:10], y[:10]), (None, None, 2), (x[10:20], y[10:20]), (x[:0], y[:0]), (x[20:], y[20:])]
    seen: list[int] = []
    out = evaluate(model, loader, step=lambda: seen.append(model.forwards))
    assert seen == [1, 2, 3]  # once per batch the model ran on, right after it (before the next forward)
    assert out["n"] == 30 and out["skipped"] == 2
    assert default_step(torch.device("xla")) is xla.sync
    assert default_step(torch.device("cpu")) is None


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
