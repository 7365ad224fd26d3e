"""Watching what the gateway serves (issue 24), through a real uvicorn and real HTTP / gRPC clients: a tiny random
ViT (32x32) whose reference is built here on structured images (smooth gradients and blobs), served beside the
same model without one.

References, computed here from the model run directly (torch) on the same images: the OOD score is the
Mahalanobis distance of the embedding, (e - mu)^T (Sigma + s I)^-1 (e - mu) by np.linalg on the reference's
arrays; the drift statistic and p-value are scipy's two-sample KS statistic and scipy.special.kolmogorov of the
scaled statistic, Bonferroni-corrected over the features.
"""

from __future__ import annotations

import io
import math

import httpx
import numpy as np
import pytest
import torch
from gateway_helpers import LABELS, live_app, metric, settings_for
from PIL import Image
from scipy import special, stats

import vit_serve
from vit_serve.monitor import build_reference
from vit_serve.preprocess import PreprocessConfig, preprocess
from vit_serve.reference import outputs_of, reference_from_datasets

RES = 32
WINDOW = 60
SHRINK = 1e-3  # vit_serve.reference_sketch.SHRINKAGE: s = 1e-3 x the mean eigenvalue


def _png(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def structured(n: int, seed: int) -> list[bytes]:
    """In-distribution images: a two-colour linear gradient at a random angle with a soft disc."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:RES, 0:RES] / (RES - 1)
    out = []
    for _ in range(n):
        a, b = rng.uniform(0, 255, (2, 3))
        t = np.cos(rng.uniform(0, np.pi)) * xx + np.sin(rng.uniform(0, np.pi)) * yy
        t = (t - t.min()) / (np.ptp(t) + 1e-9)
        img = a + (b - a) * t[..., None]
        cy, cx, r = [*rng.uniform(0.2, 0.8, 2).tolist(), rng.uniform(0.1, 0.3)]
        disc = np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * r * r))[..., None]
        img = img * (1 - disc) + rng.uniform(0, 255, 3) * disc
        out.append(_png(np.clip(img, 0, 255).astype(np.uint8)))
    return out


def noise(n: int, seed: int) -> list[bytes]:
    """Out of distribution: uniform noise."""
    rng = np.random.default_rng(seed)
    return [_png(rng.integers(0, 256, (RES, RES, 3), dtype=np.uint8)) for _ in range(n)]


@pytest.fixture(scope="module")
def repo(tmp_path_factory, randomize):
    """REPO with watched.safetensors (a reference fitted on 250 structured images, calibrated on 200 others),
    energy.safetensors (an energy reference of the same images' logits) and plain.safetensors (the same weights,
    no reference)."""
    model = randomize(vit_serve.create_model("Ti/16", num_classes=len(LABELS), depth=2, img_size=RES), seed=3)
    model.labels = list(LABELS)
    model.preprocess_cfg = cfg = PreprocessConfig(input_size=(RES, RES))
    fit = [(preprocess(b, cfg), 0) for b in structured(250, 10)]
    cal = [(preprocess(b, cfg), 0) for b in structured(200, 11)]
    model.reference = reference_from_datasets(model, fit, cal, "structured test images")
    folder = tmp_path_factory.mktemp("monitoring_repo")
    vit_serve.save(model, folder / "watched.safetensors")
    _, fit_logits = outputs_of(model, [torch.stack([t for t, _ in fit])])
    _, cal_logits = outputs_of(model, [torch.stack([t for t, _ in cal])])
    model.reference = build_reference(None, fit_logits, None, cal_logits, source="logits only")
    vit_serve.save(model, folder / "energy.safetensors")
    model.reference = None
    vit_serve.save(model, folder / "plain.safetensors")
    return folder


@pytest.fixture(scope="module")
def watched(repo):
    """The watched checkpoint loaded by the library (its reference with it)."""
    model = vit_serve.load(repo / "watched.safetensors").eval()
    assert model.reference is not None and model.reference.basis.shape == (192, 192)  # full rank
    return model


class Direct:
    """The model's numbers on images, one at a time as the gateway runs them: logits, embedding, and from them
    (independently of vit_serve.monitor) the Mahalanobis score, the confidence and the projections."""

    def __init__(self, model):
        self.model, ref = model, model.reference
        self.ref = ref
        lam = ref.eigvals.astype(np.float64)
        b = ref.basis.astype(np.float64)
        self.mean = ref.mean.astype(np.float64)
        self.cov = b @ np.diag(lam) @ b.T + SHRINK * lam.mean() * np.eye(len(lam))
        self.basis8 = b[:, :8]

    def outputs(self, images: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        logits, embs = [], []
        with torch.inference_mode():
            for data in images:
                lo, e = self.model.forward_embedding(preprocess(data, self.model.preprocess_cfg)[None])
                logits.append(lo.numpy()[0])
                embs.append(e.numpy()[0])
        return np.array(logits), np.array(embs)

    def scores(self, embs: np.ndarray) -> np.ndarray:
        d = embs.astype(np.float64) - self.mean
        return np.einsum("bi,bi->b", d, np.linalg.solve(self.cov, d.T).T)

    def features(self, images: list[bytes]) -> dict[str, np.ndarray]:
        logits, embs = self.outputs(images)
        feats = {"confidence": special.softmax(logits.astype(np.float64), axis=1).max(1),
                 "ood_score": self.scores(embs)}
        proj = (embs.astype(np.float64) - self.mean) @ self.basis8
        feats |= {f"projection_{i}": proj[:, i] for i in range(8)}
        return feats


@pytest.fixture(scope="module")
def direct(watched) -> Direct:
    return Direct(watched)


@pytest.fixture(scope="module")
def live(repo):
    """The gateway serving REPO (both models), gRPC on, drift window WINDOW (alarm from 40 images); /metrics'
    drift is computed again at each scrape that follows new answers (a refresh period of 1 us)."""
    settings = settings_for(repo, drift_window=WINDOW, drift_min_window=40, grpc_port=0, drift_refresh_s=1e-6)
    with live_app(settings) as (url, app), httpx.Client(base_url=url, timeout=30) as client:
        yield client, app


def _classify(client: httpx.Client, model: str, data: bytes, **params) -> dict:
    r = client.post("/classify", params={"model": model, **params}, content=data,
                    headers={"Content-Type": "image/png"})
    assert r.status_code == 200, r.text
    return r.json()


def test_ood_score_is_the_embeddings_mahalanobis_distance(live, direct):
    client, _ = live
    images = structured(4, 20) + noise(2, 21)
    _, embs = direct.outputs(images)
    want = direct.scores(embs)
    ref = direct.ref
    for data, w in zip(images, want, strict=True):
        ood = _classify(client, "watched", data)["ood"]
        assert ood["method"] == "mahalanobis" and ood["threshold"] == pytest.approx(ref.threshold)
        assert ood["score"] == pytest.approx(w, rel=1e-4)
        if abs(w - ref.threshold) > 1e-3 * ref.threshold:
            assert ood["flag"] == (w > ref.threshold)
    assert want[-2:].min() > ref.threshold  # noise is flagged
    # explain=true: the explain pass has no embedding, so no score; the model without a reference: none ever
    assert "ood" not in _classify(client, "watched", images[0], explain="true")
    assert "ood" not in _classify(client, "plain", images[0])
    r = client.post("/embed", params={"model": "watched"}, content=images[0], headers={"Content-Type": "image/png"})
    assert r.status_code == 200 and "ood" not in r.json()


def test_energy_reference_scores_the_logits_even_when_explaining(repo, live):
    client, _ = live
    model = vit_serve.load(repo / "energy.safetensors").eval()
    ref = model.reference
    assert ref.method == "energy" and not ref.needs_embedding
    images = structured(2, 25) + noise(1, 26)
    x = torch.stack([preprocess(b, model.preprocess_cfg) for b in images])
    with torch.inference_mode():
        want = -special.logsumexp(model(x).numpy().astype(np.float64), axis=1)
    for data, w in zip(images, want, strict=True):
        for params in ({}, {"explain": "true"}):  # the explain pass gives the logits: scored too
            ood = _classify(client, "energy", data, **params)["ood"]
            assert ood["method"] == "energy" and ood["score"] == pytest.approx(w, rel=1e-4, abs=1e-4)
            assert ood["threshold"] == pytest.approx(ref.threshold) and ood["flag"] == (ood["score"] > ref.threshold)
    drift = client.get("/models/energy/drift").json()
    assert drift["method"] == "energy" and drift["window"] == 6
    assert set(drift["features"]) == {"confidence", "ood_score", *(f"projection_{i}" for i in range(8))}


def test_models_lists_the_reference_or_why_none(live):
    client, _ = live
    got = {m["name"]: m["versions"][0] for m in client.get("/models").json()["models"]}
    mon = got["watched"]["monitoring"]
    assert mon["method"] == "mahalanobis" and mon["calibration_images"] == 200 and mon["quantile"] == 0.95
    assert "Mahalanobis on the 192-d embedding" in mon["description"] and "fitted on 250" in mon["description"]
    assert got["plain"]["monitoring"].startswith("no reference: OOD scores and drift are off")
    assert "--reference-images" in got["plain"]["monitoring"]
    r = client.get("/models/plain/drift")
    assert r.status_code == 404 and "is not monitored: no reference" in r.json()["detail"]
    assert "vit-export --reference-images DIR" in r.json()["detail"]
    assert client.get("/models/nope/drift").status_code == 404
    assert client.get("/models/watched/drift", params={"version": 7}).status_code == 404


def _scipy_drift(direct: Direct, images: list[bytes]) -> tuple[float, float, dict[str, tuple[float, float]]]:
    """(statistic, Bonferroni p-value, per feature (D, p)) of the images against the reference, by scipy."""
    ref = direct.ref
    refs = {"confidence": ref.confidences, "ood_score": ref.scores,
            **{f"projection_{i}": ref.projections[:, i] for i in range(8)}}
    out = {}
    for name, a in direct.features(images).items():
        b = refs[name].astype(np.float64)
        d = stats.ks_2samp(a, b).statistic
        out[name] = (d, special.kolmogorov(math.sqrt(len(a) * len(b) / (len(a) + len(b))) * d))
    return max(d for d, _ in out.values()), min(1.0, min(p for _, p in out.values()) * len(out)), out


def test_drift_is_scipys_ks_and_alarms_out_of_distribution(live, direct):
    client, _ = live
    before = client.get("/metrics").text
    for phase, images in (("in", structured(WINDOW, 30)), ("out", noise(WINDOW, 31))):
        for data in images:  # the window is the last WINDOW answers: these images only
            _classify(client, "watched", data)
        r = client.get("/models/watched/drift")
        assert r.status_code == 200, r.text
        got = r.json()
        stat, p, feats = _scipy_drift(direct, images)
        assert got["window"] == got["window_size"] == WINDOW and got["min_window"] == 40
        assert got["statistic"] == pytest.approx(stat, abs=1e-9), phase
        assert got["p_value"] == pytest.approx(p, rel=1e-6, abs=1e-12), phase
        for name, (d, pv) in feats.items():
            assert got["features"][name]["distance"] == pytest.approx(d, abs=1e-9), name
            assert got["features"][name]["p_value"] == pytest.approx(pv, rel=1e-6, abs=1e-12), name
        assert got["alarm"] == (phase == "out") == (p < 0.01), (phase, p)
        assert got["significance"] == 0.01 and got["expected_ood_rate"] == pytest.approx(0.05)
        scores = direct.features(images)["ood_score"]
        assert got["ood_rate"] == pytest.approx(float((scores > direct.ref.threshold).mean()))
        assert sum(got["histogram"]["window"]) == WINDOW and sum(got["histogram"]["reference"]) == 200
        assert len(got["histogram"]["edges"]) == 31
        for c in got["classes"]:
            assert c["label"] == LABELS[c["index"]]
        text = client.get("/metrics").text
        labels = {"model": "watched", "version": "1"}
        assert metric(text, "vit_serve_drift", **labels) == pytest.approx(stat, abs=1e-9)
        assert metric(text, "vit_serve_drift_p_value", **labels) == pytest.approx(p, rel=1e-6, abs=1e-12)
        assert metric(text, "vit_serve_drift_alarm", **labels) == float(phase == "out")
    assert got["ood_rate"] > 0.9  # noise
    # per-image histograms: the 2 x WINDOW answers, for the watched model only
    for name in ("vit_serve_confidence_count", "vit_serve_ood_score_ratio_count"):
        assert metric(text, name, **labels) - metric(before, name, **labels) == 2 * WINDOW
        assert metric(text, name, model="plain") == 0
    above = metric(text, "vit_serve_ood_score_ratio_count", **labels) - metric(
        text, "vit_serve_ood_score_ratio_bucket", le="1.0", **labels)
    assert above >= WINDOW * 0.9  # the noise images: above the threshold (ratio > 1)
    assert "vit_serve_drift{" in text and 'model="plain"' not in text.split("vit_serve_drift{", 1)[1].split("\n")[0]


def test_a_scrape_shows_the_last_drift_and_never_computes_it_itself(repo):
    """With a refresh period longer than the test, /metrics shows the drift of the window as it was at the first
    scrape, however many answers and scrapes follow; GET /models/NAME/drift (behind the key when keys are on)
    computes the window as it is."""
    settings = settings_for(repo, drift_window=WINDOW, drift_min_window=5, drift_refresh_s=3600)
    labels = {"model": "watched", "version": "1"}
    with live_app(settings) as (url, _), httpx.Client(base_url=url, timeout=30) as client:
        for data in structured(6, 70):
            _classify(client, "watched", data)
        first = client.get("/metrics").text
        for data in noise(6, 71):
            _classify(client, "watched", data)
        later = [client.get("/metrics").text for _ in range(3)]
        fresh = client.get("/models/watched/drift").json()
    assert metric(first, "vit_serve_drift_window_images", **labels) == 6
    assert fresh["window"] == 12
    for text in later:
        assert metric(text, "vit_serve_drift_window_images", **labels) == 6
        for name in ("vit_serve_drift", "vit_serve_drift_p_value", "vit_serve_drift_alarm"):
            assert metric(text, name, **labels) == metric(first, name, **labels), name
    assert metric(later[-1], "vit_serve_confidence_count", **labels) == 12  # the answers were counted


def test_scraped_drift_is_computed_again_once_the_period_has_passed_and_the_window_grew(live):
    """`VersionMonitor.scraped` on a clock the test moves: the same report object until both the period has
    passed and the window has grown; `report` (the route's) follows the window at once."""
    from vit_serve.serve.monitoring import VersionMonitor
    from vit_serve.serve.settings import MonitoringSettings

    _, app = live
    served = app.state.gateway.model("watched").monitor
    now = [100.0]
    mon = VersionMonitor(served.ref, served.scores, MonitoringSettings(drift_window=WINDOW, drift_min_window=5,
                                                                       drift_refresh_s=10.0), clock=lambda: now[0])
    rng = np.random.default_rng(0)

    def answers(n: int) -> None:
        mon.observe({"logits": rng.normal(size=(n, len(LABELS))).astype(np.float32),
                     "embedding": rng.normal(size=(n, served.ref.dim)).astype(np.float32)})

    answers(8)
    first = mon.scraped()
    assert first.window == 8 and mon.scraped() is first
    answers(4)
    now[0] += 9.9
    assert mon.scraped() is first and mon.report().window == 12  # within the period: the last one
    now[0] += 0.2
    second = mon.scraped()
    assert second is not first and second.window == 12
    now[0] += 60
    assert mon.scraped() is second  # the period passed but the window did not grow


def _v2_body(x: np.ndarray, outputs: list[str] | None) -> dict:
    body = {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": list(x.shape),
                        "data": x.ravel().tolist()}]}
    if outputs is not None:
        body["outputs"] = [{"name": n} for n in outputs]
    return body


def test_v2_ood_score_over_http_and_grpc(live, direct, watched):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    client, app = live
    images = structured(2, 40) + noise(1, 41)
    x = torch.stack([preprocess(b, watched.preprocess_cfg) for b in images]).numpy()
    with torch.inference_mode():
        _, e = watched.forward_embedding(torch.from_numpy(x))
    want = direct.scores(e.numpy())
    meta = client.get("/v2/models/watched").json()
    assert {"name": "ood_score", "datatype": "FP32", "shape": [-1]} in meta["outputs"]
    assert "ood_score" not in [o["name"] for o in client.get("/v2/models/plain").json()["outputs"]]
    r = client.post("/v2/models/watched/infer", json=_v2_body(x, ["ood_score", "logits"]))
    assert r.status_code == 200, r.text
    out = {o["name"]: o for o in r.json()["outputs"]}
    assert out["ood_score"]["shape"] == [3] and out["ood_score"]["datatype"] == "FP32"
    np.testing.assert_allclose(out["ood_score"]["data"], want, rtol=1e-4)
    # Asked beside the rollout alone, the score still comes from the model's own pass (not a 500: the explain
    # pass is not what the score reads).
    r = client.post("/v2/models/watched/infer", json=_v2_body(x, ["rollout", "ood_score"]))
    assert r.status_code == 200, r.text
    np.testing.assert_allclose({o["name"]: o for o in r.json()["outputs"]}["ood_score"]["data"], want, rtol=1e-4)
    default = client.post("/v2/models/watched/infer", json=_v2_body(x, None)).json()
    assert "ood_score" not in [o["name"] for o in default["outputs"]]  # only when asked for by name
    r = client.post("/v2/models/plain/infer", json=_v2_body(x, ["ood_score"]))
    assert r.status_code == 400 and "unknown output" in r.text

    g = grpcclient.InferenceServerClient(app.state.grpc.address)
    try:
        assert "ood_score" in [o["name"] for o in g.get_model_metadata("watched", as_json=True)["outputs"]]
        inp = grpcclient.InferInput("pixel_values", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        res = g.infer("watched", [inp], outputs=[grpcclient.InferRequestedOutput("ood_score")])
        np.testing.assert_allclose(res.as_numpy("ood_score"), want, rtol=1e-4)
    finally:
        g.close()


def test_no_monitoring_removes_ood_and_drift(repo):
    images = structured(1, 50)
    with live_app(settings_for(repo, monitoring=False)) as (url, _), httpx.Client(base_url=url) as client:
        assert "ood" not in _classify(client, "watched", images[0])
        r = client.get("/models/watched/drift")
        assert r.status_code == 404 and "monitoring is off" in r.json()["detail"]
        got = {m["name"]: m["versions"][0] for m in client.get("/models").json()["models"]}
        assert "monitoring is off" in got["watched"]["monitoring"]
        assert "ood_score" not in [o["name"] for o in client.get("/v2/models/watched").json()["outputs"]]
        assert "vit_serve_drift{" not in client.get("/metrics").text


def test_payload_sampler_keeps_the_crops_and_scores(repo, tmp_path, direct):
    from vit_serve.runtime.payload_sampler import read_samples

    images = structured(2, 60) + noise(1, 61)
    sent = []
    with live_app(settings_for(repo, sample_rate=1.0, sample_dir=str(tmp_path))) as (url, _), \
            httpx.Client(base_url=url) as client:
        for data in images:
            sent.append(_classify(client, "watched", data))
        sent.append(_classify(client, "plain", images[0]))
    table = read_samples(tmp_path).to_pylist()  # written by the gateway's shutdown at the latest
    assert len(table) == 4
    by_model = sorted(table, key=lambda row: (row["model"], row["time"]))
    assert [row["model"] for row in by_model] == ["plain", "watched", "watched", "watched"]
    plain, rows = by_model[0], by_model[1:]
    assert plain["ood_score"] is None and plain["ood_flag"] is None
    for row, answer in zip(rows, sent[:3], strict=True):
        assert row["ood_score"] == pytest.approx(answer["ood"]["score"]) and row["ood_flag"] == answer["ood"]["flag"]
        assert row["top1_label"] == answer["predictions"][0]["label"] and row["version"] == "1"
        assert Image.open(io.BytesIO(row["image"])).size == (RES, RES)
        assert row["request_id"]


def test_monitoring_settings_refused():
    from pydantic import ValidationError

    from vit_serve.serve.settings import ServeSettings

    s = ServeSettings(model="m", drift_window=50)  # the minimum follows a smaller window
    m = s.monitor
    assert (m.monitoring, m.drift_window, m.drift_min_window, m.sample_rate) == (True, 50, 50, 0.0)
    for bad, match in (({"sample_rate": 0.1}, "sample_dir"), ({"sample_rate": 0.1, "sample_dir": "d",
                                                              "sample_redis_url": "redis://x"}, "not both"),
                       ({"drift_significance": 1.0}, "drift_significance"), ({"drift_window": 0}, "drift_window"),
                       ({"drift_window": 50, "drift_min_window": 60}, "never turn on"),
                       ({"sample_rate": 2.0, "sample_dir": "d"}, "sample_rate")):
        with pytest.raises(ValidationError, match=match):
            ServeSettings(model="m", **bad)


def test_monitoring_flags(monkeypatch):
    from vit_serve.serve.settings import ServeSettings

    monkeypatch.setenv("VIT_SERVE_MONITORING", "false")
    monkeypatch.setenv("VIT_SERVE_DRIFT_WINDOW", "200")
    s = ServeSettings(model="m")
    assert s.monitor.monitoring is False and s.monitor.drift_window == 200 and s.monitor.drift_min_window == 100
