"""Zero-shot heads from label text. Reference: open_clip's recipe computed here independently (open_clip's
tokenizer + encode_text + encode_image; normalise, mean over templates, renormalise, logit_scale.exp(), + logit_bias)
on tiny open_clip models with random weights: a CLIP config and a SigLIP-like config (SigLIP's bidirectional,
last-token text tower with projection bias and a logit bias, on open_clip's own ViT, with the CLIP tokenizer;
tests/text/tiny_clip.py)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import vit_serve
from vit_serve.checkpoints import convert
from vit_serve.cli import main
from vit_serve.text import load_text_tower
from vit_serve.zeroshot import ZeroShotError, check_templates, class_embeddings, label_logits, prompts

open_clip = pytest.importorskip("open_clip")
from tests.text import tiny_clip  # noqa: E402

LABELS = ["cat", "dog", "traffic light"]
TEMPLATES = ["a photo of a {}.", "a blurry photo of the {}.", "{}"]
X = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(4))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zs")
    tiny_clip.register(folder)
    out = {}
    for name in ("tiny-clip", "tiny-sl-like"):
        ref = tiny_clip.randomized(name)
        path = folder / f"{name}.safetensors"
        save_file(tiny_clip.state_dict(ref), path)
        out[name] = (ref, path)
    return out


@torch.no_grad()
def open_clip_recipe(ref, name, x, labels, templates):
    """open_clip.zero_shot_classifier's recipe, then CLIP.get_logits' scale (and SigLIP's bias)."""
    tok = open_clip.get_tokenizer(name)
    weights = []
    for label in labels:
        emb = F.normalize(ref.encode_text(tok([t.format(label) for t in templates])), dim=-1)
        weights.append(F.normalize(emb.mean(dim=0), dim=-1))
    image = F.normalize(ref.encode_image(x), dim=-1)
    logits = ref.logit_scale.exp() * image @ torch.stack(weights).T
    return logits + ref.logit_bias if ref.logit_bias is not None else logits


def test_class_embeddings_math():
    """The one recipe (numpy) against torch's normalize: prompts label-major, [C * T, E] -> [C, E], logits."""
    assert prompts(["cat", "dog"], ["a {}", "{}!"]) == ["a cat", "cat!", "a dog", "dog!"]
    e = torch.randn(4, 3, 8)
    expected = torch.stack([F.normalize(F.normalize(e[c], dim=-1).mean(0), dim=0) for c in range(4)])
    got = class_embeddings(e.reshape(12, 8).numpy(), 3)
    assert got.dtype == np.float32
    assert torch.allclose(torch.from_numpy(got), expected, atol=1e-7)
    img = torch.randn(2, 8)
    logits = label_logits(img.numpy(), expected.numpy(), 2.0, -1.0)
    assert torch.allclose(torch.from_numpy(logits),
                          torch.tensor(2.0).exp() * F.normalize(img, dim=-1) @ expected.T - 1.0, atol=1e-6)


@pytest.mark.parametrize("name", ["tiny-clip", "tiny-sl-like"])
def test_zero_shot_logits_equal_open_clip_recipe(sources, name, tmp_path):
    ref, src = sources[name]
    dst = tmp_path / "zs.safetensors"
    convert(src, dst, arch=f"open_clip:{name}", zero_shot=LABELS, templates=TEMPLATES)
    model = vit_serve.load(dst)
    with torch.no_grad():
        logits = model(X)
    expected = open_clip_recipe(ref, name, X, LABELS, TEMPLATES)
    assert (logits - expected).abs().max() <= 1e-5
    assert model.labels == LABELS and model.cfg.embed_norm and model.cfg.num_classes == 3
    assert model.cfg.scores == ("softmax" if name == "tiny-clip" else "sigmoid")
    assert load_text_tower(dst) is not None  # the tower stays for ?labels=


def test_cli_zero_shot_default_template(sources, tmp_path, capsys):
    ref, src = sources["tiny-clip"]
    labels = tmp_path / "labels.txt"
    labels.write_text("cat\n\ndog\n")
    dst = tmp_path / "zs.safetensors"
    assert main(["convert", str(src), str(dst), "--arch", "open_clip:tiny-clip", "--zero-shot", str(labels)]) == 0
    assert "zero-shot head (softmax)" in capsys.readouterr().out
    with torch.no_grad():
        logits = vit_serve.load(dst)(X)
    expected = open_clip_recipe(ref, "tiny-clip", X, ["cat", "dog"], ["a photo of a {}."])
    assert (logits - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("labels, templates, message", [
    ("", None, "no labels"),
    ("cat\ncat\n", None, "duplicate labels: cat"),
    ("cat\n", "a photo\n", "needs exactly one {}"),
    (None, None, "cannot read the labels file"),
])
def test_cli_bad_input(sources, tmp_path, capsys, labels, templates, message):
    _, src = sources["tiny-clip"]
    args = ["convert", str(src), str(tmp_path / "out.safetensors"), "--arch", "open_clip:tiny-clip"]
    lf = tmp_path / "labels.txt"
    if labels is not None:
        lf.write_text(labels)
    args += ["--zero-shot", str(lf)]
    if templates is not None:
        (tmp_path / "t.txt").write_text(templates)
        args += ["--templates", str(tmp_path / "t.txt")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out.safetensors").exists()


def test_cli_no_text_tower(tmp_path, capsys):
    src = tmp_path / "vit.safetensors"
    vit_serve.save(vit_serve.create_model("Ti/16", img_size=32, depth=1, num_classes=3), src)
    (tmp_path / "labels.txt").write_text("cat\ndog\n")
    dst = tmp_path / "out.safetensors"
    assert main(["convert", str(src), str(dst), "--zero-shot", str(tmp_path / "labels.txt")]) == 2
    err = capsys.readouterr().err.strip()
    assert "has no text tower" in err and len(err.splitlines()) == 1 and not dst.exists()
    assert main(["convert", str(src), str(dst), "--templates", str(tmp_path / "labels.txt")]) == 2
    with pytest.raises(ZeroShotError):
        check_templates(["{} and {}"])
