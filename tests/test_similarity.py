"""Similarity maps and patch tokens (vit_serve.similarity) against references computed here from the source
libraries' own modules: open_clip's ViT (random weights, tests/text/tiny_clip.py) for the [class]-token split, timm's
mean-pooled ViT for the exact one, timm's forward_intermediates for the patch tokens."""

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import vit_serve
from vit_serve.checkpoints import convert
from vit_serve.similarity import patch_tokens, similarity_map

open_clip = pytest.importorskip("open_clip")
timm = pytest.importorskip("timm")
from tests.family_models import FAMILIES, Family, ours, timm_model  # noqa: E402
from tests.text import tiny_clip  # noqa: E402

X = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def clip_pair(tmp_path_factory):
    """(open_clip's tiny CLIP, the same weights converted and loaded by vit_serve)."""
    folder = tmp_path_factory.mktemp("sim")
    tiny_clip.register(folder)
    ref = tiny_clip.randomized("tiny-clip")
    src, dst = folder / "clip.safetensors", folder / "clip-vs.safetensors"
    save_file(tiny_clip.state_dict(ref), src)
    convert(src, dst, arch="open_clip:tiny-clip")
    return ref, vit_serve.load(dst).eval()


@torch.no_grad()
def open_clip_reference(ref, x, query):
    """Each patch's share of cos(encode_image(x), query), from open_clip's own modules: the last resblock's
    attention (its MultiheadAttention weights, the probabilities computed here), its values through out_proj and
    ls_1, ln_post linearised at the [class] row's sigma, @ proj; divided by |encode_image|."""
    v = ref.visual
    seen = {}
    last = v.transformer.resblocks[-1]
    hooks = [last.register_forward_pre_hook(lambda m, a: seen.__setitem__("in", a[0])),
             last.register_forward_hook(lambda m, a, out: seen.__setitem__("out", out))]
    e = ref.encode_image(x)
    for h in hooks:
        h.remove()
    assert v.transformer.batch_first
    n = last.ln_1(seen["in"])  # [B, T, D]
    b, t, d = n.shape
    heads = last.attn.num_heads
    q, k, val = F.linear(n, last.attn.in_proj_weight, last.attn.in_proj_bias).chunk(3, dim=-1)
    split = lambda z: z.reshape(b, t, heads, d // heads).transpose(1, 2)  # noqa: E731
    probs = (split(q) @ split(k).transpose(-1, -2) / (d // heads) ** 0.5).softmax(-1)  # [B, h, T, T]
    per = probs[:, :, 0, :, None] * split(val)  # [B, h, T, hd]: [class]'s weighted value of each token
    c = last.ls_1(per.transpose(1, 2).reshape(b, t, d) @ last.attn.out_proj.weight.T)
    z = seen["out"][:, 0]
    sigma = (z.var(-1, unbiased=False) + v.ln_post.eps).sqrt()
    c = (c - c.mean(-1, keepdim=True)) / sigma[:, None, None] * v.ln_post.weight
    shares = (c @ v.proj) @ F.normalize(query, dim=-1) / e.norm(dim=-1, keepdim=True)
    return shares[:, 1:], F.cosine_similarity(e, query[None], dim=-1)


def test_clip_map_equals_open_clip_reference(clip_pair):
    ref, model = clip_pair
    tok = open_clip.get_tokenizer("tiny-clip")
    with torch.no_grad():
        query = ref.encode_text(tok(["a photo of a cat"]))[0]
        got = similarity_map(model, X, query)
    want, cosine = open_clip_reference(ref, X, query)
    assert got.map.shape == (2, 4, 4)
    assert (got.map.reshape(2, -1) - want).abs().max() <= 1e-5
    assert (got.cosine - cosine).abs().max() <= 1e-5
    assert torch.allclose(got.map.sum((1, 2)) + got.rest, got.cosine, atol=1e-6)
    assert got.method.startswith("last-attention")


def test_gap_map_is_exact_against_timm_tokens():
    """Mean pooling with an fc_norm (timm's global_pool="avg"): the patch tokens of timm's forward_features, / N,
    through fc_norm's gamma at the pooled vector's sigma (centred), dotted with the query, over |embedding|; plus
    fc_norm's beta, the whole cosine."""
    fam = Family("gap", "vit_small_patch16_224", 32, dict(patch_size=16, class_token=False, pool="gap",
                                                         fc_norm=True, final_norm=False))
    src = timm.create_model(fam.timm_name, pretrained=False, embed_dim=64, depth=2, num_heads=4, img_size=32,
                            num_classes=5, global_pool="avg", class_token=False).eval()
    with torch.no_grad():
        for i, p in enumerate(src.parameters()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.2)
    model = ours(fam, src)
    query = torch.randn(64, generator=torch.Generator().manual_seed(1))
    q = F.normalize(query, dim=0)
    with torch.no_grad():
        tokens = src.forward_features(X)
        e = src.forward_head(tokens, pre_logits=True)
        pooled = tokens.mean(1)
        sigma = (pooled.var(-1, unbiased=False) + src.fc_norm.eps).sqrt()[:, None, None]
        c = (tokens - tokens.mean(-1, keepdim=True)) / sigma * src.fc_norm.weight / tokens.shape[1]
        want = c @ q / e.norm(dim=-1, keepdim=True)
        got = similarity_map(model, X, query)
    assert (got.map.reshape(2, -1) - want).abs().max() <= 1e-5
    assert torch.allclose(got.rest, src.fc_norm.bias @ q / e.norm(dim=-1), atol=1e-6)
    assert torch.allclose(got.cosine, F.cosine_similarity(e, query[None], dim=-1), atol=1e-6)


@pytest.mark.parametrize("key", ["deit", "siglip", "dinov2_reg"])
def test_map_and_rest_add_up_to_the_cosine(key):
    """Every pooling (DeiT's two rows, SigLIP's attention pool, registers): the shares plus the rest are the
    cosine of the model's own embedding with the query."""
    fam = FAMILIES[key]
    model = ours(fam, timm_model(fam))
    x = torch.randn(2, 3, fam.img, fam.img, generator=torch.Generator().manual_seed(5))
    query = torch.randn(model.num_features, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = similarity_map(model, x, query)
        e = model.forward_embedding(x)[1]
    assert torch.allclose(got.cosine, F.cosine_similarity(e, query[None], dim=-1), atol=1e-6)
    assert torch.allclose(got.map.sum((1, 2)) + got.rest, got.cosine, atol=1e-6)
    assert got.map.abs().sum() > 0


@pytest.mark.parametrize("layer", [0, 1, -1])
def test_patch_tokens_equal_timm_forward_intermediates(layer):
    fam = FAMILIES["dinov2_reg"]
    src = timm_model(fam)
    model = ours(fam, src)
    x = torch.randn(2, 3, fam.img, fam.img, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = src.forward_intermediates(x, indices=[layer % 2], norm=False, output_fmt="NLC",
                                         intermediates_only=True)[0]
        got = patch_tokens(model, x, layer)
    assert got.shape == (2, 9, 64)
    assert (got - want).abs().max() <= 1e-5


def test_patch_tokens_layer_out_of_range(clip_pair):
    with pytest.raises(ValueError, match="layer must be from -2 to 1"):
        patch_tokens(clip_pair[1], X, 2)
