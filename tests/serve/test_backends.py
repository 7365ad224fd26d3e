"""The backends on their own: torch (checkpoint) and onnxruntime (vit-export's files) agree on real photos, read
the same metadata, explain alike; the factory picks by suffix; TensorRT fails clearly without a GPU (and, on a
GPU with tensorrt, matches onnxruntime)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gateway_helpers import LABELS, RES, settings_for

from vit_serve.explain import rollout
from vit_serve.manifest import RolloutSettings
from vit_serve.preprocess import preprocess
from vit_serve.runtime import LoadSpec, check, load, resolve_backend
from vit_serve.runtime.backends.onnxruntime import OnnxRuntimeBackend
from vit_serve.runtime.backends.torch import TorchBackend
from vit_serve.runtime.task import Task


def spec_for(model, **kw) -> LoadSpec:
    """The spec of the test settings (`settings_for`)."""
    return LoadSpec.of(settings_for(model, **kw))


@pytest.fixture(scope="module")
def torch_backend(tiny_ckpt):
    return TorchBackend(tiny_ckpt, device="cpu", threads=1)


@pytest.fixture(scope="module")
def ort_backend(tiny_onnx):
    return OnnxRuntimeBackend(tiny_onnx, device="cpu", threads=1)


def _batch(photos, cfg) -> np.ndarray:
    return torch.stack([preprocess(b, cfg) for b in photos.values()]).numpy()


def test_metadata_from_checkpoint_and_sidecar_agree(torch_backend, ort_backend, tiny_model):
    for info in (torch_backend.info, ort_backend.info):
        assert info.resolution == RES
        assert info.grid == (2, 3)
        assert info.patch_size == 16
        assert info.num_classes == 10
        assert info.labels == LABELS
        assert info.preprocess == tiny_model.preprocess_cfg
    assert torch_backend.info.name == "tiny" and ort_backend.info.name == "tiny"
    assert torch_backend.info.rollout is None  # any settings
    # baked into the graph, and the same pooling / prefix tokens as the model
    assert ort_backend.info.rollout == RolloutSettings("mean", 0.9, tiny_model.cfg.pool, tiny_model.num_prefix_tokens)
    for info, backend in ((torch_backend.info, "torch"), (ort_backend.info, "onnxruntime")):
        assert (info.backend, info.device, info.pool, info.precision) == (backend, "cpu", tiny_model.cfg.pool, "fp32")
        assert not info.dynamic_resolution
    assert ort_backend.info.providers == ("CPUExecutionProvider",)


def test_torch_and_onnxruntime_agree_on_photos(torch_backend, ort_backend, tiny_model, photos):
    x = _batch(photos, torch_backend.info.preprocess)
    with torch.no_grad():
        ref = tiny_model(torch.from_numpy(x)).numpy()
    a, b = torch_backend.classify(x), ort_backend.classify(x)
    assert a.shape == b.shape == (3, 10) and a.dtype == b.dtype == np.float32
    np.testing.assert_allclose(a, ref, atol=1e-5)
    np.testing.assert_allclose(b, ref, atol=1e-4)
    assert (np.argsort(-a, 1)[:, :5] == np.argsort(-b, 1)[:, :5]).all()
    assert len(set(a.argmax(1))) > 1 or np.ptp(a) > 0.5  # the random model does tell the photos apart
    # A batch gives each row what it gives alone.
    for i in range(3):
        np.testing.assert_allclose(ort_backend.classify(x[i:i + 1])[0], b[i], atol=1e-5)


def test_explain_matches_library_rollout(torch_backend, ort_backend, tiny_model, photos):
    x = _batch(photos, torch_backend.info.preprocess)
    with torch.no_grad():
        logits, attn = tiny_model(torch.from_numpy(x), return_attention=True)
    for fusion, ratio in (("mean", 0.9), ("max", 0.5), ("min", 0.0)):
        ref = rollout(attn, (2, 3), 1, "token", fusion, ratio).map.numpy()
        got_logits, got = torch_backend.explain(x, RolloutSettings(fusion, ratio))
        assert got.shape == (3, 2, 3)
        np.testing.assert_allclose(got, ref, atol=1e-6)
        np.testing.assert_allclose(got_logits, logits.numpy(), atol=1e-5)
    ort_logits, ort_map = ort_backend.explain(x, RolloutSettings("mean", 0.9))
    np.testing.assert_allclose(ort_map, rollout(attn, (2, 3), 1, "token", "mean", 0.9).map.numpy(), atol=1e-5)
    np.testing.assert_allclose(ort_logits, logits.numpy(), atol=1e-4)


def test_exported_explain_graph_refuses_other_settings(ort_backend, torch_backend, photos):
    """Rollout settings are resolved once, against the model's info (the same message for every backend)."""
    x = _batch(photos, ort_backend.info.preprocess)[:1]
    info = ort_backend.info
    with pytest.raises(ValueError, match=r"head_fusion=mean and discard_ratio=0\.9 only"):
        info.resolve_rollout("max", 0.9)
    with pytest.raises(ValueError, match=r"asked: head_fusion=mean, discard_ratio=0\.5"):
        info.resolve_rollout("mean", 0.5)
    assert info.resolve_rollout() == info.resolve_rollout("mean", 0.9) == RolloutSettings("mean", 0.9)
    assert torch_backend.info.resolve_rollout("max", 0.5) == RolloutSettings("max", 0.5)  # any, on torch
    assert ort_backend.explain(x)[1].shape == (1, 2, 3)  # the graph's own
    out = ort_backend.run(Task("explain", info.resolve_rollout()), x)
    np.testing.assert_array_equal(out["rollout"], ort_backend.explain(x)[1])
    with pytest.raises(NotImplementedError, match="torch backend"):
        ort_backend.grad_rollout(x)


def test_grad_rollout_on_torch(torch_backend, tiny_model, photos):
    from vit_serve.explain import grad_rollout

    x = _batch(photos, torch_backend.info.preprocess)[:1]
    ref = grad_rollout(tiny_model, torch.from_numpy(x), 3).map[0].numpy()
    np.testing.assert_allclose(torch_backend.grad_rollout(x, 3), ref, atol=1e-6)


def test_factory_picks_backend_by_suffix(tiny_ckpt, tiny_onnx):
    assert resolve_backend(spec_for("m.onnx")) == "onnxruntime"
    assert resolve_backend(spec_for("m.engine")) == "tensorrt"
    assert resolve_backend(spec_for("m.plan")) == "tensorrt"
    assert resolve_backend(spec_for("m.safetensors")) == "torch"
    assert resolve_backend(spec_for("vit", backend="triton")) == "triton"
    assert isinstance(load(spec_for(tiny_ckpt)), TorchBackend)
    ort = load(spec_for(tiny_onnx, model_name="shown"))
    assert isinstance(ort, OnnxRuntimeBackend) and ort.info.name == "shown"


def test_missing_files_are_clear_errors(tiny_onnx, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        check(spec_for(tmp_path / "absent.safetensors"))
    with pytest.raises(ValueError, match="no model given"):
        check(spec_for(""))
    lone = tmp_path / "lone.onnx"
    shutil.copy(tiny_onnx, lone)
    with pytest.raises(FileNotFoundError, match=r"no sidecar lone\.json"):
        load(spec_for(lone))
    explain = tiny_onnx.with_name("tiny_explain.onnx")
    with pytest.raises(ValueError, match=r"serve the logits graph tiny\.onnx"):
        load(spec_for(explain))
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not onnx")
    bad.with_suffix(".json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load(spec_for(bad))


def _tensorrt_available() -> bool:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(_tensorrt_available(), reason="tensorrt and a GPU are here: the engine test runs instead")
def test_tensorrt_without_gpu_or_package_is_a_clear_error(tiny_onnx, tmp_path):
    engine = tmp_path / "tiny.engine"
    engine.write_bytes(b"\0" * 16)
    shutil.copy(tiny_onnx.with_suffix(".json"), engine.with_suffix(".json"))
    with pytest.raises(OSError, match="tensorrt backend needs"):
        check(spec_for(engine))
    with pytest.raises(OSError, match="tensorrt backend needs"):
        load(spec_for(engine))


@pytest.mark.skipif(not _tensorrt_available(), reason="needs tensorrt and a CUDA GPU")
def test_tensorrt_engine_matches_onnxruntime(tiny_onnx, ort_backend, photos, tmp_path):
    import tensorrt as trt

    from vit_serve.runtime.backends.tensorrt import TensorRTBackend

    logger = trt.Logger(trt.Logger.WARNING)
    h, w = RES
    for graph in (tiny_onnx, tiny_onnx.with_name("tiny_explain.onnx")):
        builder = trt.Builder(logger)
        network = builder.create_network(0)
        parser = trt.OnnxParser(network, logger)
        assert parser.parse(graph.read_bytes()), [parser.get_error(i) for i in range(parser.num_errors)]
        config = builder.create_builder_config()
        profile = builder.create_optimization_profile()
        profile.set_shape("pixel_values", (1, 3, h, w), (4, 3, h, w), (4, 3, h, w))
        config.add_optimization_profile(profile)
        engine = tmp_path / f"{graph.stem}.engine"
        engine.write_bytes(bytes(builder.build_serialized_network(network, config)))
        shutil.copy(graph.with_suffix(".json"), engine.with_suffix(".json"))
    backend = TensorRTBackend(tmp_path / "tiny.engine")
    x = np.concatenate([_batch(photos, backend.info.preprocess)] * 2)  # 6 rows > the profile's 4: chunked
    np.testing.assert_allclose(backend.classify(x), ort_backend.classify(x), atol=1e-3)
    np.testing.assert_allclose(backend.explain(x)[1], ort_backend.explain(x)[1], atol=1e-4)


def test_engine_finds_the_explain_graph_its_export_came_with(tiny_onnx, tmp_path):
    """The layout `vit-export --format tensorrt` writes: <out>/NAME.onnx, NAME_explain.onnx and the engine in
    <out>/NAME_tensorrt/ with a sidecar naming `source_onnx`. The engine's metadata is read from its sidecar and
    its /explain comes from NAME_explain.onnx (run by onnxruntime), whose rollout settings it reports."""
    import json

    from vit_serve.runtime.backends.sidecar import read_export

    out = tmp_path / "exports"
    shutil.copytree(tiny_onnx.parent, out)
    plan = out / "tiny_tensorrt" / "model_sm90.plan"
    plan.parent.mkdir()
    plan.write_bytes(b"\0" * 16)  # read_export reads sidecars only
    side = json.loads((out / "tiny.json").read_text())
    side.update(format="tensorrt", file=plan.name, source_onnx="tiny.onnx")
    plan.with_suffix(".json").write_text(json.dumps(side))

    info, explain = read_export(plan, None, "tensorrt", "engine")
    assert explain == out / "tiny_explain.onnx"
    assert info.explain and info.resolution == RES and info.labels == LABELS
    explain_side = json.loads((out / "tiny_explain.json").read_text())["rollout"]
    assert info.rollout is not None
    assert (info.rollout.head_fusion, info.rollout.discard_ratio) == (
        explain_side["head_fusion"], explain_side["discard_ratio"])
    assert (info.backend, info.device) == ("tensorrt", "cuda")

    (out / "tiny_explain.onnx").unlink()  # no explain graph anywhere: served without /explain
    info, explain = read_export(plan, None, "tensorrt", "engine")
    assert explain is None and not info.explain
