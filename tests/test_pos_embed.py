"""resample_pos_embed against the implementation each mode is named after."""

import numpy as np
import pytest
import torch

from vit_serve.pos_embed import resample_pos_embed

GRIDS = [((14, 14), (24, 24)), ((14, 14), (24, 32)), ((24, 32), (14, 14)), ((7, 5), (9, 11))]


def _pos(grid, prefix=1, dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, prefix + grid[0] * grid[1], dim, generator=g)


@pytest.mark.parametrize("old, new", GRIDS)
def test_jax_mode_equals_scipy_zoom(old, new):
    """Reference: vit_jax checkpoint.interpolate_posembed, scipy.ndimage.zoom(order=1) on the grid."""
    scipy_ndimage = pytest.importorskip("scipy.ndimage")
    pos = _pos(old)
    grid = pos[0, 1:].numpy().astype(np.float64).reshape(old[0], old[1], -1)
    zoom = (new[0] / old[0], new[1] / old[1], 1)
    ref = scipy_ndimage.zoom(grid, zoom, order=1)
    assert ref.shape[:2] == new
    ours = resample_pos_embed(pos, old, new, 1, "jax")
    err = np.abs(ours[0, 1:].numpy().reshape(ref.shape) - ref).max()
    assert err <= 2e-6, err
    assert torch.equal(ours[:, :1], pos[:, :1])


@pytest.mark.parametrize("old, new", GRIDS)
@pytest.mark.parametrize("prefix", [0, 1])
def test_timm_mode_equals_timm(old, new, prefix):
    """Reference: timm.layers.resample_abs_pos_embed (bicubic, antialias)."""
    timm_layers = pytest.importorskip("timm.layers")
    pos = _pos(old, prefix)
    ref = timm_layers.resample_abs_pos_embed(pos, list(new), list(old), num_prefix_tokens=prefix)
    ours = resample_pos_embed(pos, old, new, prefix, "timm")
    assert (ours - ref).abs().max() <= 1e-6


@pytest.mark.parametrize("new", [(24, 24), (24, 32), (20, 16)])
def test_hf_mode_equals_transformers(new):
    """Reference: transformers ViTEmbeddings.interpolate_pos_encoding."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ViTConfig(hidden_size=32, image_size=224, patch_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=64)
    emb = transformers.models.vit.modeling_vit.ViTEmbeddings(cfg)
    with torch.no_grad():
        emb.position_embeddings.copy_(_pos((14, 14)))
        h, w = new[0] * 16, new[1] * 16
        ref = emb.interpolate_pos_encoding(torch.zeros(1, 1 + new[0] * new[1], 32), h, w)
    ours = resample_pos_embed(emb.position_embeddings.detach(), (14, 14), new, 1, "hf")
    assert (ours - ref).abs().max() <= 1e-6


@pytest.mark.parametrize("new", [(24, 24), (10, 10)])
def test_torchvision_mode_equals_torchvision(new):
    """Reference: torchvision.models.vision_transformer.interpolate_embeddings (square grids only)."""
    tv = pytest.importorskip("torchvision.models.vision_transformer")
    pos = _pos((14, 14))
    ref = tv.interpolate_embeddings(new[0] * 16, 16, {"encoder.pos_embedding": pos})["encoder.pos_embedding"]
    ours = resample_pos_embed(pos, (14, 14), new, 1, "torchvision")
    assert (ours - ref).abs().max() <= 1e-6


@pytest.mark.parametrize("mode", ["jax", "timm", "hf", "torchvision"])
def test_same_grid_is_exact_input(mode):
    pos = _pos((14, 10))
    assert resample_pos_embed(pos, (14, 10), (14, 10), 1, mode) is pos


def test_prefix_tokens_untouched_and_shape():
    pos = _pos((6, 8), prefix=1)
    out = resample_pos_embed(pos, (6, 8), (12, 4), 1, "timm")
    assert out.shape == (1, 1 + 48, 32)
    assert torch.equal(out[:, 0], pos[:, 0])


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown resample mode 'area'"):
        resample_pos_embed(_pos((4, 4)), (4, 4), (8, 8), 1, "area")
    with pytest.raises(ValueError, match="pos_embed has 17 tokens, expected 1 \\+ 5x5"):
        resample_pos_embed(_pos((4, 4)), (5, 5), (8, 8), 1, "timm")
