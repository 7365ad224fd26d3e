"""vit_export.tensorrt_build: engines from the exported ONNX graphs, checked against onnxruntime.

Reference: onnxruntime (CPU) on the same ONNX file and inputs. Building needs a CUDA GPU and the `tensorrt`
package; without them the build tests skip with the reason and only the pure helpers are checked.
"""

from __future__ import annotations

import pytest
from vit_export.tensorrt_build import build_engine, engine_filename, unavailable_reason

import vit_serve

REASON = unavailable_reason()
needs_trt = pytest.mark.skipif(REASON is not None, reason=f"TensorRT build skipped: {REASON}")


def test_engine_named_by_compute_capability():
    assert engine_filename("9.0") == "model_sm90.plan"
    assert engine_filename("8.6") == "model_sm86.plan"


def test_unavailable_reason_is_one_line():
    if REASON is None:
        pytest.skip("TensorRT and a GPU are present")
    assert "\n" not in REASON and len(REASON) > 10


def test_build_refused_without_tensorrt(tmp_path):
    if REASON is None:
        pytest.skip("TensorRT and a GPU are present")
    with pytest.raises(RuntimeError, match=REASON.split(" (")[0][:20]):
        build_engine(tmp_path / "missing.onnx", tmp_path)


@pytest.fixture(scope="module")
def onnx_files(tmp_path_factory, randomize):
    from vit_export.onnx_export import export_onnx

    d = tmp_path_factory.mktemp("trt")
    model = randomize(vit_serve.create_model("Ti/16", num_classes=10, depth=2, img_size=64), seed=0)
    return {
        "fp32": export_onnx(model, d / "m32.onnx", res=(64, 64)),
        "fp16": export_onnx(model, d / "m16.onnx", res=(64, 64), precision="fp16"),
        "dir": d,
    }


@needs_trt
@pytest.mark.parametrize("graph,precision", [("fp32", "fp32"), ("fp32", "fp16"), ("fp16", "fp16"), ("fp32", "bf16")])
def test_engine_matches_onnxruntime(onnx_files, graph, precision, tmp_path):
    cache = tmp_path / "timing.cache"
    info = build_engine(onnx_files[graph], tmp_path / "plan", precision=precision, batch=(1, 4, 8),
                        timing_cache=cache, check_onnx=onnx_files["fp32"], progress=lambda s: None)
    assert info["path"].exists() and info["file"].startswith("model_sm")
    assert info["strongly_typed"] == (graph == "fp16")
    assert cache.stat().st_size > 0
    assert info["parity"]["ok"], info["parity"]
    with pytest.raises(FileExistsError):
        build_engine(onnx_files[graph], tmp_path / "plan", precision=precision, progress=lambda s: None)
