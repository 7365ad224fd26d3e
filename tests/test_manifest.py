"""vit_serve.manifest: the one typed, versioned contract between `vit-export` and every reader.

References: the files a real `vit-export` writes (ONNX graphs, manifests, a Triton repository); onnx's and
onnxruntime's own view of the exported graph (tensor names and shapes); hashlib for the sha256s; Triton's own
config schema (`tritonclient.grpc.model_config_pb2`, read with protobuf's text_format and json_format, as Triton's
get_model_config answers as JSON). tests/data/manifest_v1/ holds files written by the code before schema 2
(a tiny Ti/16 at 32x48 exported with `vit-export --format onnx,triton`, its dynamic-resolution and int8 exports,
and an engine manifest as that code's `_tensorrt()` wrote it), with the ModelInfo the readers of that code gave
for each (expected_model_info.json).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from vit_serve.explain import DEFAULT_DISCARD_RATIO, DEFAULT_HEAD_FUSION
from vit_serve.manifest import (
    SCHEMA_VERSION,
    ExportManifest,
    RolloutSettings,
    TritonMeta,
    manifest_path,
    read_manifest,
    write_manifest,
)

V1 = Path(__file__).parent / "data" / "manifest_v1"
ROOT = Path(__file__).parents[1]
LABELS = ["tabby", "espresso", "astronaut", "teapot", "lighthouse"]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _config_json(path: Path) -> dict:
    """A config.pbtxt as Triton's get_model_config gives it as JSON (gRPC's as_json: protobuf's json_format)."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    msg = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, export_tiny) -> dict[str, Path]:
    """A real `vit_export.export` (formats onnx, triton) of a random 2-block Ti/16 at 32x32 with 5 labels."""
    d = tmp_path_factory.mktemp("manifest")
    result, ckpt = export_tiny(d, 32, 3, LABELS, out=d / "out", name="tiny", formats=("onnx", "triton"),
                               repo=d / "repo")
    assert result.ok
    return {"dir": d, "ckpt": ckpt, "onnx": d / "out" / "tiny.onnx", "explain": d / "out" / "tiny_explain.onnx",
            "repo": d / "repo"}


def test_a_real_export_round_trips(exported, tmp_path):
    import onnx
    import onnxruntime as ort

    m = read_manifest(exported["onnx"])
    on_disk = json.loads(manifest_path(exported["onnx"]).read_text())
    assert on_disk["manifest_version"] == SCHEMA_VERSION == m.schema_version == 2
    assert m.to_dict() == on_disk  # what is written is exactly the manifest's JSON
    assert ExportManifest.from_dict(on_disk, "x") == m
    assert m.file_sha256 == _sha(exported["onnx"]) and m.source_checkpoint.sha256 == _sha(exported["ckpt"])
    # The tensors as onnx and onnxruntime see the graph.
    graph = onnx.load(str(exported["onnx"]), load_external_data=False).graph
    assert [t.name for t in m.io.inputs] == [v.name for v in graph.input] == ["pixel_values"]
    sess = ort.InferenceSession(str(exported["onnx"]), providers=["CPUExecutionProvider"])
    assert [list(t.shape) for t in m.io.outputs] == [o.shape for o in sess.get_outputs()] == [["batch", 5]]
    assert m.num_classes == 5 and m.labels == tuple(LABELS) and m.resolution == (32, 32) and m.parity_ok
    assert (m.format, m.explain, m.rollout, m.precision, m.batch) == ("onnx", False, None, "fp32", "dynamic")

    ex = read_manifest(exported["explain"])
    assert ex.explain and ex.rollout == RolloutSettings(DEFAULT_HEAD_FUSION, DEFAULT_DISCARD_RATIO, "token", 1)
    assert [list(o.shape) for o in ex.io.outputs] == [o.shape for o in ort.InferenceSession(
        str(exported["explain"]), providers=["CPUExecutionProvider"]).get_outputs()]

    target = tmp_path / "copy.onnx"
    assert write_manifest(target, m) == tmp_path / "copy.json"
    assert read_manifest(target) == m
    with pytest.raises(FileExistsError, match=r"copy\.json exists"):
        write_manifest(target, m)  # never silently
    changed = dataclasses.replace(m, labels=("a", "b", "c", "d", "e"))
    write_manifest(target, changed, overwrite=True)
    assert read_manifest(tmp_path / "copy.json") == changed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.json"]  # atomic: no temp file left


def test_every_reader_gets_its_fields_from_the_manifest(exported, tmp_path, capsys):
    """The onnxruntime backend, the engine reader (its pure functions), the Triton repository writer's output and
    the Triton backend's config reader all give the contract the manifest holds."""
    import onnxruntime as ort
    from vit_export.pipeline import report_engine_parity
    from vit_export.sidecar import engine_sidecar
    from vit_export.tensorrt_build import compare_runtimes

    from vit_serve.runtime.backends import triton
    from vit_serve.runtime.backends.onnxruntime import OnnxRuntimeBackend
    from vit_serve.runtime.backends.sidecar import read_export

    m, ex = read_manifest(exported["onnx"]), read_manifest(exported["explain"])
    ort_info = OnnxRuntimeBackend(exported["onnx"], device="cpu", threads=1).info
    contract = (m.resolution, m.architecture.patch_size, m.num_classes, list(m.labels), m.preprocess, ex.rollout)
    assert (ort_info.resolution, ort_info.patch_size, ort_info.num_classes, ort_info.labels, ort_info.preprocess,
            ort_info.rollout) == contract
    assert (ort_info.backend, ort_info.device, ort_info.pool, ort_info.precision) == ("onnxruntime", "cpu",
                                                                                      "token", "fp32")

    # An engine's manifest, as `vit-export --format tensorrt` writes it, with onnxruntime standing in for the
    # engine (no GPU here) in the real engine check, and a stand-in engine file (the readers hash it only).
    out = tmp_path / "out"
    shutil.copytree(exported["onnx"].parent, out)
    plan = out / "tiny_tensorrt" / "model_sm90.plan"
    plan.parent.mkdir()
    plan.write_bytes(b"stand-in engine")
    sess = ort.InferenceSession(str(out / "tiny.onnx"), providers=["CPUExecutionProvider"])
    check = compare_runtimes(out / "tiny.onnx", lambda x: sess.run(None, {"pixel_values": x})[0], "fp16", (1, 4),
                             "TensorRT")
    built = {"path": plan, "file": plan.name, "compute_capability": "9.0", "tensorrt": "10.16.1.11",
             "precision": "fp16", "graph_precision": "fp32", "strongly_typed": False, "batch": [1, 2, 4],
             "build_s": 1.5, "timing_cache": {"path": None, "loaded": False}, "parity": check}
    write_manifest(plan, engine_sidecar(read_manifest(out / "tiny.onnx"), built))
    engine = read_manifest(plan)
    assert (engine.format, engine.file, engine.file_sha256, engine.source_onnx) == (
        "tensorrt", "model_sm90.plan", _sha(plan), "tiny.onnx")
    assert engine.precision == "fp16" and engine.tensorrt.precision == "fp16" and engine.tensorrt.parity.ok
    assert engine.parity == m.parity  # the graph's own check stays
    info, twin = read_export(plan, None, "tensorrt", "engine")
    assert twin == out / "tiny_explain.onnx"
    assert (info.resolution, info.patch_size, info.num_classes, info.labels, info.preprocess, info.rollout) == contract
    assert (info.backend, info.device, info.precision) == ("tensorrt", "cuda", "fp16")
    assert report_engine_parity(check, plan.name, print) is True
    assert "parity: model_sm90.plan (TensorRT fp16 vs onnxruntime CPU" in capsys.readouterr().out

    # The Triton repository: every config's "vit_serve" parameter, read as Triton serves the config.
    repo = exported["repo"]
    for model in ("tiny_onnx", "tiny_py", "tiny_explain_onnx", "tiny_preprocess", "tiny_ensemble"):
        meta = TritonMeta.from_config(_config_json(repo / model / "config.pbtxt"), model)
        assert meta.schema_version == 2 and meta.preprocess == m.preprocess and meta.rollout == ex.rollout
        assert (meta.sidecar_sha256, meta.explain_sidecar_sha256, meta.onnx_sha256) == (
            _sha(manifest_path(exported["onnx"])), _sha(manifest_path(exported["explain"])), m.file_sha256)
        assert meta.labels == m.labels and meta.source_checkpoint_sha256 == m.source_checkpoint.sha256
    for model, runtime in (("tiny_onnx", "onnxruntime"), ("tiny_py", "python")):
        cfg = _config_json(repo / model / "config.pbtxt")
        info = triton.model_info(model, cfg, "test")
        assert (info.resolution, info.patch_size, info.num_classes, info.labels, info.preprocess,
                info.rollout) == contract
        assert (info.backend, info.device, info.runtime, info.max_batch_size) == ("triton", "remote", runtime, 16)
        assert info.explain_model == model.replace("tiny_", "tiny_explain_")
        assert read_manifest(repo / model / "1" / "sidecar.json") == m  # the copy in the version folder
    with pytest.raises(ValueError, match="'tiny_preprocess' is not a logits model"):
        triton.model_info("tiny_preprocess", _config_json(repo / "tiny_preprocess" / "config.pbtxt"), "test")


def _old_view(info, extra: list[str]) -> dict:
    """A ModelInfo in the layout expected_model_info.json recorded (the old `extra` keys are typed fields now)."""
    return {
        "name": info.name, "resolution": list(info.resolution), "patch_size": info.patch_size,
        "num_classes": info.num_classes, "labels": info.labels, "preprocess": info.preprocess.to_dict(),
        "explain": info.explain,
        "rollout": None if info.rollout is None else {"head_fusion": info.rollout.head_fusion,
                                                      "discard_ratio": info.rollout.discard_ratio},
        "extra": {k: getattr(info, k) for k in extra},
    }


def _without_source(expected: dict) -> dict:
    return {k: v for k, v in expected.items() if k != "source"}


@pytest.mark.parametrize("export", ["tiny.onnx", "tiny_dyn.onnx", "tiny_int8.onnx", "tiny_tensorrt/model_sm90.plan"])
def test_schema_1_manifests_load_into_the_same_model_info(export, tmp_path):
    from vit_serve.runtime.backends.sidecar import read_export

    expected = json.loads((V1 / "expected_model_info.json").read_text())[export]
    # The exports' layout with the recorded manifests; the readers read manifests only, not the graphs.
    for name in ("tiny", "tiny_explain", "tiny_dyn", "tiny_dyn_explain", "tiny_int8", "tiny_int8_explain"):
        shutil.copy(V1 / f"{name}.json", tmp_path / f"{name}.json")
        (tmp_path / f"{name}.onnx").write_bytes(b"graph")
    (tmp_path / "tiny_tensorrt").mkdir()
    shutil.copy(V1 / "model_sm90.json", tmp_path / "tiny_tensorrt" / "model_sm90.json")
    (tmp_path / "tiny_tensorrt" / "model_sm90.plan").write_bytes(b"engine")

    path = tmp_path / export
    backend = "tensorrt" if export.endswith(".plan") else "onnxruntime"
    info, twin = read_export(path, None, backend, "engine" if backend == "tensorrt" else "graph")
    assert _old_view(info, list(expected["extra"])) == _without_source(expected)
    assert twin is not None and twin.name.endswith("_explain.onnx")
    # Every field read back as written: the manifest's JSON is the file's, with the version key of schema 2.
    raw = json.loads(manifest_path(path).read_text())
    m = read_manifest(path)
    assert m.schema_version == 1 and raw.pop("sidecar_version") == 1
    assert m.to_dict() == {"manifest_version": 2, **raw}


@pytest.mark.parametrize("model", ["tiny_onnx", "tiny_py"])
def test_schema_1_triton_configs_load_into_the_same_model_info(model):
    from vit_serve.runtime.backends import triton

    expected = json.loads((V1 / "expected_model_info.json").read_text())[f"{model}.config.pbtxt"]
    cfg = _config_json(V1 / f"{model}.config.pbtxt")
    info = triton.model_info(model, cfg, "test")
    assert _old_view(info, list(expected["extra"])) == _without_source(expected)
    meta = TritonMeta.from_config(cfg, model)
    assert meta.schema_version == 1 and meta.rollout.pool == "token"  # schema 1 kept pool beside the settings


def _valid() -> dict:
    return json.loads((V1 / "tiny_explain.json").read_text())


def _set(d: dict, dotted: str, value) -> dict:
    *parents, last = dotted.split(".")
    for p in parents:
        d = d[p]
    if value is _DELETE:
        del d[last]
    else:
        d[last] = value
    return d


_DELETE = object()


@pytest.mark.parametrize("field,value,message", [
    ("architecture", _DELETE, "missing field 'architecture'"),
    ("architecture.patch_size", _DELETE, "missing field 'architecture.patch_size'"),
    ("sidecar_version", 7, "unknown manifest version 7"),
    ("sidecar_version", _DELETE, "missing field 'manifest_version': not a vit-export manifest"),
    ("resolution", "big", "field 'resolution' must be [H, W] (positive integers) or \"dynamic\""),
    ("resolution", [32, 0], "field 'resolution' must be"),
    ("architecture.patch_size", "16", "field 'architecture.patch_size' must be an integer"),
    ("explain", 1, "field 'explain' must be true or false"),
    ("labels", [1, 2], "field 'labels' must be a list of strings"),
    ("rollout.discard_ratio", 1.5, "field 'rollout': discard_ratio must be in [0, 1)"),
    ("rollout.head_fusion", "median", "field 'rollout.head_fusion' must be one of mean, max, min"),
    ("rollout", _DELETE, "missing field 'rollout' (an explain graph"),
    ("preprocess.crop_pct", 2, "field 'preprocess': crop_pct must be a number in (0, 1]"),
    ("io.outputs", {"name": "logits"}, "field 'io.outputs' must be a list of tensors"),
    ("parity.ok", "yes", "field 'parity.ok' must be true or false"),
    ("format", "tflite", "field 'format' must be one of onnx, tensorrt"),
    ("token_merging", {"r": [4, -1]}, "field 'token_merging.r' must be a list of whole numbers >= 0 (one per layer)"),
    ("token_merging", {"r": [4], "prop_attn": "yes"}, "field 'token_merging.prop_attn' must be true or false"),
    ("token_merging", [4], "field 'token_merging' must be a JSON object"),
])
def test_bad_manifests_name_the_file_and_the_field(tmp_path, field, value, message):
    from vit_serve.runtime.backends.sidecar import read_export

    data = _valid()
    _set(data, field, value)
    graph = tmp_path / "m.onnx"
    graph.write_bytes(b"graph")
    manifest_path(graph).write_text(json.dumps(data))
    with pytest.raises(ValueError) as e:
        read_manifest(graph)
    assert str(manifest_path(graph)) in str(e.value) and message in str(e.value), str(e.value)
    (tmp_path / "m_explain.onnx").write_bytes(b"graph")  # the same message through the gateway's reader
    shutil.copy(manifest_path(graph), tmp_path / "m_explain.json")
    with pytest.raises(ValueError, match=re.escape(message)):
        read_export(graph, None, "onnxruntime", "graph")


def test_token_merging_round_trips_and_old_files_have_none():
    """`vit-export --tome` writes "token_merging"; files from before it read as graphs without merging."""
    from vit_serve.manifest import ExportManifest, TokenMergingRecord

    old = ExportManifest.from_dict(_valid(), "v1")
    assert old.token_merging is None and "token_merging" not in old.to_dict()
    tm = TokenMergingRecord((13, 13, 8), True, 13)
    new = dataclasses.replace(old, token_merging=tm)
    assert new.to_dict()["token_merging"] == {"r": [13, 13, 8], "prop_attn": True, "min_grid": 13}
    assert ExportManifest.from_dict(json.loads(json.dumps(new.to_dict())), "v2").token_merging == tm


def test_unreadable_and_missing_manifests(tmp_path):
    graph = tmp_path / "m.onnx"
    graph.write_bytes(b"graph")
    with pytest.raises(FileNotFoundError, match=r"m\.onnx has no sidecar m\.json beside it"):
        read_manifest(graph)
    for text, message in (("{", "is not valid JSON"), ("[1, 2]", "the manifest must be a JSON object, got a list"),
                          ('{"manifest_version": 2, "file": "m.onnx", "extra": 1}', "unknown field(s) 'extra'")):
        manifest_path(graph).write_text(text)
        with pytest.raises(ValueError, match=re.escape(message)) as e:
            read_manifest(graph)
        assert str(manifest_path(graph)) in str(e.value)


def test_bad_triton_metadata_names_the_model_and_the_field():
    cfg = _config_json(V1 / "tiny_onnx.config.pbtxt")
    with pytest.raises(ValueError, match="'tiny_onnx' has no valid 'vit_serve' parameter"):
        TritonMeta.from_config({"parameters": {}}, "tiny_onnx")
    meta = json.loads(cfg["parameters"]["vit_serve"]["string_value"])
    for key, value, message in (("manifest_version", 9, "unknown manifest version 9"),
                                ("patch_size", None, "field 'patch_size' must be an integer"),
                                ("kind", "weights", "field 'kind' must be one of logits")):
        bad = {**meta, key: value}
        cfg["parameters"]["vit_serve"]["string_value"] = json.dumps(bad)
        with pytest.raises(ValueError, match=re.escape(message)) as e:
            TritonMeta.from_config(cfg, "tiny_onnx")
        assert "Triton model 'tiny_onnx'" in str(e.value)


def test_model_info_rollout_settings_use_the_one_default():
    from vit_serve.preprocess import PreprocessConfig
    from vit_serve.runtime.backends.base import ModelInfo

    info = ModelInfo("m", (32, 32), 16, 2, None, PreprocessConfig(input_size=(32, 32)))
    assert info.rollout_settings() == (DEFAULT_HEAD_FUSION, DEFAULT_DISCARD_RATIO) == ("mean", 0.9)
    fixed = dataclasses.replace(info, rollout=RolloutSettings("max", 0.5))
    assert fixed.rollout_settings() == ("max", 0.5) and fixed.rollout_mismatch() is None
    assert "head_fusion=max and discard_ratio=0.5 only" in fixed.rollout_mismatch("mean", 0.5)
    assert np.isclose(fixed.rollout_settings(discard_ratio=0.25)[1], 0.25)


def test_the_string_keyed_copies_are_gone():
    """Nobody reads the contract with string keys and copied defaults any more: those go through the manifest."""
    patterns = [r'"discard_ratio",\s*0\.9', r'"head_fusion",\s*"mean"', r"\.extra\[", r"\bextra=\{",
                r'\["vit_serve"\]\["string_value"\]', r'\bside\[|\bside\.get\(',
                r'\bmeta\[|\bmeta\.get\(|\brollout\[']
    readers = ("vit_serve/serve", "export")  # checkpoint and dataset metadata are other dicts
    hits = []
    for folder in readers:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "manifest.py":
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                hits += [f"{path.relative_to(ROOT)}:{i}: {line.strip()}" for p in patterns if re.search(p, line)]
    assert hits == []
