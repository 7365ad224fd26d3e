"""The model: attention paths, attention maps, any resolution, head reset, export-friendliness."""

import copy

import pytest
import torch

from vit_serve.config import ViTConfig
from vit_serve.model import Attention, VisionTransformer, create_model

SMALL = dict(embed_dim=64, depth=3, num_heads=4, mlp_dim=128, num_classes=7)


def small(**kw) -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(ViTConfig(**{**SMALL, **kw})).eval()
    with torch.no_grad():  # a zero head would make every logit test vacuous
        model.head.weight.normal_(0, 0.2)
        model.pos_embed.normal_(0, 1)
    return model


@pytest.mark.parametrize("kw", [
    dict(img_size=64),
    dict(img_size=64, pool="gap", class_token=False),
    dict(img_size=64, pool="gap"),
    dict(img_size=64, representation_size=32),
    dict(img_size=64, gelu="tanh", layer_norm_eps=1e-12, qkv_bias=False),
    dict(img_size=64, resnet_layers=(1, 1), resnet_width=32, patch_size=16),
    dict(img_size=64, resnet_layers=(), resnet_width=32, patch_size=8),
])
def test_fused_and_explicit_attention_agree(kw):
    model = small(**kw)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        fused = model(x)
        explicit, attn = model(x, return_attention=True)
    assert fused.shape == (2, 7)
    assert (fused - explicit).abs().max() <= 1e-5
    assert len(attn) == model.cfg.depth


def test_fused_path_is_default_and_explicit_only_when_asked():
    """The normal forward runs SDPA and no softmax; return_attention runs softmax and no SDPA."""
    model = small(img_size=32)
    x = torch.randn(1, 3, 32, 32)

    def ops(**kw):
        with torch.no_grad(), torch.profiler.profile() as prof:
            model(x, **kw)
        return {e.key for e in prof.key_averages()}

    normal, explicit = ops(), ops(return_attention=True)
    assert "aten::scaled_dot_product_attention" in normal and "aten::softmax" not in normal
    assert "aten::softmax" in explicit and "aten::scaled_dot_product_attention" not in explicit


def test_attention_maps_every_layer_rows_sum_to_one():
    model = small(img_size=(48, 64))
    with torch.no_grad():
        _, attn = model(torch.randn(2, 3, 48, 64), return_attention=True)
    n = 1 + 3 * 4
    assert [a.shape for a in attn] == [(2, 4, n, n)] * 3
    for a in attn:
        assert torch.allclose(a.sum(-1), torch.ones(2, 4, n), atol=1e-6)
        assert (a >= 0).all()


def test_attn_at_v_reproduces_fused_output():
    torch.manual_seed(0)
    attn = Attention(64, 4).eval()
    x = torch.randn(2, 10, 64)
    with torch.no_grad():
        fused, none, _ = attn(x)
        _, probs, _ = attn(x, return_attention=True)
        _, _, v = attn.qkv(x).reshape(2, 10, 3, 4, 16).permute(2, 0, 3, 1, 4)
        manual = attn.proj((probs @ v).transpose(1, 2).reshape(2, 10, 64))
    assert none is None
    assert (manual - fused).abs().max() <= 1e-5


@pytest.mark.parametrize("size", [(64, 64), (96, 96), (80, 64), (48, 112)])
@pytest.mark.parametrize("mode", ["jax", "timm", "hf", "torchvision"])
def test_on_the_fly_equals_permanent_resampling(size, mode):
    model = small(img_size=64, resample_mode=mode)
    x = torch.randn(2, 3, *size)
    permanent = copy.deepcopy(model)
    permanent.set_resolution(*size)
    assert permanent.cfg.img_size == size and permanent.grid_size == (size[0] // 16, size[1] // 16)
    with torch.no_grad():
        err = (model(x) - permanent(x)).abs().max()
    assert err <= 1e-5


@pytest.mark.parametrize("size", [(224, 224), (384, 384), (320, 256)])
def test_on_the_fly_equals_permanent_at_paper_sizes(size):
    """ViT-Ti/16 from 224 (paper §3.2 fine-tunes at 384; 320x256 is non-square)."""
    model = create_model("Ti/16", num_classes=10, depth=2).eval()
    with torch.no_grad():
        model.pos_embed.normal_(0, 1)
        model.head.weight.normal_(0, 0.2)
    permanent = copy.deepcopy(model)
    permanent.set_resolution(*size)
    x = torch.randn(1, 3, *size)
    with torch.no_grad():
        assert (model(x) - permanent(x)).abs().max() <= 1e-5


@pytest.mark.parametrize("h, w, match", [
    (225, 224, r"input size 225x224 is not a multiple of the patch size 16; nearest valid sizes: "
               r"height 224 or 240, width 224"),
    (100, 70, r"height 96 or 112, width 64 or 80"),
    (8, 16, r"height 16, width 16"),
])
def test_bad_size_names_nearest_valid_sizes(h, w, match):
    model = small(img_size=64)
    with pytest.raises(ValueError, match=match):
        model(torch.randn(1, 3, h, w))
    with pytest.raises(ValueError, match=match):
        model.set_resolution(h, w)


def test_tracing_keeps_the_resize():
    """A trace taken at the native size still resamples for other sizes (no early return baked in)."""
    model = small(img_size=64)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        traced = torch.jit.trace(model, x, check_trace=False)
        assert any("upsample" in n.kind() for n in traced.graph.nodes())
        x2 = torch.randn(1, 3, 96, 80)
        assert (traced(x2) - model(x2)).abs().max() <= 1e-5


def test_torch_export_with_dynamic_height_and_width():
    from torch.export import Dim, export

    model = small(img_size=64)
    x = torch.randn(2, 3, 64, 64)
    dyn = {"x": {0: Dim("b", max=32), 2: 16 * Dim("gh", min=1, max=32), 3: 16 * Dim("gw", min=1, max=32)}}
    ep = export(model, (x,), dynamic_shapes=dyn)
    for size in [(64, 64), (96, 96), (80, 48)]:
        xs = torch.randn(3, 3, *size)
        with torch.no_grad():
            assert (ep.module()(xs) - model(xs)).abs().max() <= 1e-5


def test_reset_head_is_zero_initialised_and_drops_pre_logits():
    model = small(img_size=32, representation_size=16)
    model.labels = ["a"] * 7
    model.reset_head(3)
    assert model.cfg.num_classes == 3 and model.cfg.representation_size is None and model.labels is None
    assert isinstance(model.pre_logits, torch.nn.Identity)
    assert model.head.weight.shape == (3, 64)
    assert not model.head.weight.any() and not model.head.bias.any()
    with torch.no_grad():
        assert not model(torch.randn(2, 3, 32, 32)).any()
    kept = small(img_size=32, representation_size=16)
    kept.reset_head(5, keep_pre_logits=True)
    assert kept.head.weight.shape == (5, 16)


def test_forward_api_composes():
    model = small(img_size=32, representation_size=16)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        tokens = model.forward_features(x)
        assert tokens.shape == (2, 1 + 4, 64)
        pooled = model.pool(tokens)
        assert torch.equal(pooled, tokens[:, 0])
        feats = model.forward_head(tokens, pre_logits=True)
        assert feats.shape == (2, 16) and feats.abs().max() <= 1  # tanh representation layer
        assert torch.equal(model.head(feats), model.forward_head(tokens))
        assert torch.equal(model(x), model.forward_head(tokens))
        logits, embedding = model.forward_embedding(x)
        assert torch.equal(embedding, feats) and torch.equal(logits, model(x))


def test_gap_pools_patch_tokens_after_the_final_norm():
    """vit_jax 'gap': encoder_norm over all tokens, then the mean over patch tokens."""
    model = small(img_size=32, pool="gap")
    tokens = model.forward_features(torch.randn(2, 3, 32, 32))
    assert torch.equal(model.pool(tokens), tokens[:, 1:].mean(1))


def test_training_mode_regularisers_run_and_backprop():
    model = small(img_size=32, drop_rate=0.1, attn_drop_rate=0.1, drop_path_rate=0.2)
    model.train()
    out = model(torch.randn(4, 3, 32, 32))
    out.sum().backward()
    assert model.pos_embed.grad is not None and model.blocks[0].attn.qkv.weight.grad.abs().sum() > 0
    assert model.blocks[0].drop_path_rate == 0 and abs(model.blocks[-1].drop_path_rate - 0.2) < 1e-9


def test_init_follows_vit_jax():
    model = create_model("S/16", num_classes=10, depth=2)
    assert not model.head.weight.any()
    assert 0.015 < model.pos_embed.std() < 0.025
    fc1 = model.blocks[0].mlp.fc1
    bound = (6 / (fc1.in_features + fc1.out_features)) ** 0.5
    assert fc1.weight.abs().max() <= bound and fc1.bias.abs().max() < 1e-4
