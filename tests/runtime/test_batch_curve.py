"""The batch curve (`vit_serve.runtime.batch_curve`): which batch sizes pay and whether waiting does, from
curves shaped as measured on real hardware (README: onnxruntime ViT-S/16 on 2 AVX-512 cores, 34.7 images/s at
batch 1 and 33.5 at 10; PyTorch eager 0.148 s an image at batch 1, 0.134 at 8), and the measurement itself on
a real onnxruntime session."""

from __future__ import annotations

import time

import numpy as np
import pytest

from vit_serve.runtime.batch_curve import MIN_GAIN, BatchCurve, measure, sizes


def _curve(images_per_s: dict[int, float], max_batch: int = 16) -> BatchCurve:
    return BatchCurve(max_batch, {b: 1 / r for b, r in images_per_s.items()})


def test_a_cpu_where_batch_1_is_fastest_batches_one_and_never_waits():
    curve = _curve({1: 34.7, 2: 34.5, 4: 34.4, 8: 33.9, 16: 33.5})
    assert curve.limit == 1
    assert not curve.worth_waiting


def test_a_flat_curve_within_noise_takes_the_smallest_size():
    curve = _curve({1: 34.0, 2: 34.6, 4: 34.3, 8: 34.1, 16: 33.0})  # 2 is best by 1.8%: noise
    assert curve.limit == 1 and not curve.worth_waiting


def test_a_gain_worth_having_batches_and_waits():
    curve = _curve({1: 1 / 0.148, 2: 7.0, 4: 7.3, 8: 1 / 0.134, 16: 7.4})  # eager PyTorch on a CPU: 10% at 8
    assert curve.limit == 8
    assert curve.gain(8) == pytest.approx(0.148 / 0.134)
    assert curve.worth_waiting


def test_a_gain_below_min_gain_batches_what_is_queued_but_never_waits():
    curve = _curve({1: 30.0, 2: 30.3, 4: 31.2, 8: 31.0})  # 4% at 4
    assert curve.limit == 4 and curve.gain(4) < MIN_GAIN
    assert not curve.worth_waiting


def test_a_gpu_curve_batches_to_the_ceiling():
    curve = _curve({1: 400.0, 2: 790.0, 4: 1500.0, 8: 2900.0, 16: 5200.0})
    assert curve.limit == 16 and curve.worth_waiting


def test_an_unmeasured_curve_batches_as_configured():
    curve = BatchCurve(8)
    assert curve.limit == 8 and curve.worth_waiting and curve.gain(8) == 1.0


def test_batch_s_is_rows_times_the_interpolated_time_per_image():
    curve = BatchCurve(16, {1: 0.100, 2: 0.080, 4: 0.060, 8: 0.050})
    assert curve.batch_s(1) == pytest.approx(0.100)
    assert curve.batch_s(4) == pytest.approx(4 * 0.060)
    assert curve.batch_s(3) == pytest.approx(3 * 0.070)  # halfway between 2 and 4
    assert curve.batch_s(6) == pytest.approx(6 * 0.055)
    assert curve.batch_s(12) == pytest.approx(12 * 0.050)  # beyond the largest measured: its time per image
    assert BatchCurve(8).batch_s(4) is None and curve.batch_s(0) is None


@pytest.mark.parametrize(("max_batch", "expected"), [(1, [1]), (2, [1, 2]), (8, [1, 2, 4, 8]),
                                                     (12, [1, 2, 4, 8, 12]), (16, [1, 2, 4, 8, 16])])
def test_sizes(max_batch, expected):
    assert sizes(max_batch) == expected


@pytest.fixture(scope="module")
def ort_session(tiny_onnx_32):
    """A real onnxruntime session of a tiny ViT exported by vit-export (the gateway's backend)."""
    from vit_serve.runtime.backends.onnxruntime import OnnxRuntimeBackend

    return OnnxRuntimeBackend(tiny_onnx_32, threads=1)


def test_measure_times_every_size_on_a_real_session(ort_session):
    image = np.zeros((1, 3, 32, 32), np.float32)
    seen: list[int] = []

    def run(x):
        seen.append(x.shape[0])
        return ort_session.classify(x)

    curve = measure(run, image, 8, budget_s=5.0, rounds=3)
    assert sorted(curve.per_image_s) == [1, 2, 4, 8]
    assert seen == [1, 2, 4, 8] * 3  # interleaved rounds
    assert all(s > 0 for s in curve.per_image_s.values())
    assert 1 <= curve.limit <= 8


def test_measure_stops_at_its_budget_and_leaves_the_larger_sizes_out():
    """A run that takes 0.1 s a row: a 0.5 s budget measures 1, 2 (0.3 s) and not 4 (its guess, 0.4 s, would
    overrun), and the curve then never batches past what it measured."""
    def run(x):
        time.sleep(0.1 * x.shape[0])

    t0 = time.perf_counter()
    curve = measure(run, np.zeros((1, 3, 4, 4), np.float32), 16, budget_s=0.5)
    assert time.perf_counter() - t0 < 0.5 + 0.2  # a bound the function keeps, with one sleep's overshoot
    assert set(curve.per_image_s) == {1, 2}
    assert curve.limit <= 2


def test_the_description_quotes_the_delay_s_value_not_its_name():
    waits = _curve({1: 1 / 0.148, 2: 7.0, 4: 7.3, 8: 1 / 0.134, 16: 7.4}).describe(2.5)
    assert waits.endswith("batches of up to 8, waiting up to 2.5 ms for more")
    assert "max_delay_ms" not in waits
    assert _curve({1: 34.7, 2: 34.5}).describe(2.5).endswith("no waiting (batching gains under 5%)")
