"""Hugging Face CLIPModel / SiglipModel folders -> vit_serve.text. Reference: transformers' `get_text_features`
(random weights from a config) on the ids of a small word-level tokenizer.json built here with `tokenizers`
(CLIP: <bos> ... <eos>, eos id 2 is the legacy argmax pooling, eos 5 the first-eos pooling; SigLIP: ... </s>,
padded to max_position_embeddings); zero-shot logits against the same recipe on SiglipModel's own features."""

import json

import pytest
import torch
import torch.nn.functional as F

from vit_serve.text import TokenizerError, read_text_tower
from vit_serve.text.tokenizer import tokenizer_from_spec
from vit_serve.zeroshot import label_weights

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WORDS = ["<pad>", "<bos>", "<eos>", "a", "photo", "</s>", "of", "cat", "dog", "the", "big", "[UNK]"]
TEXTS = ["a photo of a cat", "dog", "the big big big big big big big big big big big dog", ""]


def _tokenizer_json(bos: str | None, eos: str) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    single = f"{bos} $A {eos}" if bos else f"$A {eos}"
    specials = [(t, WORDS.index(t)) for t in (bos, eos) if t]
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    return tok.to_str()


def _save(model, folder, tok_json, pad="<pad>"):
    model.save_pretrained(folder)
    if tok_json is not None:
        (folder / "tokenizer.json").write_text(tok_json)
        (folder / "tokenizer_config.json").write_text(json.dumps({"pad_token": pad}))
    return folder


def _clip(eos_id: int):
    text = dict(vocab_size=len(WORDS), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=12, eos_token_id=eos_id, bos_token_id=1, pad_token_id=0)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, image_size=32,
                  patch_size=16)
    cfg = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=32)
    return transformers.CLIPModel(cfg).eval()


def _siglip():
    text = dict(vocab_size=len(WORDS), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=12, pad_token_id=0, eos_token_id=5)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, image_size=32,
                  patch_size=16)
    return transformers.SiglipModel(transformers.SiglipConfig(text_config=text, vision_config=vision)).eval()


@torch.no_grad()
def _randomize(model):
    g = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        p.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5 if p.ndim >= 2 else 5)
                + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
    return model


@pytest.mark.parametrize("kind", ["clip-eos2", "clip-eos", "siglip"])
def test_get_text_features_parity(kind, tmp_path):
    if kind == "siglip":
        model, tok = _randomize(_siglip()), _tokenizer_json(None, "</s>")
    else:
        eos = "<eos>" if kind == "clip-eos2" else "</s>"
        model, tok = _randomize(_clip(WORDS.index(eos))), _tokenizer_json("<bos>", eos)
    bundle = read_text_tower(_save(model, tmp_path, tok))
    ids = bundle.tokenize(TEXTS)
    assert ids.shape == (4, 12) and ids[1, 3:].eq(0).all()  # padded with <pad> to max_position_embeddings
    with torch.no_grad():
        out = model.get_text_features(input_ids=ids)
    expected = getattr(out, "pooler_output", out)
    assert (bundle.encode(TEXTS) - expected).abs().max() <= 1e-5
    assert bundle.config.pool == {"clip-eos2": "argmax", "clip-eos": "eos", "siglip": "last"}[kind]
    assert (bundle.logit_bias is not None) == (kind == "siglip")
    if kind == "siglip":  # the zero-shot class embeddings: open_clip's recipe on HF's own text features
        w = label_weights(bundle, ["cat", "dog"], ["a photo of a {}", "{}"])
        with torch.no_grad():
            e = model.get_text_features(input_ids=bundle.tokenize(["a photo of a cat", "cat", "a photo of a dog",
                                                                   "dog"]))
        e = F.normalize(getattr(e, "pooler_output", e), dim=-1).reshape(2, 2, -1).mean(1)
        assert (w - F.normalize(e, dim=-1)).abs().max() <= 1e-6


def test_tokenizer_not_local(tmp_path):
    folder = _save(_randomize(_siglip()), tmp_path, None)
    with pytest.raises(TokenizerError, match=r"needs tokenizer\.json") as e:
        read_text_tower(folder)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("lowercase_in_file", [False, True])
def test_siglip2_tokenizes_as_transformers(tmp_path, lowercase_in_file):
    """SigLIP 2's text tower is SigLIP's. A siglip2 folder is tokenized by transformers' Siglip2Tokenizer
    whatever tokenizer_config.json names (the hub's say GemmaTokenizer): lowercased, padded on the left, no special
    tokens added. Reference: AutoTokenizer on the same folder, and get_text_features on its ids."""
    chars = list("abcdefghijklmnopqrstuvwxyz▁")
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4, **{c: 5 + i for i, c in enumerate(chars)}}
    model = _siglip2_with_vocab(len(vocab))
    model.save_pretrained(tmp_path)
    transformers.Siglip2Tokenizer(vocab=vocab, merges=[]).save_pretrained(tmp_path)
    tok_file, cfg_file = tmp_path / "tokenizer.json", tmp_path / "tokenizer_config.json"
    data = json.loads(tok_file.read_text())
    if not lowercase_in_file:  # as the hub's Gemma tokenizer.json: no Lowercase
        data["normalizer"] = data["normalizer"]["normalizers"][1]
    tok_file.write_text(json.dumps(data))
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "tokenizer_class": "GemmaTokenizer"}))
    texts = ["A Photo of a CAT", "dog", "the big big big big dog"]
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    want = auto(texts, padding="max_length", max_length=12, truncation=True, return_tensors="pt").input_ids
    bundle = read_text_tower(tmp_path)
    assert type(auto).__name__ == "Siglip2Tokenizer" and torch.equal(bundle.tokenize(texts), want)
    with torch.no_grad():
        out = model.get_text_features(input_ids=want)
    assert (bundle.encode(texts) - getattr(out, "pooler_output", out)).abs().max() <= 1e-5
    spec = bundle.tokenizer.to_spec()
    assert spec["padding_side"] == "left" and tokenizer_from_spec(spec)(texts).equal(want)


def _siglip2_with_vocab(n: int):
    text = dict(vocab_size=n, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=12, pad_token_id=0, eos_token_id=1)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_patches=16,
                  patch_size=16)
    return _randomize(transformers.Siglip2Model(transformers.Siglip2Config(text_config=text, vision_config=vision)))
