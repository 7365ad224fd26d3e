"""The torch backend's start-up probe (`vit_serve.runtime.torch_probe`): eager vs onnxruntime on this CPU, and the
WARNING naming the ratio and the export to serve instead when onnxruntime is clearly faster. The decision is
checked on given measurements; one real probe runs on a tiny model (its numbers are whatever this CPU gives: the
assertions are on their form and on the decision agreeing with them, never on a speed)."""

from __future__ import annotations

import logging
import math

import pytest
import torch

import vit_serve
from vit_serve.runtime import LoadSpec, load
from vit_serve.runtime.torch_probe import ENV, THRESHOLD, ProbeResult, advice, measure, probe, tome_arg

LABELS = [f"label_{i}" for i in range(10)]
RES = (32, 32)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, save_tiny):
    return save_tiny(tmp_path_factory.mktemp("probe") / "tiny.safetensors", RES, 2, LABELS)


def test_the_warning_names_the_ratio_and_the_export_to_serve():
    result = ProbeResult(eager_ips=14.7, ort_ips=29.2, threads=2, rounds=5, seconds=3.1)
    assert result.ratio == pytest.approx(29.2 / 14.7)
    message = advice(result, "vit_s16", "runs/vit s16.safetensors")
    assert message == (
        "torch eager runs vit_s16 at 14.7 images/s, onnxruntime at 29.2 (1.99x) on this CPU (batch 1, 2 threads): "
        "serve the export instead: vit-export 'runs/vit s16.safetensors' --out exports --name vit_s16 && "
        "vit-serve serve exports/vit_s16.onnx (or try --compile; VIT_SERVE_TORCH_PROBE=0 skips this check)")


def test_no_warning_below_the_threshold():
    at = ProbeResult(10.0, 10.0 * THRESHOLD, 2, 5, 1.0)
    assert advice(at, "m", "m.safetensors") is not None
    assert advice(ProbeResult(10.0, 11.9, 2, 5, 1.0), "m", "m.safetensors") is None
    assert advice(ProbeResult(10.0, 8.0, 2, 5, 1.0), "m", "m.safetensors") is None
    assert advice(ProbeResult(10.0, 15.0, 2, 5, 1.0), "m", "m.safetensors", threshold=2.0) is None


def test_token_merging_is_exported_as_served():
    message = advice(ProbeResult(10.0, 20.0, 1, 3, 1.0), "m", "m.safetensors", tome=[4, 4, 2])
    assert "vit-export m.safetensors --out exports --name m --tome 4,4,2 &&" in message
    assert (tome_arg(4), tome_arg((16, -1.0)), tome_arg((8, 0.5))) == ("4", "16:-1", "8:0.5")


def test_a_real_probe_on_a_tiny_model(ckpt, one_thread):
    model = vit_serve.load(ckpt).eval()
    result = measure(model, torch.randn(1, 3, *RES), budget_s=0.2, rounds=3)
    assert math.isfinite(result.eager_ips) and result.eager_ips > 0
    assert math.isfinite(result.ort_ips) and result.ort_ips > 0
    assert result.ratio == result.ort_ips / result.eager_ips
    assert 1 <= result.rounds <= 3 and result.threads == torch.get_num_threads() and result.seconds > 0


def test_a_failing_export_skips_the_probe(ckpt, caplog):
    model = vit_serve.load(ckpt).eval()
    with caplog.at_level(logging.DEBUG, logger="vit_serve.runtime"):
        assert probe(model, torch.randn(1, 3, 33, 33), "tiny") is None  # not a multiple of the patch size
    assert any(r.levelno == logging.DEBUG and r.getMessage().startswith("torch probe of tiny skipped: ")
               for r in caplog.records)


def test_the_backend_probes_at_load_and_warns_when_onnxruntime_is_faster(ckpt, caplog, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="vit_serve.runtime"):
        backend = load(LoadSpec(str(ckpt), device="cpu", threads=1))
    result = backend.probe
    assert result is not None and result.ratio == result.ort_ips / result.eager_ips
    expected = advice(result, "tiny", str(ckpt))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ([expected] if result.ratio >= THRESHOLD else [])
    assert not backend.info.compiled


def test_the_probe_can_be_turned_off(ckpt, monkeypatch):
    monkeypatch.setenv(ENV, "0")
    assert load(LoadSpec(str(ckpt), device="cpu", threads=1)).probe is None
