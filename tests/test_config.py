import pytest
import torch

from vit_serve.config import SIZES, ViTConfig, get_config, preset_names
from vit_serve.model import VisionTransformer

# Parameter counts of timm's models of the same name with a 1000-way head (paper Table 1: B 86M, L 307M, H 632M).
TIMM_PARAMS = {
    "vit_tiny_patch16_224": 5_717_416,
    "vit_small_patch16_224": 22_050_664,
    "vit_base_patch16_224": 86_567_656,
    "vit_base_patch32_224": 88_224_232,
    "vit_large_patch16_224": 304_326_632,
    "vit_huge_patch14_224": 632_045_800,
}


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_builds(name):
    cfg = get_config(name)
    with torch.device("meta"):
        model = VisionTransformer(cfg)
    assert model.pos_embed.shape == (1, cfg.num_pos_prefix_tokens + cfg.grid_size[0] * cfg.grid_size[1], cfg.embed_dim)


@pytest.mark.parametrize("name", list(TIMM_PARAMS))
def test_parameter_counts_match_timm(name):
    """Reference: timm.create_model(name) parameter counts (built on the meta device)."""
    timm = pytest.importorskip("timm")
    with torch.device("meta"):
        ref = sum(p.numel() for p in timm.create_model(name, pretrained=False, num_classes=1000).parameters())
        ours = sum(p.numel() for p in VisionTransformer(get_config(name)).parameters())
    assert ours == ref == TIMM_PARAMS[name]


def test_paper_and_timm_names_agree():
    for size, timm_size in [("Ti", "tiny"), ("S", "small"), ("B", "base"), ("L", "large"), ("H", "huge")]:
        for patch in (8, 14, 16, 32):
            assert get_config(f"{size}/{patch}") == get_config(f"vit_{timm_size}_patch{patch}_224")
            assert get_config(f"ViT-{size}/{patch}") == get_config(f"{size}/{patch}")
    assert get_config("R50+B/16") == get_config("vit_base_r50_s16_224")
    assert get_config("R50+ViT-B/16").resnet_layers == (3, 4, 9)
    assert get_config("vit_base_patch16_384.augreg_in21k_ft_in1k").img_size == (384, 384)
    gap = get_config("vit_base_patch16_gap_224")
    assert gap.pool == "gap" and not gap.class_token
    assert get_config("L/16").embed_dim == SIZES["L"][0] == 1024


def test_unknown_preset_lists_known_names():
    with pytest.raises(ValueError, match=r"unknown model preset 'Z/16'.*B/16.*vit_base_patch16_224"):
        get_config("Z/16")


@pytest.mark.parametrize("bad, match", [
    (dict(pool="max"), "pool='max'; expected one of token, gap"),
    (dict(gelu="relu"), "gelu='relu'"),
    (dict(resample_mode="nearest"), "resample_mode='nearest'"),
    (dict(embed_dim=100, num_heads=3), "not divisible"),
    (dict(img_size=(225, 224)), "not a positive multiple of patch_size 16"),
    (dict(class_token=False), "pool='token' needs class_token=True"),
])
def test_bad_config_values(bad, match):
    with pytest.raises(ValueError, match=match):
        ViTConfig(**bad)


def test_config_dict_round_trip():
    cfg = get_config("R50+B/16", num_classes=10, gelu="tanh", layer_norm_eps=1e-12, img_size=(384, 320))
    assert ViTConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown ViTConfig fields: bogus"):
        ViTConfig.from_dict({**cfg.to_dict(), "bogus": 1})


# One name per entry of the family tables in vit_serve/config.py (every name takes ~1 s on the meta device).
FAMILY_NAMES = ["deit_tiny_patch16_224", "deit_small_distilled_patch16_224", "deit_base_distilled_patch16_384",
                "deit3_small_patch16_224", "vit_small_patch14_dinov2", "vit_base_patch14_reg4_dinov2",
                "vit_giant_patch14_dinov2", "vit_base_patch16_clip_224", "vit_base_patch32_clip_quickgelu_224",
                "vit_large_patch14_clip_336",
                "vit_base_patch16_siglip_224", "vit_base_patch16_siglip_gap_224", "vit_so400m_patch14_siglip_384",
                "vit_base_patch32_siglip_256"]


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_family_presets_match_timm(name):
    """Reference: timm.create_model for DeiT / DINOv2 / CLIP / SigLIP names get_config knows (meta device):
    parameter count, LayerNorm eps, activation and patch grid."""
    timm = pytest.importorskip("timm")
    if name not in timm.list_models(name):
        pytest.skip(f"{name} is not in this timm release")
    cfg = get_config(name, num_classes=1000)
    with torch.device("meta"):
        ref = timm.create_model(name, pretrained=False, num_classes=1000)
        ours = VisionTransformer(cfg)
    act = ref.blocks[0].mlp.act
    gelu = "quick" if "Quick" in type(act).__name__ else \
        "tanh" if "Tanh" in type(act).__name__ or getattr(act, "approximate", "") == "tanh" else "exact"
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in ref.parameters())
    assert (cfg.gelu, cfg.layer_norm_eps, cfg.grid_size) == (gelu, ref.blocks[0].norm1.eps,
                                                             tuple(ref.patch_embed.grid_size))


@pytest.mark.parametrize("name, what", [("eva02_enormous_patch14_clip_224", "post-norm"),
                                        ("beit_base_patch16_224", "relative"),
                                        ("aimv2_large_patch14_224.apple_pt", "RMSNorm"),
                                        ("vit_7b_patch16_dinov3", "7B"),
                                        ("vit_so400m_patch16_radio_v4", "RADIO"),
                                        ("naflexvit_base_patch16_siglip", "naflex")])
def test_unsupported_architectures_name_what_is_missing(name, what):
    with pytest.raises(ValueError, match=f"not supported: .*{what}"):
        get_config(name)
