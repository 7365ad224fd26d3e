"""open_clip `PE-Core-*` and `EVA02-*`: their image towers (timm `Eva` trunks with RoPE: PE-Core's MAP pool, EVA-02's
SwiGLU with sub-LayerNorm and attention norm; the trunk's own classifier, with its bias, is the CLIP projection) and
their text towers (open_clip TextTransformers, CLIP's tokenizer). References: open_clip's `encode_image` /
`encode_text` (at other sizes the trunk resized by timm's own `set_input_size`) and its zero-shot recipe
(normalise, mean over templates, renormalise, logit_scale.exp(); softmax scores), on
`open_clip.create_model(NAME, pretrained=None)` with random weights and a one-layer text tower; nothing downloaded.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import vit_serve
from vit_serve.checkpoints import build_model, convert, convert_open_clip
from vit_serve.text import load_text_tower
from vit_serve.text.open_clip_text import convert_open_clip_text
from vit_serve.zeroshot import zero_shot_classifier

open_clip = pytest.importorskip("open_clip")
from tests.text import tiny_clip  # noqa: E402

LABELS = ["cat", "dog", "traffic light"]
TEMPLATES = ["a photo of a {}.", "itap of the {}."]
TEXTS = ["a photo of a cat.", "Dog", ""]
# open_clip config -> (timm trunk's RoPE grid indexing, pool, other size: non-square, not the native one)
TOWERS = {"PE-Core-T-16-384": ("xy", "map", (352, 432)), "EVA02-B-16": ("ij", "token", (192, 272))}


@pytest.fixture(scope="module")
def towers():
    out = {}
    for i, name in enumerate(TOWERS):
        cfg = open_clip.get_model_config(name)
        out[name] = tiny_clip.randomized(name, seed=30 + i, text_cfg={**cfg["text_cfg"], "layers": 1})
    return out


@torch.no_grad()
def open_clip_recipe(ref, name, x, labels, templates):
    tok = open_clip.get_tokenizer(name)
    weights = []
    for label in labels:
        emb = F.normalize(ref.encode_text(tok([t.format(label) for t in templates])), dim=-1)
        weights.append(F.normalize(emb.mean(dim=0), dim=-1))
    return ref.logit_scale.exp() * F.normalize(ref.encode_image(x), dim=-1) @ torch.stack(weights).T


@pytest.mark.parametrize("name", list(TOWERS))
def test_image_tower_equals_encode_image(towers, name):
    ref = towers[name]
    indexing, pool, other = TOWERS[name]
    ours = build_model(convert_open_clip(ref.state_dict(), f"open_clip:{name}"))
    c = ours.cfg
    assert (c.family, c.pool, c.rope.grid_indexing, c.proj_bias) == ("clip", pool, indexing, True)
    pre = ours.preprocess_cfg  # open_clip's transform for the config's pretrained weights (PE: _pecfg)
    assert (pre.mean, pre.interpolation, pre.crop_mode) == (
        ((0.5,) * 3, "bilinear", "squash") if name.startswith("PE") else ((0.48145466, 0.4578275, 0.40821073),
                                                                             "bicubic", "center"))
    native = c.img_size
    g = torch.Generator().manual_seed(5)
    for size in (native, other):
        reference = copy.deepcopy(ref)
        reference.visual.trunk.set_input_size(img_size=size)  # timm's own resampling of the absolute embeddings
        x = torch.randn(2, 3, *size, generator=g)
        with torch.no_grad():
            want = reference.encode_image(x)
            _, emb = ours.forward_embedding(x)
            explicit = ours.forward_head(ours.forward_features(x, return_attention=True)[0], pre_logits=True)
        err = max((emb - want).abs().max().item(), (explicit - want).abs().max().item())
        print(f"open_clip {name} image {size[0]}x{size[1]}: |emb| max {want.abs().max():.2f}, max |diff| {err:.2e}")
        assert want.abs().max() > 0.5 and err <= 1e-4


@pytest.mark.parametrize("name", list(TOWERS))
def test_zero_shot_logits_equal_open_clip_recipe(towers, name):
    ref = towers[name]
    sd = ref.state_dict()
    model = build_model(convert_open_clip(sd, f"open_clip:{name}"))
    bundle = convert_open_clip_text(sd, f"open_clip:{name}")
    ids = open_clip.get_tokenizer(name)(TEXTS)
    assert torch.equal(bundle.tokenize(TEXTS), ids)
    with torch.no_grad():
        assert (bundle.encode(TEXTS) - ref.encode_text(ids)).abs().max() <= 1e-4
    assert bundle.config.causal and bundle.config.pool == "argmax" and not bundle.sigmoid
    zero_shot_classifier(model, bundle, LABELS, TEMPLATES)
    x = torch.randn(2, 3, *model.cfg.img_size, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        err = (model(x) - open_clip_recipe(ref, name, x, LABELS, TEMPLATES)).abs().max().item()
    print(f"open_clip {name} zero-shot logits: max |diff| {err:.2e}")
    assert err <= 1e-4 and model.cfg.scores == "softmax" and model.labels == LABELS


def test_pe_core_file_converts_with_its_zero_shot_head(towers, tmp_path):
    """The whole path from a file: `vit-serve convert --arch open_clip:PE-Core-T-16-384 --zero-shot`; the text
    tower is kept for ?labels=."""
    name = "PE-Core-T-16-384"
    ref = towers[name]
    src = tmp_path / "open_clip.safetensors"
    save_file(tiny_clip.state_dict(ref), src)
    dst = tmp_path / "zs.safetensors"
    convert(src, dst, arch=f"open_clip:{name}", zero_shot=LABELS, templates=TEMPLATES)
    ours = vit_serve.load(dst)
    x = torch.randn(1, 3, 384, 384, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert (ours(x) - open_clip_recipe(ref, name, x, LABELS, TEMPLATES)).abs().max() <= 1e-4
    assert load_text_tower(dst) is not None and ours.cfg.rope is not None


def test_every_pe_eva_and_siglip2_config_is_claimed_or_refused_by_its_architecture():
    """Each open_clip PE-Core-* / EVA0*-* / *-SigLIP2* config: its timm trunk resolves to our architecture (RoPE
    for PE-Core and EVA-02, none for EVA-01 and SigLIP 2's plain SigLIP ViT), or is refused in one line (EVA02-E's
    post-norm blocks); the text options are all ones we have."""
    from vit_serve.checkpoints.open_clip_state import vision_problem
    from vit_serve.checkpoints.timm_state import architecture_of
    from vit_serve.text.open_clip_text import _UNSUPPORTED

    names = [n for n in open_clip.list_models() if n.startswith(("PE-Core-", "EVA0")) or "-SigLIP2" in n]
    assert len(names) >= 25
    refused = {}
    for name in names:
        cfg = open_clip.get_model_config(name)
        assert not [k for k in _UNSUPPORTED if cfg["text_cfg"].get(k)]
        if problem := vision_problem(cfg):
            assert "\n" not in problem
            refused[name] = problem
            continue
        base = architecture_of(cfg["vision_cfg"]["timm_model_name"])
        assert (base.rope is not None) == name.startswith(("PE-Core-", "EVA02-")), name
        assert base.family == ("pe" if name.startswith("PE-") else "eva" if name.startswith("EVA") else "siglip")
    assert set(refused) == {"EVA02-E-14", "EVA02-E-14-plus"}
    assert all("post-norm" in why for why in refused.values())
