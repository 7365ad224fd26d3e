"""The choice among the backends that serve one exported file (`vit_serve.runtime.backends.choice`). Until a second
runtime serves .onnx files, onnxruntime is listed twice under two precision labels (two real sessions on the same
file, no mocks): the mechanism is what is checked here (every contender loaded, checked, timed, the others
closed, the table on the one served, a pin), not which runtime is faster."""

from __future__ import annotations

import numpy as np
import pytest

from vit_serve.runtime import LoadSpec, load
from vit_serve.runtime.backends import choice
from vit_serve.runtime.settings import RunnerLimits

pytest.importorskip("onnxruntime")
TWICE = {".onnx": (("onnxruntime", "fp32"), ("onnxruntime", "fp16"))}


def test_one_runtime_for_the_suffix_is_no_choice(tiny_onnx_32):
    assert load(LoadSpec(str(tiny_onnx_32), choose_runtime=True)).info.runtime_choice is None


def test_every_contender_is_timed_and_checked_and_the_fastest_serves(tiny_onnx_32, monkeypatch):
    monkeypatch.setattr(choice, "FILE_RUNTIMES", TWICE)
    closed: list[str] = []
    monkeypatch.setattr("vit_serve.runtime.backends.onnxruntime.OnnxRuntimeBackend.close",
                        lambda self: closed.append(self.info.name))
    backend = load(LoadSpec(str(tiny_onnx_32), device="cpu", choose_runtime=True, choice_budget_s=1.0,
                            limits=RunnerLimits(max_batch=2)))
    table = backend.info.runtime_choice
    assert [r.key for r in table.rows] == ["onnxruntime:fp32", "onnxruntime:fp16"] and not table.pinned
    for r in table.rows:
        assert set(r.images_per_s) == {1, 2} and r.agreement == 1.0 and r.cosine > 0.99999 and r.refused is None
    assert table.chosen == max(table.rows, key=lambda r: r.score).key
    assert closed == ["tiny"]  # the one not chosen
    x = np.zeros((2, 3, 32, 32), np.float32)
    assert backend.classify(x).shape == (2, 10)


def test_a_pin_loads_only_its_runtime(tiny_onnx_32, monkeypatch):
    monkeypatch.setattr(choice, "FILE_RUNTIMES", TWICE)
    backend = load(LoadSpec(str(tiny_onnx_32), device="cpu", pin_runtime="onnxruntime:fp16"))
    table = backend.info.runtime_choice
    assert table.pinned and table.chosen == "onnxruntime:fp16" and [r.key for r in table.rows] == [table.chosen]
    with pytest.raises(ValueError, match=r"'openvino' names none of tiny\.onnx's runtimes \(onnxruntime:fp32, "):
        load(LoadSpec(str(tiny_onnx_32), device="cpu", pin_runtime="openvino"))
