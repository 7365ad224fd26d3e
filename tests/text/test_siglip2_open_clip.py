"""open_clip `ViT-*-SigLIP2-*`: the image tower (timm's SigLIP ViT, as SigLIP's) and the text tower (open_clip's
TextTransformer with SigLIP 2's Gemma vocabulary) with the Gemma tokenizer read from a local tokenizer.json.
References: open_clip's `HFTokenizer` (transformers' AutoTokenizer on the same local folder) for the ids, and
open_clip's zero-shot recipe (encode_image, encode_text, normalise, logit_scale.exp(), + logit_bias; sigmoid
scores) for the logits, on `open_clip.create_model("ViT-B-16-SigLIP2", pretrained=None)` with a one-layer text
tower over the tiny Gemma-style vocabulary of tests/text/tiny_gemma.py (random weights, nothing downloaded)."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import vit_serve
from vit_serve.checkpoints import convert
from vit_serve.cli import main
from vit_serve.text import TokenizerError, load_text_tower, read_text_tower, tokenizer_from_spec

open_clip = pytest.importorskip("open_clip")
from open_clip.tokenizer import HFTokenizer as OpenClipHFTokenizer  # noqa: E402

from tests.text import tiny_clip, tiny_gemma  # noqa: E402

ARCH = "open_clip:ViT-B-16-SigLIP2"
TEXTS = ["A photo of a Cat.", "dog", "zebra ünïcode 猫", "a photo of a cat " * 30, "", "  two  spaces, \tTabs "]
LABELS = ["cat", "dog", "traffic light", "origami crane"]
TEMPLATES = ["a photo of a {}.", "a blurry photo of the {}."]
NO_SIDE = {k: v for k, v in tiny_gemma.TOKENIZER_CONFIG.items() if k != "padding_side"}
CONFIGS = {"gemma-right": tiny_gemma.TOKENIZER_CONFIG,  # SigLIP 2's: right-padded, <eos> last
           "gemma-class-default": NO_SIDE,  # GemmaTokenizer's own padding side: left
           "siglip2-class": {**tiny_gemma.TOKENIZER_CONFIG, "tokenizer_class": "Siglip2Tokenizer"},  # lower-cases
           "no-config": None}


def _ours(folder, clean, length=16):
    from vit_serve.text.open_clip_text import _tokenizer

    return _tokenizer({"text_cfg": {"hf_tokenizer_name": "timm/ViT-B-16-SigLIP2",
                                    "tokenizer_kwargs": {"clean": clean}}}, length, folder)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("clean", ["canonicalize", "whitespace"])
def test_gemma_tokenizer_equals_open_clips(tmp_path, name, clean):
    """Our ids are open_clip HFTokenizer's (transformers' AutoTokenizer on the folder), truncation included."""
    tiny_gemma.write(tmp_path, CONFIGS[name])
    ours = _ours(tmp_path, clean)
    got = ours(TEXTS)
    kw = {}
    if name == "no-config":  # transformers finds no pad token and refuses to pad; ours pads with id 0 (<pad>)
        with pytest.raises(ValueError, match="padding token"):
            OpenClipHFTokenizer(str(tmp_path), context_length=16, clean=clean)(TEXTS)
        kw = {"pad_token": "<pad>"}
    expected = OpenClipHFTokenizer(str(tmp_path), context_length=16, clean=clean, **kw)(TEXTS)
    assert torch.equal(got, expected)
    assert (got[1, 0] == 0) == (name == "gemma-class-default")  # left padding, as transformers does
    assert (got[:, -1] == 1).any() or name == "gemma-class-default"  # the truncated text still ends with <eos>
    again = tokenizer_from_spec(json.loads(json.dumps(ours.to_spec())))  # what our checkpoint carries
    assert torch.equal(again(TEXTS), expected)


def test_siglip2_class_lowercases(tmp_path):
    """Siglip2Tokenizer lower-cases before the BPE (the file's own normaliser does not): without open_clip's
    canonicalising clean, "Cat" tokenizes as "cat" only under that class."""
    tiny_gemma.write(tmp_path / "g", tiny_gemma.TOKENIZER_CONFIG)
    tiny_gemma.write(tmp_path / "s", CONFIGS["siglip2-class"])
    g, s = _ours(tmp_path / "g", "whitespace")(["Cat"]), _ours(tmp_path / "s", "whitespace")(["Cat"])
    assert not torch.equal(g, s) and torch.equal(s, _ours(tmp_path / "g", "whitespace")(["cat"]))


@pytest.fixture(scope="module")
def siglip2(tmp_path_factory):
    """(open_clip model, folder with open_clip.safetensors + the tokenizer files)."""
    folder = tmp_path_factory.mktemp("siglip2")
    vocab = tiny_gemma.write(folder)
    text_cfg = {**open_clip.get_model_config("ViT-B-16-SigLIP2")["text_cfg"], "layers": 1, "vocab_size": vocab}
    model = tiny_clip.randomized("ViT-B-16-SigLIP2", seed=2, text_cfg=text_cfg)
    save_file(tiny_clip.state_dict(model), folder / "open_clip.safetensors")
    return model, folder


@torch.no_grad()
def open_clip_recipe(model, folder, x, labels, templates):
    tok = OpenClipHFTokenizer(str(folder), context_length=64, clean="canonicalize")
    weights = []
    for label in labels:
        emb = F.normalize(model.encode_text(tok([t.format(label) for t in templates])), dim=-1)
        weights.append(F.normalize(emb.mean(dim=0), dim=-1))
    image = F.normalize(model.encode_image(x), dim=-1)
    return model.logit_scale.exp() * image @ torch.stack(weights).T + model.logit_bias


def test_text_tower_parity(siglip2):
    model, folder = siglip2
    bundle = read_text_tower(folder / "open_clip.safetensors", arch=ARCH)
    ids = OpenClipHFTokenizer(str(folder), context_length=64, clean="canonicalize")(TEXTS)
    assert torch.equal(bundle.tokenize(TEXTS), ids)
    with torch.no_grad():
        assert (bundle.encode(TEXTS) - model.encode_text(ids)).abs().max() <= 1e-4
    cfg = bundle.config
    assert (cfg.causal, cfg.pool, cfg.proj_bias, cfg.gelu, cfg.layer_norm_eps, cfg.context_length) == (
        False, "last", True, "tanh", 1e-6, 64)
    assert bundle.sigmoid and bundle.logit_bias == pytest.approx(float(model.logit_bias.detach()))


def test_zero_shot_logits_equal_open_clip_recipe(siglip2, tmp_path):
    model, folder = siglip2
    dst = tmp_path / "zs.safetensors"
    convert(folder / "open_clip.safetensors", dst, arch=ARCH, zero_shot=LABELS, templates=TEMPLATES)
    ours = vit_serve.load(dst)
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = ours(x)
    expected = open_clip_recipe(model, folder, x, LABELS, TEMPLATES)
    assert (logits - expected).abs().max() <= 1e-4
    assert ours.cfg.family == "siglip" and ours.cfg.scores == "sigmoid" and ours.labels == LABELS
    assert ours.preprocess_cfg.mean == (0.5, 0.5, 0.5) and ours.preprocess_cfg.crop_mode == "squash"
    tower = load_text_tower(dst)  # kept for ?labels=, with the Gemma tokenizer inside the checkpoint
    assert torch.equal(tower.tokenize(TEXTS), OpenClipHFTokenizer(str(folder), context_length=64,
                                                                  clean="canonicalize")(TEXTS))


def test_gemma_tokenizer_not_local(siglip2, tmp_path, capsys):
    """Without its tokenizer.json beside the weights: one line naming the file and the folder; the image tower still
    converts, and --zero-shot exits 2."""
    _, folder = siglip2
    src = tmp_path / "open_clip.safetensors"
    src.symlink_to(folder / "open_clip.safetensors")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json") as e:
        read_text_tower(src, arch=ARCH)
    assert "\n" not in str(e.value) and "timm/ViT-B-16-SigLIP2" in str(e.value) and str(tmp_path) in str(e.value)
    (tmp_path / "labels.txt").write_text("cat\ndog\n")
    dst = tmp_path / "zs.safetensors"
    assert main(["convert", str(src), str(dst), "--arch", ARCH, "--zero-shot", str(tmp_path / "labels.txt")]) == 2
    err = capsys.readouterr().err.strip()
    assert "tokenizer.json" in err and len(err.splitlines()) == 1 and not dst.exists()


@pytest.mark.parametrize("config", ["gemma-right", "gemma-class-default"])
def test_exported_text_tower_for_labels(siglip2, tmp_path, config):
    """What the gateway's `?labels=` runs: the exported text tower (onnxruntime) with the tokenizer its manifest
    names, padded on the side transformers pads (left for GemmaTokenizer's class default)."""
    from vit_export.text_tower import export_text_tower

    from vit_serve.runtime.text_tower import TextTower

    model, folder = siglip2
    local = tmp_path / "w"
    local.mkdir()
    (local / "open_clip.safetensors").symlink_to(folder / "open_clip.safetensors")
    tiny_gemma.write(local, CONFIGS[config])
    bundle = read_text_tower(local / "open_clip.safetensors", arch=ARCH)
    written = export_text_tower(bundle, None, tmp_path / "repo", "sl2", family="siglip")
    assert written.record.parity["ok"] and written.record.scores == "sigmoid"
    tower = TextTower(written.path)
    ids = OpenClipHFTokenizer(str(local), context_length=64, clean="canonicalize")(TEXTS[:3])
    assert (ids[1, 0] == 0) == (config == "gemma-class-default")
    assert torch.equal(tower.tokenizer(TEXTS[:3]), ids)
    with torch.no_grad():
        want = model.encode_text(ids)
    assert abs(tower.embed_texts(TEXTS[:3]) - want.numpy()).max() <= 1e-4
