"""The load-time runtime choice's pure parts (`vit_serve.runtime.runtime_choice`): the timing loop driven by a fake
clock in milliseconds (each contender's call advances it by a known cost), the accuracy numbers, the bounds, and
the chooser (table in, choice out)."""

from __future__ import annotations

import numpy as np
import pytest

from vit_serve.runtime.runtime_choice import BOUNDS, Row, RuntimeChoice, accuracy, choose, refusal, time_runs


class FakeClock:
    """Milliseconds that pass only when a fake runtime runs; read in seconds as `time.perf_counter` is."""

    def __init__(self) -> None:
        self.ms = 0.0
        self.calls: list[tuple[str, int]] = []

    def __call__(self) -> float:
        return self.ms / 1000

    def runtime(self, name: str, per_call_ms: float, per_image_ms: float):
        def run(x: np.ndarray) -> None:
            self.calls.append((name, x.shape[0]))
            self.ms += per_call_ms + per_image_ms * x.shape[0]
        return run


IMAGE = np.zeros((1, 3, 4, 4), np.float32)


def test_rates_are_images_per_second_of_the_fake_clock_and_rounds_interleave():
    clock = FakeClock()
    runs = {"slow": clock.runtime("slow", 0, 10), "fast": clock.runtime("fast", 10, 4)}
    rates = time_runs(runs, IMAGE, [1, 8], budget_s=60, rounds=3, clock=clock)
    assert rates["slow"] == {1: pytest.approx(100.0), 8: pytest.approx(100.0)}
    assert rates["fast"] == {1: pytest.approx(1000 / 14), 8: pytest.approx(8000 / 42)}
    # one warm-up call each at batch 1, then three rounds of every contender at every size, in turn
    assert clock.calls == [("slow", 1), ("fast", 1)] + [("slow", 1), ("slow", 8), ("fast", 1), ("fast", 8)] * 3


def test_the_budget_stops_the_rounds_but_every_contender_gets_a_number():
    clock = FakeClock()
    runs = {"a": clock.runtime("a", 0, 100), "b": clock.runtime("b", 0, 100)}
    rates = time_runs(runs, IMAGE, [1, 4], budget_s=0.5, rounds=5, clock=clock)
    assert set(rates) == {"a", "b"} and all(set(r) == {1, 4} for r in rates.values())
    timed = clock.calls[2:]
    assert len(timed) == 4  # the first round (1.2 s of fake time) already spent the budget: no second
    assert rates["a"][4] == pytest.approx(10.0)


def test_within_a_later_round_a_call_that_would_overrun_the_budget_is_skipped():
    clock = FakeClock()
    runs = {"a": clock.runtime("a", 0, 10)}
    time_runs(runs, IMAGE, [1, 16], budget_s=0.3, rounds=3, clock=clock)
    # warm-up 10 ms, round 1: 10 + 160 ms (180 spent); rounds 2 and 3: batch 1 fits (190, 200), batch 16 would
    # end past 300
    assert clock.calls == [("a", 1), ("a", 1), ("a", 16), ("a", 1), ("a", 1)]


def test_the_chooser_serves_the_fastest_row_that_meets_its_bounds():
    clock = FakeClock()
    runs = {"eager": clock.runtime("eager", 0, 10), "onnxruntime": clock.runtime("onnxruntime", 10, 4),
            "openvino": clock.runtime("openvino", 0, 2)}
    rates = time_runs(runs, IMAGE, [1, 8], budget_s=60, clock=clock)
    rows = [Row("eager", "fp32", rates["eager"], 1.0, 1.0),
            Row("onnxruntime", "fp32", rates["onnxruntime"], 1.0, 0.99999),
            Row("openvino", "int8", rates["openvino"], 0.9, 0.95, refusal("int8", 0.9, 0.95))]
    chosen = choose(rows)
    # onnxruntime: slower than eager at batch 1 (71 vs 100 images/s), faster at 8 (190 vs 100): 116 geometric mean
    assert chosen.key == "onnxruntime:fp32"
    assert chosen.score == pytest.approx((1000 / 14 * 8000 / 42) ** 0.5)
    assert rows[2].score > chosen.score and rows[2].refused  # the fastest, refused for its accuracy
    assert choose([*rows[:2], Row("openvino", "int8", rates["openvino"], 0.99, 0.995)]).runtime == "openvino"


def test_a_pin_serves_its_row_and_names_the_others_when_it_matches_none():
    rows = [Row("eager", images_per_s={1: 10.0}), Row("onnxruntime", images_per_s={1: 20.0}),
            Row("openvino", "bf16", {1: 5.0}, refused="top-1 agreement 0.5")]
    assert choose(rows, "eager").key == "eager:fp32"
    assert choose(rows, "openvino:bf16").key == "openvino:bf16"  # forced: a pin serves even a refused row
    assert choose(rows, "openvino").key == "openvino:bf16"
    with pytest.raises(ValueError, match=r"'openvino:int8' names none.*eager:fp32, onnxruntime:fp32, openvino:bf16"):
        choose(rows, "openvino:int8")


def test_every_row_refused_is_an_error_naming_why():
    with pytest.raises(ValueError, match="eager:fp32: broken"):
        choose([Row("eager", refused="broken")])


def test_ties_go_to_the_reference_and_unmeasured_rows_score_zero():
    rows = [Row("eager", images_per_s={1: 10.0, 8: 40.0}), Row("onnxruntime", images_per_s={1: 40.0, 8: 10.0})]
    assert choose(rows).runtime == "eager"
    assert Row("onnxruntime").score == 0.0


def test_accuracy_is_top1_agreement_and_mean_cosine():
    ref = np.array([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [1.0, 0.0, 5.0], [1.0, 1.0, 0.0]])
    got = ref.copy()
    got[1] = [0.0, 1.0, 2.0]  # top-1 moves, cosine 4/5
    got[3] = [np.nan, 0.0, 0.0]  # NaN: disagreement, cosine 0
    agree, cos = accuracy(ref, got)
    assert agree == pytest.approx(0.5)
    assert cos == pytest.approx((1 + 0.8 + 1 + 0) / 4)
    zero = np.zeros((2, 3))  # an untrained head: equal zeros agree, a zero row against another does not
    assert accuracy(zero, zero) == (1.0, 1.0)
    assert accuracy(zero, np.array([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))[1] == 0.5


@pytest.mark.parametrize(("precision", "agree", "cos", "ok"), [
    ("fp32", 1.0, 0.99999, True), ("fp32", 1.0, 0.9995, False), ("bf16", 0.995, 0.999, True),
    ("bf16", 0.99, 0.9999, False), ("int8", 0.98, 0.99, True), ("int8", 0.98, 0.989, False),
    ("f32", 1.0, 0.9995, False)])  # a precision without bounds of its own has fp32's
def test_the_bounds_by_precision(precision, agree, cos, ok):
    assert (refusal(precision, agree, cos) is None) is ok
    assert BOUNDS["bf16"] == (0.995, 0.999) and BOUNDS["int8"] == (0.98, 0.99)  # the issue's


def test_the_table_in_one_line_marks_the_chosen_and_the_refused():
    table = RuntimeChoice((Row("eager", "fp32", {1: 10.0, 8: 12.5}, 1.0, 1.0),
                           Row("onnxruntime", "fp32", {1: 20.0, 8: 25.0}, 1.0, 0.9999999),
                           Row("openvino", "int8", refused="cannot run: ImportError")),
                          "onnxruntime:fp32", threads=2, seconds=3.25)
    line = table.describe()
    assert line.startswith("eager:fp32 10.0/12.5 images/s (batch 1/8), agreement 1.000, cosine 1.000000; ")
    assert "onnxruntime:fp32 20.0/25.0 images/s (batch 1/8), agreement 1.000, cosine 1.000000 <- chosen" in line
    assert "openvino:int8 not measured (refused: cannot run: ImportError)" in line
    assert line.endswith("(measured in 3.2 s on 2 threads)")
