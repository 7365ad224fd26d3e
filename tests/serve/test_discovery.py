"""Reading a model repository (`vit_serve.runtime.discovery`): layouts, version policies with Triton's semantics,
and a model's config.pbtxt read with Triton's own schema (tritonclient's model_config_pb2, written here with
protobuf's text_format, as Triton's tools write it)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from vit_serve.runtime.discovery import VersionPolicy, scan
from vit_serve.runtime.model_config import ModelConfig


def _touch(path: Path, data: bytes = b"x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _triton_config(folder: Path, **fields) -> None:
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = model_config_pb2.ModelConfig(name=folder.name, **fields)
    (folder / "config.pbtxt").write_text(text_format.MessageToString(config))


@pytest.mark.parametrize(("text", "available", "want"), [
    ("latest", [1, 2, 3], [3]),
    ("latest:2", [3, 1, 2], [2, 3]),
    ("latest:5", [1, 2], [1, 2]),
    ("all", [2, 1, 7], [1, 2, 7]),
    ("specific:1,3", [1, 2, 3], [1, 3]),
    ("specific:4", [1, 2, 3], []),
])
def test_version_policies_select_as_triton_does(text, available, want):
    assert VersionPolicy.parse(text).select(available) == want


@pytest.mark.parametrize("text", ["latest:0", "newest", "specific:", "specific:0", "all:2", "latest:x"])
def test_bad_version_policies_are_refused_with_the_forms(text):
    with pytest.raises(ValueError, match="latest, latest:N"):
        VersionPolicy.parse(text)


def test_one_file_is_a_repository_of_one_model(tmp_path, tiny_onnx):
    (entry,) = scan(tiny_onnx).values()
    assert entry.name == "tiny" and list(entry.versions) == [1]
    assert entry.versions[1].backend == "onnxruntime" and entry.versions[1].path == tiny_onnx
    (renamed,) = scan(tiny_onnx, name="other").values()
    assert renamed.name == "other"
    with pytest.raises(ValueError, match="not a model"):
        scan(_touch(tmp_path / "notes.txt"))
    with pytest.raises(FileNotFoundError):
        scan(tmp_path / "missing.onnx")


def test_a_folder_of_exports_and_checkpoints(tmp_path, tiny_onnx, tiny_ckpt):
    for f in tiny_onnx.parent.iterdir():  # tiny.onnx, tiny.json, tiny_explain.onnx, tiny_explain.json
        shutil.copy(f, tmp_path / f.name)
    shutil.copy(tiny_ckpt, tmp_path / "base.safetensors")
    _touch(tmp_path / "engine_b.plan")
    _touch(tmp_path / "README.md")
    _touch(tmp_path / ".hidden.onnx")
    entries = scan(tmp_path)
    assert sorted(entries) == ["base", "engine_b", "tiny"]  # the explain twin and the manifests are companions
    assert {n: e.versions[1].backend for n, e in entries.items()} == {
        "base": "torch", "engine_b": "tensorrt", "tiny": "onnxruntime"}


def test_triton_style_versions_policy_and_limits(tmp_path, tiny_ckpt):
    model = tmp_path / "vit"
    for v in (1, 2, 3):
        shutil.copy(tiny_ckpt, _touch(model / str(v) / "w.safetensors"))
    _touch(model / "0" / "w.safetensors")  # not a version: Triton's versions start at 1
    _touch(model / "notes" / "w.safetensors")
    from tritonclient.grpc import model_config_pb2 as pb

    _triton_config(model, max_batch_size=8,
                   version_policy=pb.ModelVersionPolicy(specific=pb.ModelVersionPolicy.Specific(versions=[1, 3])),
                   dynamic_batching=pb.ModelDynamicBatching(max_queue_delay_microseconds=2500,
                                                            default_queue_policy=pb.ModelQueuePolicy(
                                                                max_queue_size=32)))
    (entry,) = scan(tmp_path).values()
    assert sorted(entry.versions) == [1, 2, 3]
    assert entry.policy == VersionPolicy("specific", versions=(1, 3))
    assert entry.policy.select(list(entry.versions)) == [1, 3]
    assert entry.config == ModelConfig(max_batch=8, max_delay_ms=2.5, max_queue=32)


def test_instance_group_counts_are_the_models_instances(tmp_path, tiny_ckpt):
    """Triton's instance_group: the groups' counts summed (a group without a count has one instance), none
    without a group (the gateway's setting then applies)."""
    from tritonclient.grpc import model_config_pb2 as pb

    from vit_serve.runtime.settings import RunnerLimits

    kind = pb.ModelInstanceGroup.Kind
    for name, groups in (("two", [pb.ModelInstanceGroup(count=2, kind=kind.KIND_CPU)]),
                         ("three", [pb.ModelInstanceGroup(count=2, kind=kind.KIND_CPU),
                                    pb.ModelInstanceGroup(kind=kind.KIND_CPU)]),
                         ("none", [])):
        shutil.copy(tiny_ckpt, _touch(tmp_path / name / "1" / "w.safetensors"))
        _triton_config(tmp_path / name, max_batch_size=4, instance_group=groups)
    entries = scan(tmp_path)
    for name, want in (("two", 2), ("three", 3), ("none", None)):
        assert entries[name].config.instances == want, name
    assert entries["two"].config.over(RunnerLimits(instances=1)).instances == 2
    assert entries["none"].config.over(RunnerLimits(instances=3)).instances == 3


def test_triton_latest_and_all_policies_from_config(tmp_path, tiny_ckpt):
    from tritonclient.grpc import model_config_pb2 as pb

    for name, policy, want in (("a", pb.ModelVersionPolicy(latest=pb.ModelVersionPolicy.Latest(num_versions=2)),
                                VersionPolicy("latest", 2)),
                               ("b", pb.ModelVersionPolicy(all=pb.ModelVersionPolicy.All()), VersionPolicy("all"))):
        shutil.copy(tiny_ckpt, _touch(tmp_path / name / "1" / "w.safetensors"))
        _triton_config(tmp_path / name, version_policy=policy)
        assert scan(tmp_path)[name].policy == want


def test_unusable_versions_and_names_are_reported_not_served(tmp_path, tiny_ckpt):
    shutil.copy(tiny_ckpt, _touch(tmp_path / "two" / "1" / "a.safetensors"))
    shutil.copy(tiny_ckpt, tmp_path / "two" / "1" / "b.safetensors")
    shutil.copy(tiny_ckpt, _touch(tmp_path / "two" / "2" / "a.safetensors"))
    _touch(tmp_path / "ens" / "1" / "model.py")  # a Triton Python-backend model: Triton's, not ours
    _touch(tmp_path / "ens" / "config.pbtxt", b'name: "ens"\nbackend: "python"\n')
    shutil.copy(tiny_ckpt, _touch(tmp_path / "dup" / "1" / "w.safetensors"))
    shutil.copy(tiny_ckpt, tmp_path / "dup.safetensors")
    _touch(tmp_path / "badcfg" / "1" / "w.safetensors")
    _touch(tmp_path / "badcfg" / "config.pbtxt", b"max_batch_size: {{{")
    entries = scan(tmp_path)
    assert entries["ens"].skipped == "python" and not entries["ens"].versions  # listed, never loaded
    assert "a Triton Python-backend model: serve it with tritonserver" in entries["ens"].error
    assert list(entries["two"].versions) == [2] and "holds 2 models" in entries["two"].broken[1]
    assert "both claim the model name 'dup'" in entries["dup"].error
    assert "not a readable Triton model configuration" in entries["badcfg"].error


def test_fingerprint_changes_when_a_version_is_rewritten(tmp_path, tiny_ckpt):
    path = _touch(tmp_path / "m" / "1" / "w.safetensors", tiny_ckpt.read_bytes())
    before = scan(tmp_path)["m"].versions[1].fingerprint
    assert scan(tmp_path)["m"].versions[1].fingerprint == before  # a poll that sees nothing new
    path.write_bytes(tiny_ckpt.read_bytes() + b"\0")
    assert scan(tmp_path)["m"].versions[1].fingerprint != before
