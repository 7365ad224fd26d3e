"""`vit-serve inspect --drift`: the drift picture from a hand-written report, from `vit_serve.monitor`'s own
outputs, from a (stub) gateway, and one-line refusals of what cannot be drawn."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from http_stub import HttpStub, StubRequest
from PIL import Image

from vit_serve import monitor
from vit_serve.cli import main
from vit_serve.cli.drift_figure import DriftInputError, draw_drift, fetch_drift, read_drift

HAND: dict[str, Any] = {
    "model": "digits", "version": "1", "method": "mahalanobis", "window": 500, "window_size": 500,
    "statistic": 0.41, "p_value": 1e-9, "alarm": True, "significance": 0.01, "min_window": 100, "threshold": 3.2,
    "ood_rate": 0.4, "expected_ood_rate": 0.05, "features": {"ood_score": {"distance": 0.41, "p_value": 1e-10}},
    "classes": [{"label": "8", "index": 8, "reference_share": 0.1, "window_share": 0.45},
                {"label": "1", "index": 1, "reference_share": 0.1, "window_share": 0.02}],
    "histogram": {"edges": [0, 1, 2, 3, 4, 5], "window": [5, 10, 20, 30, 40], "reference": [40, 30, 20, 5, 1]},
}


def endpoint_dict(ref: monitor.Reference, window: monitor.Window, labels: list[str]) -> dict[str, Any]:
    """What GET /models/NAME/drift answers, from monitor's functions (the gateway's recipe)."""
    rep = window.report()
    hist = monitor.score_histogram(ref, window.arrays()[1])
    shares = ref.class_shares()
    return {"model": "toy", "version": "3", "method": ref.method, "window": rep.window, "window_size": window.size,
            "statistic": rep.statistic, "p_value": rep.p_value, "alarm": rep.alarm,
            "significance": rep.significance, "min_window": rep.min_window, "threshold": ref.threshold,
            "ood_rate": rep.ood_rate, "expected_ood_rate": 1 - ref.quantile,
            "features": {k: {"distance": d, "p_value": p} for k, (d, p) in rep.features.items()},
            "classes": [{"label": labels[i], "index": i, "reference_share": float(shares[i]), "window_share": w}
                        for i, _, w in rep.classes],
            "histogram": {"edges": hist.edges, "window": hist.window, "reference": hist.reference}}


@pytest.fixture(scope="module")
def monitored() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    d, k = 16, 4
    centres = rng.normal(0, 3, (k, d))

    def outputs(n: int, shift: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, k, n)
        e = centres[y] + rng.normal(0, 1, (n, d)) + shift
        return e.astype(np.float32), (e @ centres.T / d).astype(np.float32)

    ref = monitor.build_reference(*outputs(400), *outputs(300), source="random")
    window = monitor.Window(ref, size=200)
    e, lo = outputs(200, shift=1.5)
    window.add(monitor.softmax_confidence(lo), monitor.ood_scores(ref, lo, e), monitor.project(ref, e, lo),
               lo.argmax(-1))
    report = endpoint_dict(ref, window, [f"class {i}" for i in range(k)])
    assert report["alarm"] and report["classes"], report  # the shifted window is drift
    return json.loads(json.dumps(report))  # as it comes over the wire


def assert_not_blank(path: Path) -> None:
    pixels = np.asarray(Image.open(path).convert("RGB"), np.float32)
    assert pixels.shape[0] > 200 and pixels.shape[1] > 400
    assert pixels.std() > 20
    colours = {tuple(c) for c in pixels.reshape(-1, 3)[::7].astype(int)}
    assert len(colours) > 20
    reds = (pixels[..., 0] > 150) & (pixels[..., 1] < 100) & (pixels[..., 2] < 100)  # the window's bars
    blues = (pixels[..., 2] > 120) & (pixels[..., 0] < 100)  # the reference's
    assert reds.mean() > 0.005 and blues.mean() > 0.005


def test_draws_a_hand_written_report(tmp_path):
    out = draw_drift(HAND, tmp_path / "drift.png")
    assert out == tmp_path / "drift.png"
    assert_not_blank(out)
    assert [p.name for p in tmp_path.iterdir()] == ["drift.png"]  # no temporary left


def test_draws_monitor_outputs(tmp_path, monitored):
    assert_not_blank(draw_drift(monitored, tmp_path / "m.png"))


def test_refuses_to_overwrite_without_force(tmp_path):
    out = draw_drift(HAND, tmp_path / "d.png")
    before = out.read_bytes()
    with pytest.raises(FileExistsError):
        draw_drift(HAND, out)
    draw_drift({**HAND, "alarm": False}, out, overwrite=True)
    assert out.read_bytes() != before


@pytest.mark.parametrize("bad", [[], {"model": "x"}, {**HAND, "statistic": "high"},
                                 {**HAND, "histogram": {"edges": [0, 1], "window": [1, 2], "reference": [1]}},
                                 {**HAND, "classes": [{"label": "a"}]}])
def test_malformed_reports_are_refused(tmp_path, bad):
    with pytest.raises(DriftInputError):
        draw_drift(bad, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


@pytest.fixture
def gateway(monitored, http_stub) -> HttpStub:
    """A stub gateway: GET /models/NAME/drift answers toy's report (and at version 3) and a report missing its
    keys for junk; any other model is a 404."""
    reports = {"/models/toy/drift": monitored, "/models/toy/drift?version=3": monitored,
               "/models/junk/drift": {"hello": 1}}

    def respond(request: StubRequest) -> tuple[int, str, bytes]:
        body = reports.get(request.path)
        answer = body if body is not None else {"detail": "no model named nope"}
        return (200 if body is not None else 404), "application/json", json.dumps(answer).encode()

    return http_stub(respond)


def test_fetches_from_a_gateway(gateway):
    assert fetch_drift(gateway.url, "toy", "3", api_key="k1")["model"] == "toy"
    assert [(r.method, r.path, r.headers.get("x-api-key")) for r in gateway.requests] == [
        ("GET", "/models/toy/drift?version=3", "k1")]
    with pytest.raises(DriftInputError, match="HTTP 404: no model named nope"):
        fetch_drift(gateway.url, "nope")
    with pytest.raises(DriftInputError, match="missing"):
        fetch_drift(gateway.url, "junk")


def test_cli_from_a_gateway_and_a_file(gateway, monitored, tmp_path, capsys):
    assert main(["inspect", gateway.url, "--drift", "--model", "toy", "--version", "3", "--out", str(tmp_path)]) == 0
    assert_not_blank(tmp_path / "drift.png")
    assert capsys.readouterr().out.strip() == str(tmp_path / "drift.png")
    saved = tmp_path / "drift.json"
    saved.write_text(json.dumps(monitored))
    assert main(["inspect", "--drift", str(saved), "--out", str(tmp_path / "f.png")]) == 0
    assert_not_blank(tmp_path / "f.png")
    assert main(["inspect", "--drift", str(saved), "--out", str(tmp_path / "f.png")]) == 1
    assert "exists; pass --force" in capsys.readouterr().err
    assert main(["inspect", "--drift", str(saved), "--out", str(tmp_path / "f.png"), "--force"]) == 0


@pytest.mark.parametrize("argv, message", [
    (["--model", "nope"], "HTTP 404"),
    (["--model", "junk"], "missing"),
    ([], "needs --model"),
])
def test_cli_gateway_errors_are_one_line(gateway, tmp_path, capsys, argv, message):
    assert main(["inspect", "--drift", gateway.url, *argv, "--out", str(tmp_path / "x.png")]) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("vit-serve inspect: error:")
    assert not (tmp_path / "x.png").exists()


def test_cli_file_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{not json")
    for source, message in [(tmp_path / "bad.json", "not JSON"), (tmp_path / "none.json", "no such file"),
                            ("http://127.0.0.1:9", "http://127.0.0.1:9/models/m/drift")]:
        assert main(["inspect", "--drift", str(source), "--model", "m", "--out", str(tmp_path / "x.png")]) == 1
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_cli_drift_only_flags(tmp_path, capsys):
    assert main(["inspect", "ckpt.safetensors", "--model", "m", "--out", str(tmp_path)]) == 1
    assert "are for --drift" in capsys.readouterr().err
    assert main(["inspect", "--drift", "d.json", "--images", str(tmp_path), "--out", str(tmp_path / "x.png")]) == 1
    assert "--images not used with --drift" in capsys.readouterr().err


def test_read_drift_round_trip(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps(HAND))
    assert read_drift(tmp_path / "d.json") == HAND
