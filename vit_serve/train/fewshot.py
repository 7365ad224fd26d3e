"""Few-shot linear evaluation of frozen representations (ViT paper §4.1 "Metrics", App. B.1).

"Few-shot accuracies are obtained by solving a regularized least-squares regression problem that maps the
(frozen) representation of a subset of training images to {−1, 1}^K target vectors." The solution is closed
form, so it is cheap enough to run during pre-training.

Conventions, following big_vision's `evaluators/fewshot_lsr.py` (the paper's evaluation code):

* the representation is the pre-logits vector (`forward_head(forward_features(x), pre_logits=True)`);
* features are whitened with the few-shot subset's own mean and std (+1e-5), then a constant column of
  `BIAS_CONSTANT` = 100 is appended: the bias is then regularised 100² times less than the weights;
* targets are 2·onehot − 1;
* the primal form (XᵀX + λI)⁻¹XᵀT when N >= D, the dual Xᵀ(XXᵀ + λI)⁻¹T when N < D, in float64 via
  an eigendecomposition (so many λ cost one decomposition);
* λ is fixed at `DEFAULT_L2` = 2¹⁰, big_vision's `l2_reg` for its ViT few-shot evaluators (shots 1, 5, 10, 25),
  and training images are sampled per class with `numpy.random.default_rng(seed)`, the smaller shot counts
  being prefixes of the larger ones.

We default to that fixed λ because it is what produced the paper's numbers and it is the only choice that
works at 1 shot (no held-out data). `l2_grid` (e.g. `L2_GRID` = 2⁻¹⁰ … 2¹⁰) optionally picks λ per shot count
by exact leave-one-out accuracy on the few-shot training subset (closed form via the hat matrix; the whitening
statistics are not recomputed per left-out point); 1-shot always uses the fixed λ.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = [
    "BIAS_CONSTANT",
    "DEFAULT_L2",
    "L2_GRID",
    "extract_features",
    "few_shot_eval",
    "few_shot_eval_features",
    "fit_least_squares",
    "predict",
    "select_l2",
]

BIAS_CONSTANT = 100.0
DEFAULT_L2 = 2.0**10
L2_GRID: tuple[float, ...] = tuple(2.0**k for k in range(-10, 11))


@torch.no_grad()
def extract_features(
    model: torch.nn.Module, x: torch.Tensor, batch_size: int = 256, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """Frozen representations [N, D] (float32, on the CPU) of images x [N, C, H, W], in eval mode, in batches.

    D is the pre-logits width (embed_dim, or representation_size when the model has a pre-logits layer).
    The model must already be on `device`; its train/eval mode is restored afterwards.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    was_training = model.training
    model.eval()
    try:
        out = [
            model.forward_head(model.forward_features(x[i : i + batch_size].to(device)), pre_logits=True).float().cpu()
            for i in range(0, x.shape[0], batch_size)
        ]
    finally:
        model.train(was_training)
    if not out:
        return torch.empty(0, model.num_features)
    return torch.cat(out)


class _Ridge:
    """L2-regularised least squares on ±1 targets, factorised once so that any λ is cheap (float64)."""

    def __init__(
        self, feats: torch.Tensor, y: torch.Tensor, num_classes: int, standardize: bool, bias_constant: float | None
    ) -> None:
        f = torch.as_tensor(feats).detach().cpu().double()
        y = torch.as_tensor(y).detach().cpu().long().reshape(-1)
        if f.ndim != 2 or f.shape[0] != y.shape[0] or f.shape[0] == 0:
            raise ValueError(f"expected feats [N, D] and y [N] with N > 0, got {tuple(f.shape)} and {tuple(y.shape)}")
        if int(y.min()) < 0 or int(y.max()) >= num_classes:
            raise ValueError(f"labels must lie in [0, {num_classes})")
        n, d = f.shape
        self.d = d
        self.bias_constant = bias_constant
        # Whitening statistics (population std + 1e-5, as big_vision); centring also when the intercept is exact.
        self.mean = f.mean(0) if (standardize or bias_constant is None) else torch.zeros(d, dtype=f.dtype)
        self.std = f.std(0, unbiased=False) + 1e-5 if standardize else torch.ones(d, dtype=f.dtype)
        x = (f - self.mean) / self.std
        t = 2.0 * torch.nn.functional.one_hot(y, num_classes).double() - 1.0
        self.t_mean = t.mean(0) if bias_constant is None else torch.zeros(num_classes, dtype=t.dtype)
        t = t - self.t_mean  # centred targets for the exact (unregularised) intercept
        if bias_constant is not None:
            x = torch.cat([x, torch.full((n, 1), float(bias_constant), dtype=x.dtype)], dim=1)
        self.x, self.t = x, t
        self.primal = n >= x.shape[1]
        if self.primal:  # (XᵀX + λI)⁻¹XᵀT = V diag(1/(e+λ)) Vᵀ XᵀT
            e, v = torch.linalg.eigh(x.T @ x)
            self.lhs, self.rhs = v, v.T @ (x.T @ t)
        else:  # Xᵀ(XXᵀ + λI)⁻¹T = XᵀQ diag(1/(e+λ)) QᵀT
            e, v = torch.linalg.eigh(x @ x.T)
            self.lhs, self.rhs = x.T @ v, v.T @ t
        self.eigs, self.v = e.clamp(min=0.0), v

    def coef(self, l2: float) -> torch.Tensor:
        """Weights [P, K] on the design matrix (whitened features, plus the constant column if any)."""
        if not l2 > 0:
            raise ValueError(f"l2 must be > 0, got {l2}")
        return (self.lhs / (self.eigs + l2)) @ self.rhs

    def weights(self, l2: float) -> torch.Tensor:
        """Weights [D + 1, K] on the raw features and a column of ones: whitening and bias folded in."""
        a = self.coef(l2)
        w = a[: self.d] / self.std[:, None]
        b = self.t_mean - (self.mean / self.std) @ a[: self.d]
        if self.bias_constant is not None:
            b = b + self.bias_constant * a[self.d]
        return torch.cat([w, b[None]], dim=0)

    def loo_predictions(self, l2: float) -> torch.Tensor:
        """Exact leave-one-out predictions [N, K] (for fixed whitening): (ŷ_i − h_ii t_i) / (1 − h_ii)."""
        if self.primal:
            z = self.x @ self.v  # H = Z diag(1/(e+λ)) Zᵀ
            s = 1.0 / (self.eigs + l2)
            h = (z * z * s).sum(1)
            fitted = (z * s) @ self.rhs
        else:  # H = Q diag(e/(e+λ)) Qᵀ
            s = self.eigs / (self.eigs + l2)
            h = (self.v * self.v * s).sum(1)
            fitted = (self.v * s) @ self.rhs
        loo = (fitted - h[:, None] * self.t) / (1.0 - h).clamp(min=1e-12)[:, None]
        return loo + self.t_mean


def fit_least_squares(
    feats: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    l2: float = DEFAULT_L2,
    *,
    standardize: bool = True,
    bias_constant: float | None = BIAS_CONSTANT,
) -> torch.Tensor:
    """Closed-form ridge regression of features [N, D] onto 2·onehot(y) − 1 [N, K]; returns W [D + 1, K] (float64).

    The last row of W is the bias: `predict(W, f) = f @ W[:-1] + W[-1]`. With the defaults this is big_vision's
    few-shot solver (whitened features, constant column of 100, λ = 2¹⁰). `standardize=False, bias_constant=1`
    is plain ridge on [X, 1] (the bias regularised like any weight, = sklearn `Ridge(fit_intercept=False)` on
    the padded features); `bias_constant=None` leaves the intercept unregularised (= `Ridge(fit_intercept=True)`).
    """
    return _Ridge(feats, y, num_classes, standardize, bias_constant).weights(l2)


def predict(W: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:  # noqa: N803 (the paper's W)
    """Scores [N, K] (float64) of features [N, D] under W [D + 1, K] from :func:`fit_least_squares`."""
    f = torch.as_tensor(feats).to(device=W.device, dtype=W.dtype)
    return f @ W[:-1] + W[-1]


def select_l2(
    feats: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    l2_grid: Sequence[float] = L2_GRID,
    *,
    standardize: bool = True,
    bias_constant: float | None = BIAS_CONSTANT,
) -> float:
    """The λ in `l2_grid` with the best leave-one-out accuracy on (feats, y); ties go to the lower LOO squared
    error, then to the larger λ. Needs at least 2 examples of a class for its LOO predictions to mean anything."""
    if not l2_grid:
        raise ValueError("l2_grid is empty")
    solver = _Ridge(feats, y, num_classes, standardize, bias_constant)
    y = torch.as_tensor(y).cpu().long().reshape(-1)
    target = solver.t + solver.t_mean
    best: tuple[float, float, float] | None = None
    for l2 in sorted(float(v) for v in l2_grid):
        loo = solver.loo_predictions(l2)
        key = (float((loo.argmax(1) == y).double().mean()), -float(((loo - target) ** 2).mean()), l2)
        if best is None or key >= best:
            best = key
    assert best is not None
    return best[2]


def _sample_shots(y_train: torch.Tensor, shots: Sequence[int], seed: int) -> dict[int, torch.Tensor]:
    """Training indices per shot count: `s` images of every class present, drawn with default_rng(seed).

    As big_vision: one permutation per class, so each shot count's subset is a prefix of the larger ones'.
    """
    labels = y_train.numpy()
    classes = np.unique(labels)
    smallest = int(min(np.sum(labels == c) for c in classes))
    for s in shots:
        if s < 1:
            raise ValueError(f"shots must be >= 1, got {s}")
        if s > smallest:
            raise ValueError(f"{s} shots asked, but the smallest training class has only {smallest} images")
    rng = np.random.default_rng(seed)
    class_indices = [rng.permutation(np.flatnonzero(labels == c)) for c in classes]
    return {int(s): torch.from_numpy(np.concatenate([ci[:s] for ci in class_indices])) for s in shots}


def _labels(y: torch.Tensor, n: int, what: str) -> torch.Tensor:
    y = torch.as_tensor(y).cpu().long().reshape(-1)
    if y.shape[0] != n:
        raise ValueError(f"{what}: {n} images or features but {y.shape[0]} labels")
    if n == 0:
        raise ValueError(f"{what} is empty")
    return y


def _score(
    f_train: torch.Tensor,
    y_train: torch.Tensor,
    f_test: torch.Tensor,
    y_test: torch.Tensor,
    subsets: dict[int, torch.Tensor],
    l2: float,
    l2_grid: Sequence[float] | None,
) -> dict[int, float]:
    num_classes = int(max(int(y_train.max()), int(y_test.max()))) + 1
    results: dict[int, float] = {}
    for s, idx in subsets.items():
        f, y = f_train[idx], y_train[idx]
        lam = select_l2(f, y, num_classes, l2_grid) if (l2_grid is not None and s >= 2) else l2
        pred = predict(fit_least_squares(f, y, num_classes, lam), f_test).argmax(1)
        results[s] = float((pred == y_test).double().mean())
    return results


def few_shot_eval_features(
    f_train: torch.Tensor,
    y_train: torch.Tensor,
    f_test: torch.Tensor,
    y_test: torch.Tensor,
    shots: Sequence[int] = (1, 5, 10, 25),
    seed: int = 0,
    l2: float = DEFAULT_L2,
    l2_grid: Sequence[float] | None = None,
) -> dict[int, float]:
    """Few-shot top-1 accuracy on precomputed features [N, D] of the whole training and test sets
    (see :func:`few_shot_eval`): {shots: accuracy}."""
    y_train = _labels(y_train, f_train.shape[0], "training set")
    y_test = _labels(y_test, f_test.shape[0], "test set")
    return _score(f_train, y_train, f_test, y_test, _sample_shots(y_train, shots, seed), l2, l2_grid)


def few_shot_eval(
    model: torch.nn.Module,
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_test: torch.Tensor,
    y_test: torch.Tensor,
    shots: Sequence[int] = (1, 5, 10, 25),
    seed: int = 0,
    device: str | torch.device = "cpu",
    l2: float = DEFAULT_L2,
    l2_grid: Sequence[float] | None = None,
    batch_size: int = 256,
) -> dict[int, float]:
    """The paper's few-shot linear evaluation: {shots: test top-1 accuracy} for each shot count.

    For each shot count, `shots` training images of every class in y_train are drawn (fixed `seed`; smaller
    counts are prefixes of larger ones), a least-squares classifier is fitted on their frozen representations
    (:func:`fit_least_squares`, λ = `l2`, or chosen from `l2_grid` by leave-one-out) and scored on the whole
    test set. Features are extracted once, only for the images drawn (the largest shot count's subset) and the
    test set. ValueError when a shot count exceeds the smallest training class.
    """
    y_train = _labels(y_train, x_train.shape[0], "training set")
    y_test = _labels(y_test, x_test.shape[0], "test set")
    subsets = _sample_shots(y_train, shots, seed)
    used = torch.unique(torch.cat(list(subsets.values())))  # sorted; every subset lies inside the largest
    f_used = extract_features(model, x_train[used], batch_size, device)
    f_test = extract_features(model, x_test, batch_size, device)
    local = {s: torch.searchsorted(used, idx) for s, idx in subsets.items()}  # positions inside `used`
    return _score(f_used, y_train[used], f_test, y_test, local, l2, l2_grid)
