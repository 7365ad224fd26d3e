"""vit_export.tensorrt_build / tensorrt_compat / typed_graph: engines from the exported ONNX graphs.

References: TensorRT's own Python bindings (the member names below were read from the string tables of
`tensorrt_cu12_bindings` 10.16.1.11 and 11.4.0.106, `tensorrt_bindings/tensorrt.so`, as pip downloads them;
they agree with NVIDIA's "Removed Python APIs" list for 11.x); onnxruntime (CPU) on the same ONNX file and inputs;
onnx's reference evaluator for the bf16 graph (onnxruntime's CPU provider has no bf16 Conv / MatMul).
Building needs a CUDA GPU and the `tensorrt` package; without them the build test skips with its reason and
the version-dependent decisions are checked as pure functions on both versions' facts.
"""

from __future__ import annotations

import enum

import numpy as np
import pytest
import torch
from vit_export.tensorrt_build import (
    TensorRTError,
    _step,
    build_engine,
    compare_runtimes,
    engine_filename,
    unavailable_reason,
)
from vit_export.tensorrt_compat import check_supported, plan_build, profile_shapes, timing_cache_name

import vit_serve

REASON = unavailable_reason()
needs_trt = pytest.mark.skipif(REASON is not None, reason=f"TensorRT build skipped: {REASON}")

# What each major version's bindings expose (a contiguous block of each enum's members; ILayer's precision API).
BUILDER_FLAGS = {
    10: {"FP16", "BF16", "DEBUG", "GPU_FALLBACK", "DISABLE_TIMING_CACHE", "EDITABLE_TIMING_CACHE", "TF32",
         "SPARSE_WEIGHTS", "SAFETY_SCOPE", "OBEY_PRECISION_CONSTRAINTS", "PREFER_PRECISION_CONSTRAINTS", "DIRECT_IO",
         "REJECT_EMPTY_ALGORITHMS", "VERSION_COMPATIBLE", "ERROR_ON_TIMING_CACHE_MISS", "DISABLE_COMPILATION_CACHE",
         "WEIGHTLESS", "STRIP_PLAN", "REFIT_IDENTICAL", "WEIGHT_STREAMING", "INT4", "REFIT_INDIVIDUAL",
         "STRICT_NANS", "MONITOR_MEMORY", "DISTRIBUTIVE_INDEPENDENCE"},
    11: {"DEBUG", "GPU_FALLBACK", "DISABLE_TIMING_CACHE", "EDITABLE_TIMING_CACHE", "TF32", "SPARSE_WEIGHTS",
         "SAFETY_SCOPE", "DIRECT_IO", "VERSION_COMPATIBLE", "ERROR_ON_TIMING_CACHE_MISS", "DISABLE_COMPILATION_CACHE",
         "STRIP_PLAN", "REFIT_IDENTICAL", "WEIGHT_STREAMING", "REFIT_INDIVIDUAL", "STRICT_NANS", "MONITOR_MEMORY",
         "DISTRIBUTIVE_INDEPENDENCE"},
}
CREATION_FLAGS = {
    10: {"EXPLICIT_BATCH", "STRONGLY_TYPED", "PREFER_AOT_PYTHON_PLUGINS", "PREFER_JIT_PYTHON_PLUGINS"},
    11: {"STRONGLY_TYPED", "PREFER_AOT_PYTHON_PLUGINS", "PREFER_JIT_PYTHON_PLUGINS"},  # STRONGLY_TYPED: ignored
}
LAYER_PRECISION_API = {10: True, 11: False}  # ILayer.precision / set_output_type / reset_precision
VERSIONS = {10: "10.16.1.11", 11: "11.4.0.106"}
COMBOS = [("fp32", "fp32"), ("fp32", "fp16"), ("fp32", "bf16"), ("fp16", "fp16"), ("bf16", "bf16")]


def test_engine_named_by_compute_capability():
    assert engine_filename("9.0") == "model_sm90.plan"
    assert engine_filename("8.6") == "model_sm86.plan"


@pytest.mark.parametrize("major", [10, 11])
@pytest.mark.parametrize(("graph", "engine"), COMBOS)
def test_build_plan_uses_only_what_the_version_has(major, graph, engine):
    """Every flag the plan sets exists in that version's bindings; 11.x is strongly typed from a typed graph."""
    plan = plan_build(VERSIONS[major], engine, graph)
    assert set(plan.builder_flags) <= BUILDER_FLAGS[major], plan
    assert set(plan.creation_flags) <= CREATION_FLAGS[major], plan
    assert not plan.pin_norm_fp32 or LAYER_PRECISION_API[major], plan
    if major == 11:
        assert plan.strongly_typed and plan.graph_precision == engine and plan.builder_flags == ()
        assert plan.creation_flags == ()  # deprecated and ignored in 11.x: not passed
    elif graph == "fp32":  # 10.x keeps the weakly typed build of the fp32 graph
        assert not plan.strongly_typed and plan.graph_precision == "fp32"
        expected = () if engine == "fp32" else (engine.upper(), "OBEY_PRECISION_CONSTRAINTS")
        assert plan.builder_flags == expected and plan.pin_norm_fp32 == (engine != "fp32")
    else:
        assert plan.strongly_typed and plan.creation_flags == ("STRONGLY_TYPED",) and plan.builder_flags == ()


def test_the_default_export_on_tensorrt_11_needs_an_fp16_graph():
    """`vit-export --format tensorrt` (fp32 graph, fp16 engine): main set BuilderFlag.FP16, absent from 11.x."""
    assert "FP16" not in BUILDER_FLAGS[11] and "OBEY_PRECISION_CONSTRAINTS" not in BUILDER_FLAGS[11]
    plan = plan_build("11.0.0.114", "fp16", "fp32")
    assert plan.graph_precision == "fp16" and plan.strongly_typed


@pytest.mark.parametrize("version", ["8.6.1", "9.3.0", "12.0.0", "nonsense"])
def test_versions_outside_the_tested_range_are_one_line_errors(version):
    with pytest.raises(ValueError) as info:
        check_supported(version)
    assert "\n" not in str(info.value)
    assert "10.x and 11.x" in str(info.value) or "cannot read" in str(info.value)


def test_a_typed_graph_builds_only_its_own_precision():
    with pytest.raises(ValueError, match="an fp16 graph builds an fp16 engine only"):
        plan_build(VERSIONS[10], "bf16", "fp16")


def test_timing_cache_named_by_architecture_and_version():
    """main shared one `tensorrt.cache` across GPUs and TensorRT versions; every (cc, version) now has its own."""
    names = {timing_cache_name(cc, v) for cc in ("8.0", "8.6", "9.0") for v in VERSIONS.values()}
    assert len(names) == 6
    assert timing_cache_name("9.0", "10.16.1.11") == "tensorrt_sm90_trt10.16.1.11.cache"
    for bad in (("9", "10.1"), ("9.0", "10 1/../x")):
        with pytest.raises(ValueError):
            timing_cache_name(*bad)


def test_profile_shapes_refuse_a_dynamic_height_or_width():
    assert profile_shapes((-1, 3, 224, 320), (1, 8, 16)) == ((1, 3, 224, 320), (8, 3, 224, 320), (16, 3, 224, 320))
    with pytest.raises(ValueError, match="fixed --res"):
        profile_shapes((-1, 3, -1, -1), (1, 8, 16))
    with pytest.raises(ValueError, match="1 <= min <= opt <= max"):
        profile_shapes((-1, 3, 224, 224), (4, 2, 16))


def test_a_tensorrt_attribute_error_becomes_one_line():
    """The 11.x failure of main (`trt.BuilderFlag.FP16`), on an enum with 11.4's members, is one line."""
    flags11 = enum.Enum("BuilderFlag", sorted(BUILDER_FLAGS[11]))
    with pytest.raises(TensorRTError) as info, _step("11.4.0.106", "to configure the build"):
        flags11.FP16  # noqa: B018 - the attribute access is what fails
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("TensorRT 11.4.0.106 failed to configure the build: AttributeError")
    assert isinstance(info.value, RuntimeError)  # vit-export's main prints RuntimeErrors as one line


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
def tiny(randomize):
    return randomize(vit_serve.create_model("Ti/16", num_classes=10, depth=2, img_size=64), seed=0)


@pytest.fixture(scope="module")
def onnx_files(tmp_path_factory, tiny):
    from vit_export.onnx_export import export_onnx

    d = tmp_path_factory.mktemp("trt")
    return {
        "fp32": export_onnx(tiny, d / "m32.onnx", res=(64, 64)),
        "fp16": export_onnx(tiny, d / "m16.onnx", res=(64, 64), precision="fp16"),
        "dir": d,
    }


def test_bf16_typed_graph_matches_pytorch_with_layernorm_in_fp32(tiny, tmp_path):
    """The bf16 graph TensorRT 11 builds from, run by onnx's reference evaluator, vs the fp32 PyTorch model."""
    import onnx
    from onnx.reference import ReferenceEvaluator
    from vit_export.typed_graph import export_typed, graph_precision, norm_input_types

    path = export_typed(tiny, tmp_path / "m_bf16.onnx", "bf16", res=(64, 64))
    proto = onnx.load(str(path))
    assert graph_precision(proto) == "bf16"
    weights = [i for i in proto.graph.initializer if i.data_type != onnx.TensorProto.INT64]
    assert sum(i.data_type == onnx.TensorProto.BFLOAT16 for i in weights) > len(weights) // 2
    norms = norm_input_types(proto)
    assert len(norms) == 2 * 2 + 1 and set(norms.values()) == {"FLOAT"}, norms  # every LayerNorm computes in fp32
    assert [i.type.tensor_type.elem_type for i in (*proto.graph.input, *proto.graph.output)] == [1, 1]
    x = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    got = ReferenceEvaluator(proto).run(None, {"pixel_values": x.numpy()})[0].astype(np.float64)
    with torch.no_grad():
        ref = tiny(x).double().numpy()
    cos = (got * ref).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))
    # bf16 keeps 8 bits of mantissa: measured 0.036-0.06 max |Δ logit| on logits of O(3), cosine > 0.9999.
    assert cos.min() > 0.999 and (got.argmax(1) == ref.argmax(1)).all(), (cos, np.abs(got - ref).max())


def test_engine_parity_failure_exits_1_with_its_table(onnx_files, tiny, capsys):
    """The engine check's decision on a real second runtime: onnxruntime running the fp16 graph, judged as an fp32
    engine, fails the 1e-3 bound -> table with 'NO', and `vit-export` exits 1 with one line; judged as fp16, it
    passes."""
    from vit_export import cli
    from vit_export.parity import check_parity, session
    from vit_export.pipeline import ExportOptions, ExportResult, WrittenEngine, WrittenGraph, report_engine_parity

    from vit_serve.manifest import Parity

    sess = session(onnx_files["fp16"], threads=1)
    run = lambda x: sess.run(None, {"pixel_values": x})[0]  # noqa: E731
    failing = compare_runtimes(onnx_files["fp32"], run, "fp32", (1, 4), candidate="onnxruntime fp16 graph")
    assert not failing["ok"] and max(r["max_abs"] for r in failing["rows"]) > 1e-3
    assert report_engine_parity(failing, "model_sm90.plan", print) is False
    out = capsys.readouterr().out
    assert "parity: model_sm90.plan (onnxruntime fp16 graph fp32 vs onnxruntime CPU" in out
    assert "NO" in out and "parity FAILED" in out

    # What `vit-export` makes of an export whose engine failed that check: exit 1 and one line on stderr.
    graph = WrittenGraph(onnx_files["fp32"], onnx_files["dir"] / "m32.json",
                         check_parity(tiny, onnx_files["fp32"], batch_sizes=(1,), threads=1))
    plan = onnx_files["dir"] / "model_sm90.plan"
    engine = WrittenEngine(plan, plan.with_suffix(".json"), Parity.from_dict(failing), None, {})
    result = ExportResult(ExportOptions(res=64, formats=("tensorrt",)), "m", (64, 64), graph, graph, engine)
    assert graph.parity.ok and not result.ok and cli._exit_code(result) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "the engine model_sm90.plan failed its parity check" in err

    passing = compare_runtimes(onnx_files["fp32"], run, "fp16", (1, 4))
    assert passing["ok"] and report_engine_parity(passing, "model_sm90.plan", print) is True
    out, err = capsys.readouterr()
    assert "parity passed" in out and err == ""


@needs_trt
@pytest.mark.parametrize("graph,precision", [("fp32", "fp32"), ("fp32", "fp16"), ("fp16", "fp16"), ("fp32", "bf16")])
def test_engine_matches_onnxruntime(onnx_files, tiny, graph, precision, tmp_path):
    from vit_export.tensorrt_build import tensorrt_version
    from vit_export.typed_graph import export_typed

    plan = plan_build(tensorrt_version(), precision, graph)
    source = onnx_files[graph]
    if plan.graph_precision != graph:  # TensorRT 11: the typed graph
        source = export_typed(tiny, tmp_path / f"m_{plan.graph_precision}.onnx", plan.graph_precision, res=(64, 64))
    info = build_engine(source, tmp_path / "plan", precision=precision, batch=(1, 4, 8), cache_dir=tmp_path,
                        check_onnx=onnx_files["fp32"], progress=lambda s: None)
    assert info["path"].exists() and info["file"].startswith("model_sm")
    assert info["strongly_typed"] == plan.strongly_typed
    cache = tmp_path / timing_cache_name(info["compute_capability"], info["tensorrt"])
    assert cache.stat().st_size > 0
    assert info["parity"]["ok"], info["parity"]
    again = build_engine(source, tmp_path / "plan2", precision=precision, batch=(1, 4, 8), cache_dir=tmp_path,
                         check_onnx=onnx_files["fp32"], progress=lambda s: None)
    assert again["timing_cache"]["loaded"]  # the strict check accepted the cache this GPU wrote
    with pytest.raises(FileExistsError):
        build_engine(source, tmp_path / "plan", precision=precision, progress=lambda s: None)
