"""2-D rotary tables (vit_serve.rope) against timm 1.0.31's modules (timm/layers/pos_embed_sincos.py), and the RoPE
option of ViTConfig / VisionTransformer."""

import json

import pytest
import torch

from vit_serve import rope
from vit_serve.config import RopeConfig, ViTConfig
from vit_serve.model import VisionTransformer

timm_rope = pytest.importorskip("timm.layers.pos_embed_sincos")

GRIDS = [(14, 14), (12, 9), (5, 11)]


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("kw", [
    dict(temperature=10000.0, grid_indexing="ij", ref_feat_shape=(16, 16)),  # EVA-02
    dict(temperature=10000.0, grid_indexing="xy", ref_feat_shape=(24, 24), grid_offset=1.0),  # PE
    dict(temperature=100.0, grid_indexing="xy"),  # RoPE-ViT axial
], ids=["eva02", "pe", "ropevit"])
def test_axial_table_equals_timm_rotary_embedding_cat(grid, kw):
    ref = timm_rope.RotaryEmbeddingCat(dim=32, in_pixels=False, **kw).get_embed(grid)
    ours = rope.axial_table(*grid, 32, kw["temperature"], kw.get("grid_offset", 0.0), kw["grid_indexing"],
                            kw.get("ref_feat_shape"))
    assert ours.shape == ref.shape == (grid[0] * grid[1], 64)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("grid", GRIDS)
def test_dinov3_table_equals_timm(grid):
    ref = timm_rope.RotaryEmbeddingDinoV3(dim=32, temperature=100, rotate_half=True).get_embed(grid)
    assert torch.equal(rope.dinov3_table(*grid, 32, 100.0), ref)


@pytest.mark.parametrize("grid", GRIDS)
def test_mixed_table_equals_timm_from_its_learned_frequencies(grid):
    m = timm_rope.RotaryEmbeddingMixed(dim=128, depth=3, num_heads=4, temperature=10.0, grid_indexing="xy")
    ref = m.get_embed(grid)
    ours = rope.mixed_table(*grid, m.freqs.detach(), "xy")
    assert ours.shape == ref.shape == (3, 4, grid[0] * grid[1], 64)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("half", [False, True])
def test_rotation_equals_timm_apply_rot_embed_cat(half):
    x = torch.randn(2, 3, 20, 32, generator=torch.Generator().manual_seed(0))
    table = rope.axial_table(4, 5, 32, 100.0, rotate_half=half)
    assert torch.allclose(rope.rotate(x, table, half), timm_rope.apply_rot_embed_cat(x, table, half=half), atol=1e-6)
    # Prefix tokens are not rotated; a rotation keeps each pair's norm.
    y = rope.rotate_patches(torch.cat([x[:, :, :1], x], dim=2), table, 1, half)
    assert torch.equal(y[:, :, :1], x[:, :, :1])
    assert torch.allclose(y[:, :, 1:].norm(dim=-1), x.norm(dim=-1), atol=1e-5)


def test_rope_config_round_trips_through_json():
    cfg = ViTConfig(embed_dim=64, num_heads=4, depth=2, mlp_dim=128,
                    rope=RopeConfig("axial", 100.0, 1.0, "xy", (16, 16)), pos_embed=False, mlp="swiglu",
                    mlp_norm=True, k_bias=False, fc_norm=True, final_norm=False, pool="gap", family="eva")
    back = ViTConfig.from_dict(json.loads(cfg.to_json()))
    assert back == cfg and back.rope.ref_grid == (16, 16)
    with pytest.raises(ValueError, match="divisible by 4"):
        ViTConfig(embed_dim=72, num_heads=4, rope=RopeConfig())
    with pytest.raises(ValueError, match="unknown RopeConfig fields"):
        ViTConfig.from_dict({**cfg.to_dict(), "rope": {"kind": "axial", "base": 3}})


def test_rope_model_runs_at_any_grid_and_its_two_attention_paths_agree():
    cfg = ViTConfig(img_size=(64, 64), embed_dim=64, num_heads=4, depth=2, mlp_dim=128, num_classes=3,
                    rope=RopeConfig("dinov3", 100.0, rotate_half=True), pos_embed=False, reg_tokens=2)
    torch.manual_seed(0)
    model = VisionTransformer(cfg).eval()
    torch.nn.init.normal_(model.head.weight)
    assert model.pos_embed is None and "pos_embed" not in model.state_dict()
    x = torch.randn(1, 3, 48, 80)
    with torch.no_grad():
        fused = model(x)
        explicit, attn = model(x, return_attention=True)
    assert (fused - explicit).abs().max() <= 1e-5 and attn[0].shape == (1, 4, 3 + 15, 3 + 15)
    with pytest.raises(ValueError, match="token merging is not supported with RoPE"):
        model.set_token_merging(2)
    with pytest.raises(ValueError, match="rotary table"):
        model.blocks[0](torch.randn(1, 3 + 15, 64))
