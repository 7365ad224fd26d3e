"""torchvision VisionTransformer state dicts -> ours.

Reference: `torchvision.models.vit_b_16(weights=None)` and a small custom
`torchvision.models.vision_transformer.VisionTransformer` with `representation_size`, randomised (never
downloaded); other resolutions against torchvision's own `interpolate_embeddings`.
"""

from __future__ import annotations

import math

import pytest
import torch

torchvision = pytest.importorskip("torchvision")

from torchvision.models.vision_transformer import VisionTransformer as TVViT  # noqa: E402
from torchvision.models.vision_transformer import interpolate_embeddings  # noqa: E402

from vit_serve.checkpoints.converted import CheckpointError, build_model  # noqa: E402
from vit_serve.checkpoints.io import read_weights  # noqa: E402
from vit_serve.checkpoints.torchvision_state import (  # noqa: E402
    convert_torchvision,
    is_torchvision_layout,
    torchvision_preprocess,
)


def _small(image_size: int = 64) -> TVViT:
    return TVViT(
        image_size=image_size,
        patch_size=16,
        num_layers=2,
        num_heads=3,
        hidden_dim=192,
        mlp_dim=768,
        num_classes=10,
        representation_size=96,
    )


@pytest.fixture(scope="module")
def vit_b_16(randomize) -> torch.nn.Module:
    return randomize(torchvision.models.vit_b_16(weights=None), seed=0, head_std=0.1)


@pytest.fixture(scope="module")
def small(randomize) -> torch.nn.Module:
    return randomize(_small(), seed=1)


def test_layout_sniffer(small):
    sd = small.state_dict()
    assert is_torchvision_layout(sd)
    assert is_torchvision_layout({f"module.{k}": v for k, v in sd.items()})
    assert not is_torchvision_layout({"patch_embed.proj.weight": 0, "pos_embed": 0, "cls_token": 0})


def test_vit_b_16_parity(vit_b_16):
    conv = convert_torchvision(vit_b_16.state_dict())
    cfg = conv.config
    assert (cfg.embed_dim, cfg.depth, cfg.num_heads, cfg.mlp_dim, cfg.patch_size) == (768, 12, 12, 3072, 16)
    assert cfg.img_size == (224, 224) and cfg.num_classes == 1000 and cfg.representation_size is None
    assert (cfg.layer_norm_eps, cfg.gelu, cfg.resample_mode) == (1e-6, "exact", "torchvision")
    assert conv.labels is not None and conv.labels[0] == "tench"  # ImageNet names via Converted
    assert "vit_b_16" in conv.source
    assert all(v.dtype == torch.float32 for v in conv.state_dict.values())
    p = conv.preprocess  # ViT_B_16_Weights.IMAGENET1K_V1: Resize(256) bilinear, CenterCrop(224), ImageNet
    assert (p.input_size, p.interpolation, p.crop_mode) == ((224, 224), "bilinear", "center")
    assert p.crop_pct == 224 / 256 and math.floor(224 / p.crop_pct) == 256
    assert (p.mean, p.std) == ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))

    ours = build_model(conv)
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = vit_b_16(x)
        fused = ours(x)
        explicit = ours(x, return_attention=True)[0]
    err_fused, err_explicit = (fused - want).abs().max().item(), (explicit - want).abs().max().item()
    print(
        f"torchvision vit_b_16 224: |logits| max {want.abs().max():.2f}, "
        f"max |diff| fused {err_fused:.2e}, explicit {err_explicit:.2e}"
    )
    assert want.abs().max() > 1.0
    assert err_fused <= 1e-5 and err_explicit <= 1e-5


def test_arch_name_checked(vit_b_16):
    sd = vit_b_16.state_dict()
    assert convert_torchvision(sd, arch="vit_b_16").config.num_heads == 12
    assert convert_torchvision(sd, arch="B/16").config.num_heads == 12  # preset names work too
    with pytest.raises(CheckpointError, match="vit_l_16"):
        convert_torchvision(sd, arch="vit_l_16")
    with pytest.raises(CheckpointError, match="unknown architecture"):
        convert_torchvision(sd, arch="vit_q_99")


def test_pre_logits_parity(small):
    conv = convert_torchvision(small.state_dict())
    assert conv.config.representation_size == 96 and conv.config.num_classes == 10
    assert conv.labels is None
    assert "pre_logits.0.weight" in conv.state_dict
    ours = build_model(conv)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = small(x)
        errs = [
            (ours(x) - want).abs().max().item(),
            (ours(x, return_attention=True)[0] - want).abs().max().item(),
        ]
    print(f"torchvision custom ViT with pre_logits: max |diff| fused {errs[0]:.2e}, explicit {errs[1]:.2e}")
    assert max(errs) <= 1e-5


def test_old_mlp_names_convert_identically(small):
    sd = small.state_dict()
    old = {
        k.replace(".mlp.0.", ".mlp.linear_1.").replace(".mlp.3.", ".mlp.linear_2."): v for k, v in sd.items()
    }
    assert any(".mlp.linear_1." in k for k in old)
    a, b = convert_torchvision(sd).state_dict, convert_torchvision(old).state_dict
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_module_prefix_and_half_precision(small):
    sd = {f"module.{k}": v.half() for k, v in small.state_dict().items()}
    conv = convert_torchvision(sd)
    assert all(v.dtype == torch.float32 for v in conv.state_dict.values())
    ref = convert_torchvision(small.state_dict()).state_dict
    assert all(torch.equal(conv.state_dict[k], ref[k].half().float()) for k in ref)


@pytest.mark.parametrize("new_size", [96, 48])
def test_other_resolution_matches_interpolate_embeddings(small, new_size):
    ours = build_model(convert_torchvision(small.state_dict()))  # stays at 64; resamples on the fly
    ref = _small(new_size).eval()
    ref.load_state_dict(interpolate_embeddings(new_size, 16, dict(small.state_dict())))
    x = torch.randn(2, 3, new_size, new_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        err = (ours(x) - ref(x)).abs().max().item()
    print(f"torchvision interpolate_embeddings 64 -> {new_size}: max |diff| {err:.2e}")
    assert err <= 1e-4


def test_img_size_override_resamples(small):
    conv = convert_torchvision(small.state_dict(), img_size=(96, 96))
    ref = _small(96).eval()
    ref.load_state_dict(interpolate_embeddings(96, 16, dict(small.state_dict())))
    torch.testing.assert_close(
        conv.state_dict["pos_embed"], ref.encoder.pos_embedding.detach(), rtol=0, atol=1e-5
    )
    assert conv.preprocess.input_size == (96, 96)


def test_preprocess_table():
    p = torchvision_preprocess("vit_l_16", 224)  # ViT_L_16_Weights.IMAGENET1K_V1: Resize(242)
    assert math.floor(224 / p.crop_pct) == 242 and p.interpolation == "bilinear"
    p = torchvision_preprocess("vit_h_14", 518)  # SWAG E2E: Resize(518) bicubic, no crop margin
    assert (p.crop_pct, p.interpolation, p.input_size) == (1.0, "bicubic", (518, 518))
    p = torchvision_preprocess("vit_b_16", 224, "IMAGENET1K_SWAG_LINEAR_V1")
    assert (p.crop_pct, p.interpolation) == (1.0, "bicubic")
    with pytest.raises(CheckpointError, match="384x384"):
        torchvision_preprocess("vit_b_16", 224, "IMAGENET1K_SWAG_E2E_V1")


# -- bad input ------------------------------------------------------------------------------------------


def test_missing_key_is_named(small):
    sd = dict(small.state_dict())
    del sd["encoder.layers.encoder_layer_1.ln_2.weight"]
    with pytest.raises(
        CheckpointError, match=r"missing keys: encoder\.layers\.encoder_layer_1\.ln_2\.weight"
    ):
        convert_torchvision(sd)


def test_unexpected_key_is_named(small):
    sd = dict(small.state_dict()) | {"encoder.extra_token": torch.zeros(1, 1, 192)}
    with pytest.raises(CheckpointError, match=r"unexpected keys: encoder\.extra_token"):
        convert_torchvision(sd)


def test_not_torchvision(small):
    with pytest.raises(CheckpointError, match=r"missing keys: conv_proj\.weight"):
        convert_torchvision({"patch_embed.proj.weight": torch.zeros(192, 3, 16, 16)})


def test_unknown_width_needs_heads(randomize):
    m = randomize(
        TVViT(
            image_size=32,
            patch_size=16,
            num_layers=1,
            num_heads=5,
            hidden_dim=160,
            mlp_dim=320,
            num_classes=4,
        ),
        seed=5,
    )
    with pytest.raises(CheckpointError, match="number of attention heads"):
        convert_torchvision(m.state_dict())
    ours = build_model(convert_torchvision(m.state_dict(), num_heads=5))
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert (ours(x) - m(x)).abs().max().item() <= 1e-5


def test_truncated_pth(small, tmp_path):
    path = tmp_path / "vit.pth"
    torch.save(small.state_dict(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as info:
        read_weights(path)
    assert "\n" not in str(info.value)
