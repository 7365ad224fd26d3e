"""vit_serve.train.fewshot: the closed-form least-squares solver (against scikit-learn's Ridge) and the
paper's few-shot evaluation on the real digits set with a fixed random ViT."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vit_serve
from vit_serve.data import digits_tensors
from vit_serve.train.fewshot import (
    BIAS_CONSTANT,
    L2_GRID,
    extract_features,
    few_shot_eval,
    few_shot_eval_features,
    fit_least_squares,
    predict,
    select_l2,
)


def _targets(y: torch.Tensor, k: int) -> np.ndarray:
    return (2.0 * torch.nn.functional.one_hot(y, k).double() - 1.0).numpy()


def test_separable_data_is_classified_perfectly():
    g = torch.Generator().manual_seed(0)
    k, d = 5, 16
    centres = 4.0 * torch.randn(k, d, generator=g)
    y = torch.arange(k).repeat(20)
    x = centres[y] + 0.3 * torch.randn(len(y), d, generator=g)
    y_test = torch.arange(k).repeat(30)
    x_test = centres[y_test] + 0.3 * torch.randn(len(y_test), d, generator=g)
    for l2 in (1e-3, 1.0, 2.0**10):
        W = fit_least_squares(x, y, k, l2)
        assert W.shape == (d + 1, k) and W.dtype == torch.float64
        assert float((predict(W, x_test).argmax(1) == y_test).double().mean()) == 1.0


def test_recovers_a_known_linear_map():
    # Features that are a known linear image of the ±1 targets, f = t A + c: with a tiny λ the fitted map
    # inverts it, scoring every (new) image of class j exactly as the target vector 2·e_j − 1.
    g = torch.Generator().manual_seed(3)
    k, d = 4, 9
    A = torch.randn(k, d, generator=g, dtype=torch.float64)
    c = torch.randn(d, generator=g, dtype=torch.float64)
    y = torch.arange(k).repeat(5)
    W = fit_least_squares(torch.from_numpy(_targets(y, k)) @ A + c, y, k, l2=1e-9, standardize=False)
    y_new = torch.tensor([3, 0, 2, 1, 1])
    t_new = _targets(y_new, k)
    np.testing.assert_allclose(predict(W, torch.from_numpy(t_new) @ A + c).numpy(), t_new, atol=1e-6)


@pytest.mark.parametrize(("n", "d"), [(60, 8), (12, 40)])  # primal (N >= D) and dual (N < D) forms
def test_equals_sklearn_ridge(n, d):
    from sklearn.linear_model import Ridge

    g = torch.Generator().manual_seed(n)
    x = 3.0 + 2.0 * torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.arange(n) % 3
    t = _targets(y, 3)
    l2 = 0.7
    # The bias as an ordinary (regularised) weight on a column of ones.
    W = fit_least_squares(x, y, 3, l2, standardize=False, bias_constant=1.0)
    ref = Ridge(alpha=l2, fit_intercept=False).fit(np.hstack([x.numpy(), np.ones((n, 1))]), t)
    np.testing.assert_allclose(W.numpy(), ref.coef_.T, atol=1e-6)
    # An unregularised intercept.
    W = fit_least_squares(x, y, 3, l2, standardize=False, bias_constant=None)
    ref = Ridge(alpha=l2, fit_intercept=True).fit(x.numpy(), t)
    np.testing.assert_allclose(W[:-1].numpy(), ref.coef_.T, atol=1e-6)
    np.testing.assert_allclose(W[-1].numpy(), ref.intercept_, atol=1e-6)
    # The default (big_vision): whitened features, a constant column of 100; W folds both back in.
    W = fit_least_squares(x, y, 3, l2)
    xn = x.numpy()
    z = np.hstack([(xn - xn.mean(0)) / (xn.std(0) + 1e-5), np.full((n, 1), BIAS_CONSTANT)])
    ref = Ridge(alpha=l2, fit_intercept=False).fit(z, t)
    np.testing.assert_allclose(predict(W, x).numpy(), ref.predict(z), atol=1e-6)


def test_select_l2_matches_brute_force_leave_one_out(one_thread):
    g = torch.Generator().manual_seed(5)
    k, d = 3, 10
    y = torch.arange(k).repeat(6)
    x = torch.randn(k, d, generator=g)[y] + 1.5 * torch.randn(len(y), d, generator=g)
    grid = (2.0**-4, 1.0, 2.0**4, 2.0**8)
    kw = {"standardize": False, "bias_constant": 1.0}  # nothing data-dependent besides the fit: LOO is exact

    def loo(l2):
        acc, err = 0, 0.0
        for i in range(len(y)):
            keep = torch.arange(len(y)) != i
            s = predict(fit_least_squares(x[keep], y[keep], k, l2, **kw), x[i : i + 1])[0]
            acc += int(s.argmax() == y[i])
            err += float(((s - torch.from_numpy(_targets(y[i : i + 1], k)[0])) ** 2).mean())
        return acc, -err, l2

    assert select_l2(x, y, k, grid, **kw) == max(loo(l2) for l2 in grid)[2]


@pytest.fixture(scope="module")
def digits16():
    cfg = vit_serve.PreprocessConfig(input_size=(16, 16), crop_pct=1.0)
    x_train, y_train = digits_tensors("train", cfg)
    x_test, y_test = digits_tensors("test", cfg)
    return x_train, y_train, x_test, y_test


def _random_vit():
    torch.manual_seed(0)  # a FIXED random projection
    cfg = vit_serve.ViTConfig(
        img_size=16, patch_size=4, embed_dim=64, depth=2, num_heads=4, mlp_dim=128, num_classes=10
    )
    return vit_serve.create_model(cfg)


def test_few_shot_on_digits_with_a_random_vit(digits16, one_thread):
    x_train, y_train, x_test, y_test = digits16
    model = _random_vit()
    shots = (1, 5, 10, 25)
    runs = [few_shot_eval(model, x_train, y_train, x_test, y_test, shots=shots, seed=s) for s in range(3)]
    mean = {s: float(np.mean([r[s] for r in runs])) for s in shots}
    print("few-shot top-1 (random ViT, mean of 3 seeds):", {s: round(a, 3) for s, a in mean.items()})
    assert all(set(r) == set(shots) for r in runs)
    assert mean[1] > 0.15  # chance is 0.10
    assert mean[25] > 0.4
    assert mean[1] < mean[5] < mean[10] < mean[25]  # grows with shots
    # Deterministic for a fixed seed, and the same as on precomputed features of the whole sets.
    again = few_shot_eval(model, x_train, y_train, x_test, y_test, shots=shots, seed=0)
    assert again == runs[0]
    f_train, f_test = extract_features(model, x_train), extract_features(model, x_test, batch_size=100)
    assert f_train.shape == (len(x_train), 64)
    feats = few_shot_eval_features(f_train, y_train, f_test, y_test, shots=shots, seed=0)
    assert feats == pytest.approx(runs[0], abs=1e-9)
    # λ picked by leave-one-out (1-shot keeps the fixed λ).
    tuned = few_shot_eval_features(f_train, y_train, f_test, y_test, shots=shots, seed=0, l2_grid=L2_GRID)
    print("few-shot top-1 with l2 chosen by leave-one-out (seed 0):", {s: round(a, 3) for s, a in tuned.items()})
    assert tuned[1] == runs[0][1] and tuned[25] > 0.4


def test_too_many_shots_raises(digits16):
    x_train, y_train, x_test, y_test = digits16
    smallest = int(torch.bincount(y_train).min())
    with pytest.raises(ValueError, match="smallest training class"):
        few_shot_eval(_random_vit(), x_train, y_train, x_test, y_test, shots=(1, smallest + 1))
    with pytest.raises(ValueError):
        few_shot_eval(_random_vit(), x_train, y_train, x_test, y_test, shots=(0,))
