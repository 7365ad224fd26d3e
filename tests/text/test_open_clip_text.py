"""open_clip text towers and tokenizers -> vit_serve.text. Reference: open_clip's `encode_text` and
`get_tokenizer` (tiny configs of tests/text/tiny_clip.py, random weights); our checkpoint carries the tower."""

import pytest
import torch
from safetensors.torch import save_file

import vit_serve
from vit_serve.checkpoints import convert
from vit_serve.cli import main
from vit_serve.text import OpenClipTokenizer, TokenizerError, load_text_tower, read_text_tower, tokenizer_from_spec

open_clip = pytest.importorskip("open_clip")
from tests.text import tiny_clip  # noqa: E402

TEXTS = ["a photo of a cat.", "Dog", "an extremely long caption that will not fit " * 4, ""]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("oc")
    tiny_clip.register(folder)
    out = {}
    for name in ("tiny-clip", "tiny-sl-like", "tiny-siglip-hf-tok"):
        # the same architecture; creating the hf-tok config in open_clip would fetch its tokenizer
        ref = out["tiny-sl-like"][0] if name == "tiny-siglip-hf-tok" else tiny_clip.randomized(name)
        (folder / name).mkdir()
        path = folder / name / "open_clip.safetensors"
        save_file(tiny_clip.state_dict(ref), path)
        out[name] = (ref, path)
    return out


@pytest.mark.parametrize("name", ["tiny-clip", "tiny-sl-like"])
def test_encode_text_and_tokenizer_parity(files, name):
    ref, path = files[name]
    bundle = read_text_tower(path, arch=f"open_clip:{name}")
    ids = open_clip.get_tokenizer(name)(TEXTS)
    assert torch.equal(bundle.tokenize(TEXTS), ids)
    with torch.no_grad():
        expected = ref.encode_text(ids)
    assert (bundle.encode(TEXTS) - expected).abs().max() <= 1e-5
    assert bundle.logit_scale == pytest.approx(float(ref.logit_scale.detach()))
    assert (bundle.logit_bias is not None) == (name == "tiny-sl-like")
    cfg = bundle.config
    assert (cfg.causal, cfg.pool, cfg.proj_bias) == ((True, "argmax", False) if name == "tiny-clip"
                                                     else (False, "last", True))


def test_checkpoint_carries_the_text_tower(files, tmp_path):
    ref, path = files["tiny-sl-like"]
    dst = tmp_path / "ours.safetensors"
    convert(path, dst, arch="open_clip:tiny-sl-like")
    bundle = load_text_tower(dst)
    ids = open_clip.get_tokenizer("tiny-sl-like")(TEXTS)
    with torch.no_grad():
        assert (bundle.encode(TEXTS) - ref.encode_text(ids)).abs().max() <= 1e-5
        assert (vit_serve.load(dst).forward_embedding(torch.zeros(1, 3, 32, 32))[1]
                - ref.encode_image(torch.zeros(1, 3, 32, 32))).abs().max() <= 1e-5
    assert bundle.logit_bias == pytest.approx(-2.5)
    assert read_text_tower(dst).config == bundle.config
    again = tmp_path / "again.safetensors"  # our format in, our format out: the tower is kept
    convert(dst, again)
    assert load_text_tower(again).config == bundle.config


def test_image_only_checkpoint_has_no_tower(tmp_path):
    dst = tmp_path / "vit.safetensors"
    vit_serve.save(vit_serve.create_model("Ti/16", img_size=32, depth=1, num_classes=3), dst)
    assert load_text_tower(dst) is None and read_text_tower(dst) is None


def test_hf_tokenizer_not_local(files, tmp_path, capsys):
    """open_clip's SigLIP configs name a Hugging Face tokenizer: without its tokenizer.json beside the weights,
    one line naming the file; `convert` still converts the image tower and says the text tower is not kept."""
    _, path = files["tiny-siglip-hf-tok"]
    with pytest.raises(TokenizerError, match=r"tokenizer\.json") as e:
        read_text_tower(path, arch="open_clip:tiny-siglip-hf-tok")
    assert "\n" not in str(e.value) and "timm/ViT-B-16-SigLIP" in str(e.value)
    dst = tmp_path / "image_only.safetensors"
    assert main(["convert", str(path), str(dst), "--arch", "open_clip:tiny-siglip-hf-tok"]) == 0
    assert "text tower not kept" in capsys.readouterr().err and load_text_tower(dst) is None
    labels = tmp_path / "labels.txt"
    labels.write_text("cat\ndog\n")
    dst2 = tmp_path / "zs.safetensors"
    assert main(["convert", str(path), str(dst2), "--arch", "open_clip:tiny-siglip-hf-tok", "--zero-shot",
                 str(labels)]) == 2
    err = capsys.readouterr().err.strip()
    assert "tokenizer.json" in err and len(err.splitlines()) == 1 and not dst2.exists()


def test_tokenizer_spec_round_trip(tmp_path):
    import gzip
    import shutil

    from open_clip.tokenizer import default_bpe

    tok = OpenClipTokenizer(16)
    assert tok.to_spec() == {"kind": "open_clip", "context_length": 16, "clean": "lower"}
    copy = tmp_path / "bpe.txt.gz"
    shutil.copy(default_bpe(), copy)
    with gzip.open(copy) as f:
        assert f.read(10)
    again = tokenizer_from_spec(OpenClipTokenizer(16, bpe_path=str(copy)).to_spec())
    assert torch.equal(again(TEXTS), tok(TEXTS))
    with pytest.raises(TokenizerError, match="missing"):
        OpenClipTokenizer(16, bpe_path=str(tmp_path / "nope.gz"))
