"""vit_export.tensorrt_build / tensorrt_compat / typed_graph: engines from the exported ONNX graphs.

References: TensorRT's own Python bindings (the member names below were read from the string tables of
`tensorrt_cu12_bindings` 10.16.1.11 and 11.4.0.106, `tensorrt_bindings/tensorrt.so`, as pip downloads them;
they agree with NVIDIA's "Removed Python APIs" list for 11.x); onnxruntime (CPU) on the same ONNX file and inputs;
onnx's reference evaluator for the bf16 graph (onnxruntime's CPU provider has no bf16 Conv / MatMul).
Building needs a CUDA GPU and the `tensorrt` package; without them the build test skips with its reason and
the version-dependent decisions are checked as pure functions on both versions' facts: the builder flags set and
cleared, the engine I/O types (TensorRT's `DataType` members; `trt.nptype` has no bfloat16), the verdict on a
reset head, the option check, and the TensorRT version an engine needs.
"""

from __future__ import annotations

import enum
from pathlib import Path

import numpy as np
import pytest
import torch
from vit_export.parity import judge_logits
from vit_export.tensorrt_build import (
    FP32_MAX_ABS,
    TensorRTError,
    _configure,
    _step,
    build_engine,
    compare_runtimes,
    engine_filename,
    unavailable_reason,
)
from vit_export.tensorrt_compat import check_supported, plan_build, profile_shapes, timing_cache_name

import vit_serve
from vit_serve.tensorrt_engine import torch_dtype, version_refusal

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
# trt.DataType's members (both versions); trt.nptype raises TypeError for BF16 (numpy has no bfloat16).
DATA_TYPES = ("FLOAT", "HALF", "INT8", "INT32", "BOOL", "UINT8", "FP8", "BF16", "INT64", "INT4", "FP4")
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


@pytest.mark.parametrize("major", [10, 11])
@pytest.mark.parametrize(("graph", "engine"), COMBOS)
def test_fp32_engines_clear_tf32(major, graph, engine):
    """TensorRT sets BuilderFlag.TF32 by default: an fp32 engine clears it (its 1e-3 bound assumes full fp32), and
    `_configure` clears what the plan says on the builder config."""
    plan = plan_build(VERSIONS[major], engine, graph)
    assert plan.cleared_flags == (("TF32",) if engine == "fp32" else ())
    assert set(plan.cleared_flags) <= BUILDER_FLAGS[major]

    class Config:  # records what _configure does to a builder config
        def __init__(self) -> None:
            self.flags = {"TF32"}  # TensorRT's default

        def set_flag(self, flag: enum.Enum) -> None:
            self.flags.add(flag.name)

        def clear_flag(self, flag: enum.Enum) -> None:
            self.flags.discard(flag.name)

    class Network:
        num_layers = 0

    trt = type("trt", (), {"BuilderFlag": enum.Enum("BuilderFlag", sorted(BUILDER_FLAGS[major]))})
    config = Config()
    _configure(trt, Network(), config, plan)
    assert ("TF32" in config.flags) == (engine != "fp32")
    assert config.flags - {"TF32"} == set(plan.builder_flags)


def test_engine_io_types_map_by_hand_including_bf16():
    types = enum.Enum("DataType", DATA_TYPES)
    assert torch_dtype(types.BF16) is torch.bfloat16 and torch_dtype("DataType.BF16") is torch.bfloat16
    assert [torch_dtype(getattr(types, n)) for n in ("FLOAT", "HALF", "INT32", "INT64", "BOOL")] == [
        torch.float32, torch.float16, torch.int32, torch.int64, torch.bool]
    for unsupported in ("FP8", "INT4", "FP4"):
        with pytest.raises(ValueError) as info:
            torch_dtype(getattr(types, unsupported))
        assert "\n" not in str(info.value) and unsupported in str(info.value)
    # what a bf16 output buffer becomes: the float32 numpy the callers get
    out = torch.tensor([1.5, -2.25], dtype=torch_dtype(types.BF16))
    assert out.float().cpu().numpy().tolist() == [1.5, -2.25]


def test_an_engine_never_loads_in_an_older_tensorrt():
    msg = version_refusal("model_sm90.plan", "10.16.1.11", "10.8.0.43")
    assert msg is not None and "\n" not in msg
    assert "model_sm90.plan" in msg and "TensorRT 10.16.1.11" in msg and "TensorRT 10.8.0.43" in msg
    assert version_refusal("model_sm90.plan", "11.0.0.114", "10.16.1.11") is not None
    assert version_refusal("model_sm90.plan", "10.16.1.11", "10.16.1.11") is None
    assert version_refusal("model_sm90.plan", "10.8.0.43", "10.16.1.11") is None  # 10.16 > 10.8: numbers, not text
    assert version_refusal("model_sm90.plan", None, "10.16.1.11") is None  # not recorded: TensorRT decides


def test_the_engine_reader_takes_the_version_from_the_manifest(tmp_path, export_tiny):
    """The tensorrt backend checks the version the engine's manifest records (`TensorRTBuild.version`, written by
    `vit_export.sidecar.engine_sidecar` from the build's result)."""
    from vit_export.sidecar import engine_sidecar

    from vit_serve.manifest import read_manifest, write_manifest
    from vit_serve.runtime.backends.tensorrt import built_with

    export_tiny(tmp_path, 32, 3, ["a", "b", "c"], out=tmp_path / "out", name="tiny", formats=("onnx",))
    plan = tmp_path / "out" / "tiny_tensorrt" / "model_sm90.plan"
    plan.parent.mkdir()
    plan.write_bytes(b"stand-in engine")
    assert built_with(plan) is None  # no manifest: TensorRT's own check decides
    built = {"path": plan, "file": plan.name, "compute_capability": "9.0", "tensorrt": "10.16.1.11",
             "precision": "fp16", "graph_precision": "fp32", "strongly_typed": False, "batch": [1, 2, 4],
             "build_s": 1.5, "timing_cache": None, "parity": None}
    write_manifest(plan, engine_sidecar(read_manifest(tmp_path / "out" / "tiny.onnx"), built))
    assert built_with(plan) == "10.16.1.11"


def test_a_reset_head_is_judged_by_its_difference_alone():
    """Reference logits all zero (a freshly reset head): the cosine is 0 or 0/0 and top-1 a tie, so |Δ| decides."""
    zero = np.zeros((4, 10))
    for kw in ({"max_abs": 1e-3, "cosine_min": 0.99999}, {"cosine_min": 0.9999, "top1_min": 1.0}):
        assert judge_logits(zero, zero, zero_max_abs=1e-3, **kw)
        noise = np.random.default_rng(0).uniform(-1e-4, 1e-4, zero.shape)  # argmax differs from the reference's
        assert judge_logits(zero, noise, zero_max_abs=1e-3, **kw)
        assert not judge_logits(zero, noise * 100, zero_max_abs=1e-3, **kw)  # 1e-2 away
        assert not judge_logits(zero, zero + np.nan, zero_max_abs=1e-3, **kw)
    live = np.random.default_rng(1).standard_normal((2, 10))
    mixed = np.concatenate([zero[:2], live])
    assert judge_logits(mixed, mixed, zero_max_abs=1e-3, cosine_min=0.9999, top1_min=1.0)
    flipped = mixed.copy()
    flipped[2] = -flipped[2]  # a live row pointing the other way still fails
    assert not judge_logits(mixed, flipped, zero_max_abs=1e-3, cosine_min=0.9999, top1_min=1.0)


def test_fp16_graph_with_another_engine_precision_is_refused(capsys):
    """`--precision fp16` builds the engine from the fp16 graph: another --trt-precision is refused in one line,
    not silently replaced by fp16."""
    from vit_export import cli
    from vit_export.pipeline import ExportOptions, OptionError

    for trt_precision in ("fp32", "bf16"):
        with pytest.raises(OptionError, match=f"trt_precision {trt_precision}"):
            ExportOptions(res=64, formats=("tensorrt",), precision="fp16", trt_precision=trt_precision)
        code = cli.main(["missing.safetensors", "--format", "tensorrt", "--res", "64", "--precision", "fp16",
                         "--trt-precision", trt_precision])
        err = capsys.readouterr().err
        assert code != 0 and len(err.strip().splitlines()) == 1, err
        assert f"--trt-precision {trt_precision}" in err and "--precision fp16" in err
    ExportOptions(res=64, formats=("tensorrt",), precision="fp16", trt_precision="fp16")  # agreeing: fine
    ExportOptions(res=64, formats=("onnx",), precision="fp16", trt_precision="bf16")  # no engine: nothing to refuse


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


def test_engine_check_of_a_reset_head_passes_on_equal_zeros(tiny, tmp_path):
    """A model whose head is reset to zero: onnxruntime's logits are all zero, the candidate's too. main judged the
    rows' cosine (0 / 0 -> 0) and failed the engine in every precision; |Δ| <= 1e-3 now decides."""
    import copy

    from vit_export.onnx_export import export_onnx
    from vit_export.parity import session

    reset = copy.deepcopy(tiny)
    torch.nn.init.zeros_(reset.head.weight)
    torch.nn.init.zeros_(reset.head.bias)
    path = export_onnx(reset, tmp_path / "reset.onnx", res=(64, 64))
    sess = session(path, threads=1)
    run = lambda x: sess.run(None, {"pixel_values": x})[0]  # noqa: E731
    for precision in ("fp32", "fp16", "bf16"):
        check = compare_runtimes(path, run, precision, (1, 4))
        assert {r["cosine"] for r in check["rows"]} == {0.0} and check["ok"], check
    off = compare_runtimes(path, lambda x: run(x) + 2 * FP32_MAX_ABS, "fp16", (1, 4))
    assert not off["ok"]


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
    assert Path(info.path).exists() and info.file.startswith("model_sm")
    assert info.strongly_typed == plan.strongly_typed
    cache = tmp_path / timing_cache_name(info.compute_capability, info.version)
    assert cache.stat().st_size > 0
    assert info.parity.ok, info.parity
    again = build_engine(source, tmp_path / "plan2", precision=precision, batch=(1, 4, 8), cache_dir=tmp_path,
                         check_onnx=onnx_files["fp32"], progress=lambda s: None)
    assert again.timing_cache["loaded"]  # the strict check accepted the cache this GPU wrote
    with pytest.raises(FileExistsError):
        build_engine(source, tmp_path / "plan", precision=precision, progress=lambda s: None)
