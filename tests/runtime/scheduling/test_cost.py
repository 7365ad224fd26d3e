"""The cost model: moving averages of measured batches, scaled by the batch curve once one is measured."""

from __future__ import annotations

import pytest

from vit_serve.runtime.batch_curve import BatchCurve
from vit_serve.runtime.scheduling.cost import CostModel


@pytest.mark.parametrize("runs, rows, predicted_ms", [
    ([], 1, None),  # nothing before the first batch
    ([(1, 100)], 4, 400),  # the time per image x rows
    ([(1, 100), (1, 200)], 1, 130),  # a moving average: the newest weighs 0.3
    ([(4, 400)], 2, 200),
])
def test_a_batch_is_predicted_from_the_recent_time_per_image(runs, rows, predicted_ms):
    model = CostModel(max_batch=8)
    for n, ms in runs:
        model.observe("classify", n, ms / 1e3)
    got = model.batch_s("classify", rows)
    assert (None if got is None else round(got * 1e3)) == predicted_ms
    assert model.batch_s("embed", rows) is None  # per task kind


@pytest.mark.parametrize("runs, sure_ms", [
    ([(1, 100), (1, 100)], 100),  # as predicted: no room added
    ([(1, 100), (1, 150)], 287.5),  # 50% over (the first overrun measured): room for 3 x 50% of 115 ms
    ([(1, 100), (1, 150), (1, 115)], 235.75),  # then as predicted: the overrun's average falls to 35%
    ([(1, 100), (1, 50)], 85),  # faster than predicted is no risk
])
def test_a_deadline_batch_is_given_room_for_recent_overruns(runs, sure_ms):
    model = CostModel(max_batch=8)
    for n, ms in runs:
        model.observe("classify", n, ms / 1e3)
    assert model.sure_batch_s("classify", 1) * 1e3 == pytest.approx(sure_ms, abs=0.1)


def test_the_batch_curve_shapes_predictions_scaled_by_how_slow_recent_batches_ran():
    curve = BatchCurve(8, {1: 0.1, 2: 0.06, 4: 0.04, 8: 0.05})  # seconds per image
    model = CostModel(max_batch=16, instances=2)
    model.use_curve(curve)
    assert model.max_batch == curve.limit and model.pays_to_wait == curve.worth_waiting
    model.observe("classify", 2, 0.24)  # twice the curve's 0.12 s
    assert model.batch_s("classify", 4) == pytest.approx(2 * curve.batch_s(4))
    full = model.batch_s("classify", model.max_batch)
    assert model.work_s("classify", 2 * model.max_batch) == pytest.approx(full)  # shared among two instances
    assert model.own_rows(1) == (model.max_batch if curve.worth_waiting else 1)


def test_a_seeded_cost_is_known_and_forgotten():
    model = CostModel(max_batch=4)
    model.seed("classify", 0.1, overrun=0.5)
    assert model.known("classify") and model.row_s("classify") == 0.1
    assert model.sure_batch_s("classify", 2) == pytest.approx(0.2 * 2.5)
    model.forget("classify")
    assert not model.known("classify") and model.work_s("classify", 3) is None
