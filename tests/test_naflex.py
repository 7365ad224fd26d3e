"""vit_serve.naflex and the model's NaFlex path. References: transformers' siglip2 functions (the resize rule,
patch order, position resampling), torch's `F.interpolate(bilinear, antialias=True)` for non-square stored
grids, and the model's own image path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vit_serve import naflex
from vit_serve.model import create_model
from vit_serve.pos_embed import interpolation_weights, resample_pos_embed

siglip2 = pytest.importorskip("transformers.models.siglip2.image_processing_siglip2")


@pytest.mark.parametrize("hw", [(512, 512), (300, 451), (1000, 37), (37, 1000), (17, 19), (4000, 3000)])
@pytest.mark.parametrize("n", [1, 16, 64, 100, 256, 1024])
@pytest.mark.parametrize("p", [14, 16])
def test_target_size_is_the_reference_rule(hw, n, p):
    got = naflex.target_size(*hw, p, n)
    assert got == siglip2.get_image_size_for_max_num_patches(*hw, p, n)
    assert got[0] % p == 0 and got[1] % p == 0 and (got[0] // p) * (got[1] // p) <= max(n, 1)


def test_patch_order_and_padding():
    img = torch.randn(3, 48, 32)
    rows = naflex.image_to_patches(img, 16)
    assert torch.equal(rows, siglip2.convert_image_to_patches(img, 16))
    padded, mask = naflex.pad_patches(rows, 10)
    want, want_mask = siglip2.pad_along_first_dim(rows, 10)
    assert torch.equal(padded, want) and torch.equal(mask, want_mask.bool())
    with pytest.raises(ValueError, match="do not fit"):
        naflex.pad_patches(rows, 5)


def test_conv_and_linear_weights_agree():
    conv = torch.nn.Conv2d(3, 8, 16, 16)
    img = torch.randn(3, 32, 48)
    want = conv(img[None]).flatten(2).transpose(1, 2)[0]
    got = F.linear(naflex.image_to_patches(img, 16), naflex.conv_to_linear(conv.weight), conv.bias)
    assert (got - want).abs().max() <= 1e-5
    assert torch.equal(naflex.linear_to_conv(naflex.conv_to_linear(conv.weight), 3, 16), conv.weight)


@pytest.mark.parametrize("grid", [(8, 8), (6, 10)])
def test_position_weights_are_bilinear_antialias(grid):
    """Per image: F.interpolate(bilinear, antialias) of the stored grid to the image's grid, rows past h * w
    repeating its entry (0, 0); the same matrix as pos_embed's portable "naflex" weights."""
    pos = torch.randn(1, 5, *grid)
    shapes = torch.tensor([[3, 5], [12, 4], [8, 8], [1, 1]])
    w = naflex.position_weights(grid, shapes, 70)
    out = w @ pos[0].flatten(1).T
    for i, (h, ww) in enumerate(shapes.tolist()):
        want = F.interpolate(pos, size=(h, ww), mode="bilinear", align_corners=False, antialias=True)
        assert (out[i, : h * ww] - want[0].flatten(1).T).abs().max() <= 1e-5
        assert torch.equal(out[i, h * ww:], out[i, :1].expand(70 - h * ww, -1))
        w_h = interpolation_weights(grid[0], h, "bilinear", False, True)
        w_w = interpolation_weights(grid[1], ww, "bilinear", False, True)
        assert (torch.kron(w_h, w_w) - w[i, : h * ww]).abs().max() <= 1e-6


def test_resample_mode_naflex_portable_matches_eager():
    pos = torch.randn(1, 64, 16)
    eager = resample_pos_embed(pos, (8, 8), (3, 13), 0, "naflex")
    portable = resample_pos_embed(pos, (8, 8), (3, 13), 0, "naflex", portable=True)
    assert (eager - portable).abs().max() <= 1e-5


@pytest.mark.parametrize("pool,cls", [("map", False), ("gap", False), ("token", True), ("gap", True)])
def test_padding_never_reaches_real_tokens(pool, cls):
    """Any pool, with or without a class token: padded rows (any content) change nothing, and the patch path
    equals the image path at the image's own grid (position embeddings resampled the model's way)."""
    torch.manual_seed(0)
    model = create_model("Ti/16", img_size=64, depth=2, num_classes=5, pool=pool, class_token=cls,
                         no_embed_class=not cls, resample_mode="naflex").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    img = torch.randn(3, 48, 80)
    rows = naflex.image_to_patches(img, 16)
    padded, mask = naflex.pad_patches(rows, 20)
    noisy = padded + torch.randn_like(padded) * (~mask)[:, None] * 10
    shapes = torch.tensor([[3, 5]])
    with torch.no_grad():
        a = model.forward_patches(padded[None], shapes, mask[None])
        b = model.forward_patches(noisy[None], shapes, mask[None])
        c = model.forward_patches(rows[None], shapes, torch.ones(1, 15, dtype=torch.bool))
        d = model.forward_embedding(img[None])
    for x in (b, c, d):
        assert (x[0] - a[0]).abs().max() <= 1e-5 and (x[1] - a[1]).abs().max() <= 1e-5


def test_patch_path_refuses_token_merging():
    model = create_model("Ti/16", img_size=32, depth=1, num_classes=0).eval()
    model.set_token_merging(1)
    with pytest.raises(ValueError, match="no token merging"):
        model.forward_patches(torch.zeros(1, 4, 768), torch.tensor([[2, 2]]), torch.ones(1, 4))


def test_pack_round_trip_and_budget():
    imgs = [np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8)
            for i, (h, w) in enumerate([(40, 90), (100, 20)])]
    b = naflex.batch_images(imgs, 16, 12)
    packed = naflex.pack(b)
    assert packed.shape == (2, 13, 768)
    back = naflex.unpack(torch.cat([packed[1:], packed[:1]]))  # rows concatenated in any order stay whole
    assert torch.equal(back.patches, torch.cat([b.patches[1:], b.patches[:1]]))
    assert torch.equal(back.spatial_shapes, b.spatial_shapes.flip(0)) and torch.equal(back.mask, b.mask.flip(0))
    assert naflex.check_budget(12, 256) == 12
    for bad in (0, 257, True, 2.0):
        with pytest.raises(ValueError, match="from 1 to 256"):
            naflex.check_budget(bad, 256)
    with pytest.raises(ValueError, match="fixed-size images"):
        naflex.check_budget(12, None)


def test_pil_images_and_unpacking_into_the_model():
    from PIL import Image

    arr = np.random.default_rng(0).integers(0, 256, (50, 70, 3), dtype=np.uint8)
    a, b = naflex.batch_images([arr], 16, 9), naflex.batch_images([Image.fromarray(arr).convert("RGBA")], 16, 9)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    model = create_model("Ti/16", img_size=32, depth=1, num_classes=3, resample_mode="naflex").eval()
    with torch.no_grad():
        assert model.forward_patches(*a)[0].shape == (1, 3)


def test_mask_reaches_the_fused_and_explicit_attention():
    torch.manual_seed(0)
    model = create_model("Ti/16", img_size=32, depth=1, num_classes=0).eval()
    blk = model.blocks[0]
    x = torch.randn(2, 7, 192)
    keep = torch.tensor([[1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    bias = torch.zeros(2, 7).masked_fill(~keep, float("-inf"))[:, None, None, :]
    with torch.no_grad():
        fused, _ = blk(x, mask=bias)
        explicit, probs = blk(x, True, mask=bias)
        alone, _ = blk(x[:1, :4])
    assert (fused - explicit).abs().max() <= 1e-5
    assert probs[~keep[:, None, None, :].expand_as(probs)].abs().max() == 0  # no weight on a padded key
    assert (fused[:1, :4] - alone).abs().max() <= 1e-5
