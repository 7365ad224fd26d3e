"""Hugging Face SigLIP 2 (NaFlex) folders -> our model. Reference: transformers' own `Siglip2ImageProcessor`
and `Siglip2VisionModel` (tiny, random weights, nothing downloaded) on real photos (scikit-image's astronaut,
coffee and chelsea cut to a portrait, a wide and a square image) at two patch budgets."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
skimage_data = pytest.importorskip("skimage.data")

from vit_serve import naflex  # noqa: E402
from vit_serve.checkpoints import load, save  # noqa: E402

T = transformers
PATCH = 16
BUDGETS = (256, 64)


def photos() -> dict[str, object]:
    """uint8 RGB [H, W, 3]: portrait 512x300, wide 400x600, square 300x300."""
    return {"portrait": skimage_data.astronaut()[:, 100:400], "wide": skimage_data.coffee(),
            "square": skimage_data.chelsea()[:, 75:375]}


def _tower(num_patches: int, seed: int) -> torch.nn.Module:
    cfg = T.Siglip2VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_patches=num_patches, patch_size=PATCH)
    model = T.Siglip2VisionModel(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # nothing trivially zero: biases, the probe, the position grid all perturbed
        for name, p in model.named_parameters():
            scale = 1.0 if "position_embedding" in name else (p.shape[-1] ** -0.5 if p.ndim >= 2 else 0.1)
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if "norm" in name and name.endswith("weight")
                                                                 else 0.0))
    return model


@pytest.fixture(scope="module", params=[16, 256], ids=lambda n: f"grid{n}")
def pair(request, tmp_path_factory):
    """(HF model, our model loaded from its saved folder) for a stored grid of `num_patches` positions."""
    ref = _tower(request.param, seed=request.param)
    folder = tmp_path_factory.mktemp(f"siglip2_{request.param}")
    ref.save_pretrained(folder)
    return ref, load(folder)


def _hf(images, n):
    return T.Siglip2ImageProcessor(max_num_patches=n)(images=images, return_tensors="pt")


def test_config_and_contract(pair):
    ref, ours = pair
    c = ours.cfg
    g = round(ref.config.num_patches ** 0.5)
    assert json.loads(ref.config.to_json_string())["model_type"] == "siglip2_vision_model"
    assert (c.family, c.pool, c.class_token, c.resample_mode, c.gelu) == ("siglip", "map", False, "naflex", "tanh")
    assert c.img_size == (g * PATCH, g * PATCH) and c.extra["max_patches"] == 256
    p = ours.preprocess_cfg
    assert (p.mean, p.std, p.interpolation, p.crop_mode) == ((0.5,) * 3, (0.5,) * 3, "bilinear", "squash")


@pytest.mark.parametrize("n", BUDGETS)
def test_same_patches_as_the_processor(n):
    imgs = list(photos().values())
    want = _hf(imgs, n)
    got = naflex.batch_images(imgs, PATCH, n)
    assert torch.equal(got.spatial_shapes, want.spatial_shapes)
    assert torch.equal(got.mask, want.pixel_attention_mask.bool())
    assert (got.patches - want.pixel_values).abs().max() <= 1e-6
    # the budget is used as the reference's rule does: at most n patches, aspect ratio kept to a patch
    assert (got.spatial_shapes.prod(-1) <= n).all()
    for (h, w), img in zip(got.spatial_shapes.tolist(), imgs, strict=True):
        assert abs(h / w - img.shape[0] / img.shape[1]) < 0.5


@pytest.mark.parametrize("n", BUDGETS)
def test_pooled_output_on_the_same_patches(pair, n):
    ref, ours = pair
    x = _hf(list(photos().values()), n)
    with torch.no_grad():
        out = ref(**x)
        _, emb = ours.forward_patches(x.pixel_values, x.spatial_shapes, x.pixel_attention_mask)
        tokens, _ = ours.forward_patch_features(x.pixel_values, x.spatial_shapes, x.pixel_attention_mask)
    real = x.pixel_attention_mask.bool()
    assert (emb - out.pooler_output).abs().max() <= 1e-4
    assert (tokens[real] - out.last_hidden_state[real]).abs().max() <= 1e-4


@pytest.mark.parametrize("n", BUDGETS)
def test_whole_path_against_hf_whole_path(pair, n):
    ref, ours = pair
    imgs = list(photos().values())
    b = naflex.batch_images(imgs, PATCH, n, ours.preprocess_cfg.mean, ours.preprocess_cfg.std)
    with torch.no_grad():
        want = ref(**_hf(imgs, n)).pooler_output
        _, got = ours.forward_patches(b.patches, b.spatial_shapes, b.mask)
    assert F.cosine_similarity(got, want).min() >= 0.999
    assert (got - want).abs().max() <= 1e-4


def test_embedding_alone_equals_padded_in_a_mixed_batch(pair):
    _, ours = pair
    imgs = photos()
    alone = {}
    for name, n in (("portrait", 64), ("wide", 256), ("square", 100)):
        b = naflex.batch_images([imgs[name]], PATCH, n)
        with torch.no_grad():
            alone[name] = ours.forward_patches(b.patches, b.spatial_shapes, b.mask)[1][0]
    # one batch, each image at its own budget, all padded to the largest (and further)
    rows, shapes, masks = [], [], []
    for name, n in (("wide", 256), ("portrait", 64), ("square", 100)):
        b = naflex.batch_images([imgs[name]], PATCH, n)
        p, m = naflex.pad_patches(b.patches[0][b.mask[0]], 300)
        rows.append(p + torch.randn_like(p) * ~m[:, None])  # padding content must not matter either
        shapes.append(b.spatial_shapes[0])
        masks.append(m)
    with torch.no_grad():
        _, emb = ours.forward_patches(torch.stack(rows), torch.stack(shapes), torch.stack(masks))
    for i, name in enumerate(("wide", "portrait", "square")):
        assert (emb[i] - alone[name]).abs().max() <= 1e-5, name


def test_image_path_equals_patch_path(pair):
    """`forward` on a resized image resamples as NaFlex does: the same embedding as its patches."""
    _, ours = pair
    b = naflex.batch_images([photos()["wide"]], PATCH, 64)
    h, w = (int(v) * PATCH for v in b.spatial_shapes[0])
    n = h * w // PATCH**2
    image = b.patches[0, :n].reshape(h // PATCH, w // PATCH, PATCH, PATCH, 3).permute(4, 0, 2, 1, 3)
    with torch.no_grad():
        _, want = ours.forward_patches(b.patches, b.spatial_shapes, b.mask)
        _, got = ours.forward_embedding(image.reshape(1, 3, h, w))
    assert (got - want).abs().max() <= 1e-5


def test_two_tower_folder_and_processor_budget(tmp_path):
    """model_type siglip2 (Siglip2Model: vision half converted, text kept aside); the processor's
    max_num_patches is the recorded budget and survives our format."""
    text = dict(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                max_position_embeddings=8)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_patches=64,
                  patch_size=PATCH)
    model = T.Siglip2Model(T.Siglip2Config(text_config=text, vision_config=vision)).eval()
    model.save_pretrained(tmp_path / "hf")
    T.Siglip2ImageProcessor(max_num_patches=128).save_pretrained(tmp_path / "hf")
    ours = load(tmp_path / "hf")
    assert ours.cfg.extra["max_patches"] == 128 and ours.cfg.img_size == (128, 128)
    x = _hf([photos()["portrait"]], 128)
    with torch.no_grad():
        want = model.get_image_features(**x)
        want = getattr(want, "pooler_output", want)
        _, got = ours.forward_patches(x.pixel_values, x.spatial_shapes, x.pixel_attention_mask)
    assert (got - want).abs().max() <= 1e-4
    save(ours, tmp_path / "ours.safetensors")
    assert load(tmp_path / "ours.safetensors").cfg.extra["max_patches"] == 128
