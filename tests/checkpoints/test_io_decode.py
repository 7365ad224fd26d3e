"""The preprocessing contract's `decode` field through our .safetensors format (vit_serve.save / vit_serve.load),
and checkpoints written before the field existed (read back with the `safetensors` library itself)."""

import json

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import vit_serve
from vit_serve.preprocess import PreprocessConfig


def _model():
    return vit_serve.create_model("Ti/16", depth=1, num_classes=3, img_size=32).eval()


def test_decode_round_trips_through_a_checkpoint(tmp_path):
    model = _model()
    model.preprocess_cfg = PreprocessConfig(input_size=(32, 32), decode="fast")
    path = vit_serve.save(model, tmp_path / "fast.safetensors")
    with safe_open(str(path), framework="pt") as f:
        assert json.loads(f.metadata()["preprocess"])["decode"] == "fast"
    assert vit_serve.load(path).preprocess_cfg == model.preprocess_cfg


def test_a_checkpoint_without_the_field_loads_as_exact(tmp_path):
    model = _model()
    model.preprocess_cfg = PreprocessConfig(input_size=(32, 32), decode="fast")
    path = vit_serve.save(model, tmp_path / "new.safetensors")
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    pre = json.loads(meta["preprocess"])
    del pre["decode"]  # as written by releases before the field
    meta["preprocess"] = json.dumps(pre)
    old = tmp_path / "old.safetensors"
    save_file(tensors, str(old), metadata=meta)
    loaded = vit_serve.load(old)
    assert loaded.preprocess_cfg.decode == "exact"
    assert loaded.preprocess_cfg == PreprocessConfig(input_size=(32, 32))
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
