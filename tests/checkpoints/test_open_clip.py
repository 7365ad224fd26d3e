"""open_clip image towers -> our model. Reference: open_clip's own `encode_image` (random weights, tiny configs
from tests/text/tiny_clip.py), resampled the open_clip way (resize_pos_embed on a state dict loaded into a model
created at another image size); TorchScript archives refused without unpickling."""

import pickle
import re
import zipfile

import pytest
import torch
from safetensors.torch import save_file

import vit_serve
from vit_serve.checkpoints import CheckpointError, build_model, convert, convert_open_clip, read_checkpoint
from vit_serve.checkpoints.unsupported import UnsupportedCheckpoint
from vit_serve.cli import main

open_clip = pytest.importorskip("open_clip")
from tests.text import tiny_clip  # noqa: E402

X = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tiny_clip.register(tmp_path_factory.mktemp("configs"))
    return {name: tiny_clip.randomized(name) for name in ("tiny-clip", "tiny-sl-like")}


def _embedding(model, x):
    with torch.no_grad():
        return model.forward_head(model.forward_features(x), pre_logits=True)


@pytest.mark.parametrize("name, suffix", [("tiny-clip", ".safetensors"), ("tiny-clip", ".pth"),
                                          ("tiny-sl-like", ".safetensors")])
def test_encode_image_parity(models, name, suffix, tmp_path):
    ref = models[name]
    path = tmp_path / f"open_clip{suffix}"
    sd = tiny_clip.state_dict(ref)
    torch.save(sd, path) if suffix == ".pth" else save_file(sd, path)
    ours = vit_serve.load(path, arch=f"open_clip:{name}")
    with torch.no_grad():
        expected = ref.encode_image(X)
        _, emb = ours.forward_embedding(X)
    assert (_embedding(ours, X) - expected).abs().max() <= 1e-5
    assert (emb - expected).abs().max() <= 1e-5
    c = ours.cfg
    assert (c.family, c.resample_mode, c.patch_bias, c.norm_pre, c.proj_dim) == ("clip", "open_clip", False, True, 32)
    assert c.gelu == ("quick" if name == "tiny-clip" else "tanh")
    assert c.layer_norm_eps == (1e-5 if name == "tiny-clip" else 1e-6)
    assert (c.init_values is not None) == (name == "tiny-clip")
    assert ours.preprocess_cfg.mean == tiny_clip_mean()


def tiny_clip_mean():
    return (0.48145466, 0.4578275, 0.40821073)


def test_resampled_as_open_clip_does(models, tmp_path):
    """open_clip at 48 px: its resize_pos_embed on our 32 px state dict; ours: on the fly, and converted."""
    from open_clip.model import resize_pos_embed

    sd = tiny_clip.state_dict(models["tiny-clip"])
    big = open_clip.create_model("tiny-clip", pretrained=None, force_image_size=48).eval()
    resized = dict(sd)
    resize_pos_embed(resized, big)
    big.load_state_dict(resized)
    x = torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = big.encode_image(x)
    src = tmp_path / "oc.safetensors"
    save_file(sd, src)
    assert (_embedding(vit_serve.load(src, arch="open_clip:tiny-clip"), x) - expected).abs().max() <= 1e-5
    convert(src, tmp_path / "48.safetensors", res=(48, 48), arch="open_clip:tiny-clip")
    converted = vit_serve.load(tmp_path / "48.safetensors")
    assert converted.cfg.img_size == (48, 48)
    assert (_embedding(converted, x) - expected).abs().max() <= 1e-5


def test_siglip_timm_trunk(tmp_path):
    """open_clip's SigLIP configs wrap a timm trunk (visual.trunk.*): timm's own vit_base_patch32_siglip_256,
    with a tiny text tower (vision weights random; the reference is open_clip's encode_image)."""
    tiny_clip.register(tmp_path)
    cfg = {"embed_dim": 768, "init_logit_bias": -10, "custom_text": True,
           "vision_cfg": {"image_size": 256, "timm_model_name": "vit_base_patch32_siglip_256",
                          "timm_model_pretrained": False, "timm_pool": "map", "timm_proj": "none"},
           "text_cfg": {**tiny_clip.SIGLIP_TEXT}}
    import json

    (tmp_path / "tiny-siglip-trunk.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(tmp_path)
    ref = tiny_clip.randomized("tiny-siglip-trunk")
    # in memory (a ViT-B file would be 350 MB): the same converter `vit_serve.load` dispatches to
    ours = build_model(convert_open_clip(ref.state_dict(), "open_clip:tiny-siglip-trunk"))
    x = torch.randn(1, 3, 256, 256, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ref.encode_image(x)
    assert ours.cfg.family == "siglip" and ours.cfg.pool == "map"
    assert (_embedding(ours, x) - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("arch, message", [
    ("open_clip:EVA02-E-14", "EVA-02-E has post-norm blocks"),
    ("open_clip:RN50", "ModifiedResNet towers"),
    ("open_clip:convnext_base", "is not a ViT"),
    ("open_clip:ViT-H-14-CLIPA", "final_ln_after_pool"),
])
def test_refused_configs(arch, message, tmp_path, capsys):
    src = tmp_path / "w.safetensors"
    save_file({"visual.conv1.weight": torch.zeros(8, 3, 8, 8)}, src)
    with pytest.raises(UnsupportedCheckpoint, match=re.escape(message)):
        read_checkpoint(src, arch=arch)
    dst = tmp_path / "out.safetensors"
    assert main(["convert", str(src), str(dst), "--arch", arch]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and not dst.exists()


def test_open_clip_keys_need_the_arch(models, tmp_path):
    src = tmp_path / "w.safetensors"
    save_file(tiny_clip.state_dict(models["tiny-clip"]), src)
    with pytest.raises(CheckpointError, match="--arch open_clip:NAME"):
        read_checkpoint(src)


def test_torchscript_archive_refused_without_unpickling(tmp_path, capsys):
    """A real TorchScript archive, and a fake one whose pickle would write a file if it were ever loaded."""
    jit = tmp_path / "ViT-B-32.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), jit)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    fake = tmp_path / "fake.pt"
    with zipfile.ZipFile(fake, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps(Evil()))
        z.writestr("archive/constants.pkl", pickle.dumps(Evil()))
        z.writestr("archive/code/__torch__.py", "")
    for path in (jit, fake):
        with pytest.raises(UnsupportedCheckpoint, match=r"TorchScript archive.*load_openai_model"):
            read_checkpoint(path)
        dst = tmp_path / "out.safetensors"
        assert main(["convert", str(path), str(dst)]) == 2
        err = capsys.readouterr().err.strip()
        assert "TorchScript" in err and len(err.splitlines()) == 1 and not dst.exists()
    assert not marker.exists()
