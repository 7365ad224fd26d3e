"""Hugging Face transformers ViT -> ours.

Reference: `transformers.ViTForImageClassification` / `transformers.ViTModel` (the installed library), built
from a ViTConfig with random non-trivial weights and written with `save_pretrained` — never downloaded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from vit_serve.checkpoints.converted import CheckpointError, build_model  # noqa: E402
from vit_serve.checkpoints.hf_models import convert_hf, load_hf_dir  # noqa: E402
from vit_serve.checkpoints.hf_transformers import hf_preprocess, is_hf_layout  # noqa: E402

ID2LABEL = {
    0: "tabby cat",
    1: "golden retriever",
    2: "sports car",
    3: "espresso",
    4: "lighthouse",
    5: "mountain bike",
    6: "red fox",
    7: "grand piano",
    8: "sunflower",
    9: "container ship",
}


def _hf_config(**kw) -> transformers.ViTConfig:
    args = dict(
        hidden_size=192,
        num_hidden_layers=3,
        num_attention_heads=3,
        intermediate_size=768,
        image_size=224,
        patch_size=16,
        num_labels=10,
        id2label=ID2LABEL,
        label2id={v: k for k, v in ID2LABEL.items()},
    )
    args.update(kw)
    return transformers.ViTConfig(**args)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, randomize) -> tuple[Path, torch.nn.Module]:
    model = randomize(transformers.ViTForImageClassification(_hf_config()), seed=1)
    folder = tmp_path_factory.mktemp("hf_vit")
    model.save_pretrained(folder)  # offline: config.json + model.safetensors (legacy key names)
    return folder, model


def test_layout_sniffer(hf_dir):
    folder, model = hf_dir
    assert is_hf_layout(model.state_dict())  # transformers 5 in-memory names, vit. prefix
    from safetensors.torch import load_file

    on_disk = load_file(str(folder / "model.safetensors"))
    assert is_hf_layout(on_disk)  # legacy names
    assert any(k.startswith("vit.encoder.layer.") for k in on_disk)
    assert not is_hf_layout({"patch_embed.proj.weight": 0, "pos_embed": 0})
    assert not is_hf_layout({"conv_proj.weight": 0, "class_token": 0, "encoder.pos_embedding": 0})


def test_classifier_parity_224(hf_dir):
    folder, ref = hf_dir
    conv = load_hf_dir(folder)
    assert conv.config.layer_norm_eps == 1e-12
    assert conv.config.gelu == "exact" and conv.config.resample_mode == "hf"
    assert conv.config.num_classes == 10 and conv.labels == [ID2LABEL[i] for i in range(10)]
    assert all(v.dtype == torch.float32 for v in conv.state_dict.values())
    p = conv.preprocess  # ViTImageProcessor defaults: squash-resize 224 bilinear, mean = std = 0.5
    assert (p.input_size, p.mean, p.std, p.interpolation, p.crop_pct, p.crop_mode) == (
        (224, 224),
        (0.5, 0.5, 0.5),
        (0.5, 0.5, 0.5),
        "bilinear",
        1.0,
        "squash",
    )
    ours = build_model(conv)
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(x).logits
        fused = ours(x)
        explicit = ours(x, return_attention=True)[0]
    err_fused, err_explicit = (fused - want).abs().max().item(), (explicit - want).abs().max().item()
    print(
        f"HF ViTForImageClassification 224: |logits| max {want.abs().max():.2f}, "
        f"max |diff| fused {err_fused:.2e}, explicit {err_explicit:.2e}"
    )
    assert want.abs().max() > 1.0  # non-trivial logits, so 1e-5 means something
    assert err_fused <= 1e-5 and err_explicit <= 1e-5


def test_in_memory_names_convert_identically(hf_dir):
    folder, ref = hf_dir
    from_disk = load_hf_dir(folder).state_dict
    from_memory = convert_hf(ref.config.to_dict(), ref.state_dict()).state_dict
    assert from_disk.keys() == from_memory.keys()
    assert all(torch.equal(from_disk[k], from_memory[k]) for k in from_disk)


@pytest.mark.parametrize("size", [(384, 384), (320, 256)])
def test_other_resolution_matches_interpolate_pos_encoding(hf_dir, size):
    folder, ref = hf_dir
    ours = build_model(load_hf_dir(folder))  # stays at 224; resamples on the fly with mode "hf"
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(x, interpolate_pos_encoding=True).logits
        got = ours(x)
    err = (got - want).abs().max().item()
    print(f"HF interpolate_pos_encoding at {size[0]}x{size[1]}: max |diff| {err:.2e}")
    assert err <= 1e-4


def test_img_size_override_resamples(hf_dir):
    folder, ref = hf_dir
    conv = load_hf_dir(folder, img_size=(384, 384))
    assert conv.state_dict["pos_embed"].shape == (1, 1 + 24 * 24, 192)
    assert conv.preprocess.input_size == (384, 384)
    x = torch.randn(1, 3, 384, 384, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        err = (build_model(conv)(x) - ref(x, interpolate_pos_encoding=True).logits).abs().max().item()
    assert err <= 1e-4


def test_vit_model_without_classifier(tmp_path, randomize):
    cfg = _hf_config(layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh")
    ref = randomize(transformers.ViTModel(cfg), seed=5)
    ref.save_pretrained(tmp_path)  # no "vit." prefix, includes pooler.dense.*
    conv = load_hf_dir(tmp_path)
    assert conv.config.num_classes == 0 and conv.labels is None
    assert conv.config.layer_norm_eps == 1e-6 and conv.config.gelu == "tanh"
    assert not any("pooler" in k for k in conv.state_dict)
    ours = build_model(conv)
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = ref(x).last_hidden_state
        got = ours.forward_features(x)
        pooled = ours(x)
    err = (got - want).abs().max().item()
    print(f"HF ViTModel last_hidden_state: max |diff| {err:.2e}")
    assert err <= 1e-5
    torch.testing.assert_close(pooled, want[:, 0], rtol=0, atol=1e-5)


def test_placeholder_labels_dropped():
    model = transformers.ViTForImageClassification(_hf_config(num_labels=3, id2label=None, label2id=None))
    config = model.config.to_dict()
    assert list(config["id2label"].values()) == ["LABEL_0", "LABEL_1", "LABEL_2"]
    conv = convert_hf(config, model.state_dict())
    assert conv.config.num_classes == 3 and conv.labels is None


def test_preprocessor_config_variants():
    # google/vit-base-patch16-224 style: int size, PIL resample code
    p = hf_preprocess(
        {"do_resize": True, "size": 224, "resample": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    )
    assert (p.crop_mode, p.crop_pct, p.interpolation) == ("squash", 1.0, "bilinear")
    # DeiT style: squash to 256x256, centre crop 224, bicubic, ImageNet statistics
    p = hf_preprocess(
        {
            "size": {"height": 256, "width": 256},
            "do_center_crop": True,
            "crop_size": {"height": 224, "width": 224},
            "resample": 3,
            "image_mean": [0.485, 0.456, 0.406],
            "image_std": [0.229, 0.224, 0.225],
        }
    )
    assert (p.crop_mode, p.interpolation, p.mean) == ("squash", "bicubic", (0.485, 0.456, 0.406))
    assert math.floor(224 / p.crop_pct) == 256
    # shortest-edge resize + crop -> our "center" mode
    p = hf_preprocess({"size": {"shortest_edge": 256}, "do_center_crop": True, "crop_size": 224})
    assert p.crop_mode == "center" and math.floor(224 / p.crop_pct) == 256
    # rescale factor other than 1/255 folds into mean / std; do_normalize=False -> identity statistics
    p = hf_preprocess({"do_normalize": False, "rescale_factor": 2 / 255})
    assert p.mean == (0.0, 0.0, 0.0) and p.std == pytest.approx((0.5, 0.5, 0.5))
    with pytest.raises(CheckpointError, match="image-dependent"):
        hf_preprocess({"size": {"shortest_edge": 224}})
    with pytest.raises(CheckpointError, match="do_resize"):
        hf_preprocess({"do_resize": False})


def test_preprocessor_file_is_read(hf_dir, tmp_path):
    folder, _ = hf_dir
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "ViTImageProcessor",
                "size": {"height": 224, "width": 224},
                "resample": 3,
                "image_mean": [0.485, 0.456, 0.406],
                "image_std": [0.229, 0.224, 0.225],
            }
        )
    )
    p = load_hf_dir(tmp_path).preprocess
    assert p.interpolation == "bicubic" and p.std == (0.229, 0.224, 0.225)


def test_pytorch_bin_and_sharded_folders(hf_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = hf_dir
    want = load_hf_dir(folder).state_dict
    tensors = load_file(str(folder / "model.safetensors"))
    config = (folder / "config.json").read_bytes()

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "config.json").write_bytes(config)
    torch.save(tensors, bin_dir / "pytorch_model.bin")  # read back with torch.load(weights_only=True)

    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    (shard_dir / "config.json").write_bytes(config)
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, str(shard_dir / shard))
        weight_map.update(dict.fromkeys(part, shard))
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    for d in (bin_dir, shard_dir):
        got = load_hf_dir(d).state_dict
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


# -- bad input ------------------------------------------------------------------------------------------


def test_missing_key_is_named(hf_dir):
    _, ref = hf_dir
    sd = dict(ref.state_dict())
    del sd["vit.layers.1.attention.k_proj.weight"]
    with pytest.raises(CheckpointError, match=r"missing keys: vit\.layers\.1\.attention\.k_proj\.weight"):
        convert_hf(ref.config.to_dict(), sd)


def test_unexpected_key_is_named(hf_dir):
    _, ref = hf_dir
    sd = dict(ref.state_dict())
    sd["vit.layers.7.mlp.fc1.weight"] = torch.zeros(768, 192)
    with pytest.raises(CheckpointError, match=r"unexpected keys.*vit\.layers\.7\.mlp\.fc1\.weight"):
        convert_hf(ref.config.to_dict(), sd)


def test_shape_disagreeing_with_config(hf_dir):
    _, ref = hf_dir
    cfg = ref.config.to_dict() | {"intermediate_size": 512}
    with pytest.raises(CheckpointError, match="mis-shaped"):
        convert_hf(cfg, ref.state_dict())


@pytest.mark.parametrize("act", ["relu", "quick_gelu", "silu"])
def test_unknown_hidden_act(hf_dir, act):
    _, ref = hf_dir
    with pytest.raises(CheckpointError, match=f"hidden_act='{act}'"):
        convert_hf(ref.config.to_dict() | {"hidden_act": act}, ref.state_dict())


def test_truncated_safetensors(hf_dir, tmp_path):
    folder, _ = hf_dir
    (tmp_path / "config.json").write_bytes((folder / "config.json").read_bytes())
    data = (folder / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as info:
        load_hf_dir(tmp_path)
    msg = str(info.value)
    print("truncated model.safetensors ->", msg)
    assert "\n" not in msg and "model.safetensors" in msg


def test_folder_problems(tmp_path):
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json"):
        load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        load_hf_dir(tmp_path)


def test_other_model_type_rejected(hf_dir):
    _, ref = hf_dir
    with pytest.raises(CheckpointError, match="model_type='deit'"):
        convert_hf(ref.config.to_dict() | {"model_type": "deit"}, ref.state_dict())
