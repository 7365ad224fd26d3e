"""Our .safetensors format, safe reading of foreign files, format detection and its errors."""

import json
import os

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import vit_serve
from vit_serve.checkpoints import KNOWN_FORMATS, CheckpointError, read_checkpoint
from vit_serve.checkpoints.io import atomic_write, read_weights
from vit_serve.preprocess import PreprocessConfig


def _model(**kw):
    model = vit_serve.create_model("Ti/16", depth=2, num_classes=3, img_size=64, **kw).eval()
    with torch.no_grad():
        model.head.weight.normal_(0, 0.2)
    return model


def test_round_trip_keeps_weights_config_labels_and_contract(tmp_path):
    model = _model(gelu="tanh", layer_norm_eps=1e-12, resample_mode="jax")
    model.labels = ["cat", "dog", "fox"]
    model.preprocess_cfg = PreprocessConfig(input_size=(64, 64), crop_pct=0.875, interpolation="bilinear")
    path = vit_serve.save(model, tmp_path / "m.safetensors")
    loaded = vit_serve.load(path)
    assert loaded.cfg == model.cfg and loaded.labels == model.labels
    assert loaded.preprocess_cfg == model.preprocess_cfg
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == "vit-serve" and json.loads(meta["config"])["gelu"] == "tanh"
    assert not loaded.training


def test_save_never_overwrites_silently(tmp_path):
    path = tmp_path / "m.safetensors"
    vit_serve.save(_model(), path)
    before = path.read_bytes()
    with pytest.raises(FileExistsError, match="exists; pass overwrite=True"):
        vit_serve.save(_model(), path)
    assert path.read_bytes() == before
    vit_serve.save(_model(num_heads=3), path, overwrite=True)


def test_atomic_write_leaves_old_file_intact_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "m.bin"
    path.write_bytes(b"old")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, b"new", overwrite=True)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["m.bin"]  # no temp file left behind


def test_default_contract_follows_model_size(tmp_path):
    model = _model()
    model.set_resolution(96, 128)
    loaded = vit_serve.load(vit_serve.save(model, tmp_path / "m.safetensors"))
    assert loaded.cfg.img_size == (96, 128) and loaded.preprocess_cfg.input_size == (96, 128)


@pytest.mark.parametrize("suffix", [".safetensors", ".npz", ".pth"])
def test_truncated_files_give_one_line_errors(tmp_path, suffix):
    path = tmp_path / f"w{suffix}"
    sd = {"patch_embed.proj.weight": torch.randn(8, 3, 4, 4)}
    if suffix == ".safetensors":
        save_file(sd, path)
    elif suffix == ".npz":
        np.savez(path, **{k: v.numpy() for k, v in sd.items()})
    else:
        torch.save(sd, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"cannot read .*w\{suffix}: ") as e:
        read_weights(path)
    assert "\n" not in str(e.value)


def test_pickled_objects_are_refused(tmp_path):
    path = tmp_path / "evil.pth"
    torch.save({"weights": torch.zeros(1), "cfg": object()}, path)
    with pytest.raises(CheckpointError, match="not a readable PyTorch weights file"):
        read_weights(path)


def test_unknown_format_lists_known_formats(tmp_path):
    path = tmp_path / "other.safetensors"
    save_file({"encoder.weight": torch.zeros(2, 2)}, path)
    with pytest.raises(CheckpointError, match="unknown checkpoint format") as e:
        read_checkpoint(path)
    for fmt in KNOWN_FORMATS:
        assert fmt in str(e.value)
    (tmp_path / "x.onnx").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"unknown file type '\.onnx'"):
        read_checkpoint(tmp_path / "x.onnx")


def test_missing_file():
    with pytest.raises(CheckpointError, match=r"no such file: /nonexistent/m\.safetensors"):
        read_checkpoint("/nonexistent/m.safetensors")


def test_missing_unexpected_and_misshaped_keys_are_listed(tmp_path):
    sd = _model().state_dict()
    sd.pop("blocks.1.mlp.fc2.bias")
    sd["blocks.0.extra.weight"] = torch.zeros(1)
    sd["head.weight"] = torch.zeros(4, 192)
    path = tmp_path / "broken.pth"
    torch.save(sd, path)
    with pytest.raises(CheckpointError) as e:
        vit_serve.load(path, arch="vit_tiny_patch16_224")
    msg = str(e.value)
    assert "missing keys: blocks.1.mlp.fc2.bias" in msg
    assert "unexpected keys: blocks.0.extra.weight" in msg
    # The head's size is read from head.weight, so the 3-entry bias is the mis-shaped one.
    assert "mis-shaped keys: head.bias (3,) != model (4,)" in msg


def test_bad_metadata_version(tmp_path):
    model = _model()
    path = vit_serve.save(model, tmp_path / "m.safetensors")
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, path, metadata={"format": "vit-serve", "format_version": "99"})
    with pytest.raises(CheckpointError, match="format version '99' is not supported"):
        vit_serve.load(path)


def test_hub_ids_are_recognised_and_offline_fails_cleanly(monkeypatch, tmp_path):
    from vit_serve.checkpoints.hub import parse_hub_id

    assert parse_hub_id("hf-hub:timm/vit_base_patch16_224.augreg2_in21k_ft_in1k") == \
        "timm/vit_base_patch16_224.augreg2_in21k_ft_in1k"
    assert parse_hub_id("hf-hub:google/vit-base-patch16-384") == "google/vit-base-patch16-384"
    assert parse_hub_id("runs/best") is None  # a local path, missing or not: hub ids need hf-hub:
    assert parse_hub_id("runs/model.safetensors") is None
    assert parse_hub_id(str(tmp_path)) is None
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(CheckpointError, match="cannot fetch 'google/vit-base-patch16-224' from the model hub"):
        read_checkpoint("hf-hub:google/vit-base-patch16-224")
