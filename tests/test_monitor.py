"""`vit_serve.monitor` against scipy: the two-sample KS statistic and its asymptotic p-value, the Kolmogorov
survival function, the Mahalanobis distance at full rank, the energy score, the drift report's Bonferroni
correction, the threshold as the calibration quantile, and the Reference's serialised form (round trip and
refusals)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
from scipy import special, stats
from scipy.spatial import distance

from vit_serve import monitor, reference_sketch


def _ref(rng: np.random.Generator, d: int = 6, k: int = 4, n_fit: int = 200, n_cal: int = 150,
         embeddings: bool = True) -> tuple[monitor.Reference, np.ndarray]:
    fit_e = rng.normal(size=(n_fit, d)) * np.linspace(0.5, 3, d)
    cal_e = rng.normal(size=(n_cal, d)) * np.linspace(0.5, 3, d)
    w = rng.normal(size=(d, k))
    ref = monitor.build_reference(fit_e if embeddings else None, fit_e @ w, cal_e if embeddings else None, cal_e @ w,
                                  source="test")
    return ref, cal_e


@pytest.mark.parametrize(("n", "m", "shift"), [(50, 80, 0.0), (200, 150, 0.3), (30, 400, 1.0)])
def test_ks_2samp_is_scipys(n, m, shift):
    rng = np.random.default_rng(n + m)
    a, b = rng.normal(size=n), rng.normal(shift, 1.0, size=m)
    d, p = monitor.ks_2samp(a, b)
    assert d == pytest.approx(stats.ks_2samp(a, b).statistic, abs=1e-12)
    assert p == pytest.approx(special.kolmogorov(math.sqrt(n * m / (n + m)) * d), rel=1e-9, abs=1e-12)


def test_ks_2samp_with_ties_and_empty():
    a, b = np.array([0, 0, 1, 1, 2.0]), np.array([1, 1, 1, 3.0])
    assert monitor.ks_2samp(a, b)[0] == pytest.approx(stats.ks_2samp(a, b).statistic)
    assert monitor.ks_2samp(np.zeros(0), b) == (0.0, 1.0)


def test_kolmogorov_sf_is_scipys():
    for z in np.concatenate([np.linspace(0.01, 3.0, 300), [0.5, 0.999, 1.0, 1.001, 4, 6]]):
        assert monitor.kolmogorov_sf(float(z)) == pytest.approx(special.kolmogorov(z), rel=1e-8, abs=1e-14), z
    assert monitor.kolmogorov_sf(0.0) == 1.0


def test_mahalanobis_at_full_rank_is_scipys():
    rng = np.random.default_rng(1)
    e = rng.normal(size=(100, 5)) @ rng.normal(size=(5, 5))
    mean, basis, eigvals, resid = monitor.fit_gaussian(e)
    assert basis.shape == (5, 5) and resid == 0.0
    s = reference_sketch.SHRINKAGE * eigvals.mean()
    vi = np.linalg.inv(np.cov(e, rowvar=False) + s * np.eye(5))
    x = rng.normal(size=(7, 5)) * 3
    got = monitor.mahalanobis(x, mean, basis, eigvals, resid)
    want = [distance.mahalanobis(row, e.mean(0), vi) ** 2 for row in x]
    np.testing.assert_allclose(got, want, rtol=1e-4)


def test_mahalanobis_low_rank_counts_the_residual():
    rng = np.random.default_rng(2)
    e = rng.normal(size=(40, 8))
    mean, basis, eigvals, resid = monitor.fit_gaussian(e, rank=3)
    assert basis.shape == (8, 3) and resid > 0
    x = rng.normal(size=(4, 8))
    d = x - mean
    p = d @ basis
    s = reference_sketch.SHRINKAGE * eigvals.mean()
    want = (p ** 2 / (eigvals + s)).sum(1) + ((d ** 2).sum(1) - (p ** 2).sum(1)) / (resid + s)
    np.testing.assert_allclose(monitor.mahalanobis(x, mean, basis, eigvals, resid), want, rtol=1e-4)


def test_energy_and_confidence():
    rng = np.random.default_rng(3)
    z = rng.normal(size=(6, 10)) * 5
    np.testing.assert_allclose(monitor.energy(z), -special.logsumexp(z, axis=1), rtol=1e-5)
    np.testing.assert_allclose(monitor.softmax_confidence(z), special.softmax(z, axis=1).max(1), rtol=1e-5)
    np.testing.assert_allclose(monitor.softmax_confidence(z, "sigmoid"), special.expit(z.max(1)), rtol=1e-5)


def test_threshold_is_the_calibration_quantile():
    ref, cal = _ref(np.random.default_rng(4))
    assert ref.method == "mahalanobis" and ref.needs_embedding and ref.quantile == monitor.DEFAULT_QUANTILE
    np.testing.assert_allclose(ref.scores, monitor.mahalanobis(cal, ref.mean, ref.basis, ref.eigvals,
                                                               ref.residual_var))
    assert ref.threshold == pytest.approx(np.quantile(ref.scores.astype(np.float64), 0.95))
    energy_ref, _ = _ref(np.random.default_rng(4), embeddings=False)
    assert energy_ref.method == "energy" and not energy_ref.needs_embedding
    assert energy_ref.threshold == pytest.approx(np.quantile(energy_ref.scores.astype(np.float64), 0.95))
    with pytest.raises(ValueError, match="quantile"):
        monitor.build_reference(None, np.zeros((3, 2)), None, np.zeros((3, 2)), quantile=1.0)


def test_drift_is_bonferroni_corrected_ks():
    rng = np.random.default_rng(5)
    ref, _ = _ref(rng)
    w = 120
    e = rng.normal(size=(w, ref.dim)) * np.linspace(0.5, 3, ref.dim) + 0.8  # shifted
    logits = rng.normal(size=(w, ref.num_classes))
    conf = monitor.softmax_confidence(logits)
    scores = monitor.mahalanobis(e, ref.mean, ref.basis, ref.eigvals, ref.residual_var)
    proj = monitor.project(ref, e, logits)
    window = monitor.Window(ref, size=100)
    window.add(conf, scores, proj, logits.argmax(1))
    assert window.count == w
    report = window.report(0.01, 50)
    keep = np.arange(w - 100, w)  # the last 100
    feats = {"confidence": (conf[keep], ref.confidences), "ood_score": (scores[keep], ref.scores)}
    feats |= {f"projection_{i}": (proj[keep, i], ref.projections[:, i]) for i in range(proj.shape[1])}
    ps = []
    for name, (a, b) in feats.items():
        d = stats.ks_2samp(a, b).statistic
        p = special.kolmogorov(math.sqrt(len(a) * len(b) / (len(a) + len(b))) * d)
        assert report.features[name][0] == pytest.approx(d, abs=1e-6), name
        assert report.features[name][1] == pytest.approx(p, rel=1e-6, abs=1e-12), name
        ps.append(p)
    assert report.p_value == pytest.approx(min(1.0, min(ps) * len(feats)), rel=1e-6, abs=1e-12)
    assert report.statistic == pytest.approx(max(report.features[n][0] for n in feats))
    assert report.alarm and report.window == 100
    assert report.ood_rate == pytest.approx(float((scores[keep] > ref.threshold).mean()))
    assert not window.report(0.01, 101).alarm  # too few images


def test_reference_round_trip_and_refusals():
    ref, _ = _ref(np.random.default_rng(6))
    d = ref.to_dict()
    back = monitor.Reference.from_dict(copy.deepcopy(d))
    for k in reference_sketch.ARRAYS:
        np.testing.assert_array_equal(getattr(back, k), getattr(ref, k))
    assert (back.method, back.threshold, back.quantile, back.n_fit, back.num_classes, back.source) == (
        ref.method, ref.threshold, ref.quantile, ref.n_fit, ref.num_classes, ref.source)
    assert "Mahalanobis" in back.describe()
    with pytest.raises(ValueError, match="version 2 is not readable"):
        monitor.Reference.from_dict({**d, "version": 2})
    with pytest.raises(ValueError, match="missing threshold"):
        monitor.Reference.from_dict({k: v for k, v in d.items() if k != "threshold"})
    with pytest.raises(ValueError, match="not valid base64"):
        monitor.Reference.from_dict({**d, "mean": {**d["mean"], "float32": "not*base64!"}})
    with pytest.raises(ValueError, match="bytes"):
        monitor.Reference.from_dict({**d, "mean": {**d["mean"], "shape": [d["mean"]["shape"][0] + 1]}})
    with pytest.raises(ValueError, match="method"):
        monitor.Reference.from_dict({**d, "method": "knn"})
    with pytest.raises(ValueError, match="JSON object"):
        monitor.Reference.from_dict([1])


def test_score_histogram():
    ref, _ = _ref(np.random.default_rng(7))
    scores = np.array([0.0, 1.0, 500.0], np.float32)
    h = monitor.score_histogram(ref, scores, bins=10)
    assert len(h.edges) == 11 and sum(h.window) == 3 and sum(h.reference) == len(ref.scores)
    assert h.edges[-1] == pytest.approx(500.0)
