"""The choice among the backends that serve one exported file (`vit_serve.runtime.backends.choice`): NAME.onnx on
onnxruntime (fp32, the reference) and on OpenVINO, two real runtimes, no mocks. Which one wins is whatever this
CPU says: the assertions are on the mechanism (every contender loaded, checked against the reference, timed at
batch 1 and the batch limit, the others closed, the table on the one served) and on a pin."""

from __future__ import annotations

import numpy as np
import pytest

from vit_serve.runtime import LoadSpec, load
from vit_serve.runtime.backends import choice
from vit_serve.runtime.settings import RunnerLimits

pytest.importorskip("onnxruntime")
pytest.importorskip("openvino")


def test_without_the_setting_the_suffix_decides(tiny_onnx_32):
    backend = load(LoadSpec(str(tiny_onnx_32), device="cpu"))
    assert backend.name == "onnxruntime" and backend.info.runtime_choice is None


def test_every_contender_is_timed_and_checked_and_the_fastest_passing_serves(tiny_onnx_32, monkeypatch):
    closed: list[str] = []
    for module, cls in (("onnxruntime", "OnnxRuntimeBackend"), ("openvino", "OpenVINOBackend")):
        monkeypatch.setattr(f"vit_serve.runtime.backends.{module}.{cls}.close",
                            lambda self, module=module: closed.append(module))
    # f32: OpenVINO at full precision (no accuracy gate at load: the test's model has an untrained head)
    backend = load(LoadSpec(str(tiny_onnx_32), device="cpu", choose_runtime=True, choice_budget_s=1.0,
                            precision="f32", limits=RunnerLimits(max_batch=2)))
    table = backend.info.runtime_choice
    assert [r.key for r in table.rows] == ["onnxruntime:fp32", "openvino:fp32"] and not table.pinned
    for r in table.rows:
        assert set(r.images_per_s) == {1, 2} and r.agreement == 1.0 and r.cosine > 0.9999 and r.refused is None
    fastest = max(table.rows, key=lambda r: r.score)
    assert table.chosen == fastest.key and backend.name == fastest.runtime
    assert closed == [r.runtime for r in table.rows if r is not fastest]  # the one not chosen
    assert backend.classify(np.zeros((2, 3, 32, 32), np.float32)).shape == (2, 10)


@pytest.mark.parametrize(("pin", "runtime"), [("openvino:fp32", "openvino"), ("onnxruntime", "onnxruntime")])
def test_a_pin_loads_only_its_runtime(tiny_onnx_32, pin, runtime):
    backend = load(LoadSpec(str(tiny_onnx_32), device="cpu", pin_runtime=pin))
    table = backend.info.runtime_choice
    assert backend.name == runtime and table.pinned and [r.runtime for r in table.rows] == [runtime]
    assert not table.rows[0].images_per_s


def test_a_pin_that_names_none_of_the_files_runtimes_fails_the_load(tiny_onnx_32):
    with pytest.raises(ValueError, match=r"'eager' names none of tiny\.onnx's runtimes \(onnxruntime:fp32, "
                                         r"openvino:auto\)"):
        load(LoadSpec(str(tiny_onnx_32), device="cpu", pin_runtime="eager"))


def test_the_runtime_setting_is_a_pin_of_its_own(tiny_onnx_32):
    spec = LoadSpec(str(tiny_onnx_32), device="cpu", choose_runtime=True, runtime="openvino")
    assert not choice.wanted(spec)
