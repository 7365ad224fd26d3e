"""`vit-export --text-tower`: a tiny open_clip CLIP (random weights, `open_clip.create_model(pretrained=None)`)
converted by `vit-serve convert`, exported with its text tower; NAME_text.onnx (onnxruntime) against open_clip's
own `encode_text`, the manifest against the open_clip model, and the refusal of a checkpoint without a tower."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

open_clip = pytest.importorskip("open_clip")
ort = pytest.importorskip("onnxruntime")

ARCH = "open_clip:ViT-B-32"
TEXTS = ["a photo of a cat.", "a photo of a dog.", "", "an origami crane on a desk", " ".join(["long"] * 100)]


def tiny_clip(randomize, seed: int = 0, **kw):
    """open_clip's CLIP at 64 px, width 64, 2 layers each tower, embed 32, random weights, logit scale 1/0.07."""
    m = open_clip.create_model("ViT-B-32", pretrained=None, embed_dim=32,
                               vision_cfg={"image_size": 64, "layers": 2, "width": 64, "patch_size": 32},
                               text_cfg={"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 8,
                                         "layers": 2}, **kw)
    randomize(m, seed)
    with torch.no_grad():
        m.logit_scale.fill_(math.log(1 / 0.07))
    return m.eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory, randomize):
    from vit_export.cli import main as export_main

    from vit_serve.cli import main as serve_main

    folder = tmp_path_factory.mktemp("text_tower")
    model = tiny_clip(randomize)
    torch.save(model.state_dict(), folder / "oc.pt")
    assert serve_main(["convert", str(folder / "oc.pt"), str(folder / "clip.safetensors"), "--arch", ARCH]) == 0
    out = folder / "out"
    assert export_main([str(folder / "clip.safetensors"), "--text-tower", "--out", str(out), "--name", "clip"]) == 0
    return model, out


def test_files_manifest_and_the_embedding_output(exported):
    model, out = exported
    for name in ("clip.onnx", "clip.json", "clip_explain.onnx", "clip_text.onnx", "clip_text.json"):
        assert (out / name).is_file(), name
    doc = json.loads((out / "clip_text.json").read_text())
    assert doc["tokenizer"]["kind"] == "open_clip" and doc["tokenizer"]["context_length"] == 77
    assert doc["logit_scale"] == pytest.approx(float(model.logit_scale.detach()), abs=1e-6)
    assert doc["logit_bias"] is None
    assert doc["scores"] == "softmax" and doc["embedding_dim"] == 32 and doc["templates"] == ["a photo of a {}."]
    assert doc["parity"]["ok"] and doc["parity"]["max_abs_err"] <= 1e-4
    bpe = out / doc["tokenizer"]["files"][0]
    assert bpe.read_bytes() == Path(open_clip.tokenizer.default_bpe()).read_bytes()
    image = ort.InferenceSession(str(out / "clip.onnx"), providers=["CPUExecutionProvider"])
    assert [o.name for o in image.get_outputs()] == ["logits", "embedding"]  # --text-tower adds the embedding
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    (emb,) = image.run(["embedding"], {"pixel_values": x.numpy()})
    with torch.no_grad():
        ref = model.encode_image(x).numpy()
    err = float(np.abs(emb - ref).max())
    print(f"image embedding (onnxruntime) vs open_clip encode_image: max |Δ| = {err:.2e}")
    assert err <= 1e-4


def test_text_graph_equals_open_clip_encode_text(exported):
    model, out = exported
    session = ort.InferenceSession(str(out / "clip_text.onnx"), providers=["CPUExecutionProvider"])
    (inp,), (outp,) = session.get_inputs(), session.get_outputs()
    assert (inp.name, inp.type, outp.name) == ("input_ids", "tensor(int64)", "text_embeds")
    ids = open_clip.tokenize(TEXTS)
    with torch.no_grad():
        ref = model.encode_text(ids).numpy()
    (batch,) = session.run(["text_embeds"], {"input_ids": ids.numpy()})
    (one,) = session.run(["text_embeds"], {"input_ids": ids[3:4].numpy()})  # the batch axis is dynamic
    err = max(float(np.abs(batch - ref).max()), float(np.abs(one - ref[3:4]).max()))
    print(f"text_embeds (onnxruntime) vs open_clip encode_text: max |Δ| = {err:.2e} over {len(TEXTS)} texts")
    assert batch.shape == (len(TEXTS), 32) and err <= 1e-4


def test_a_logit_bias_means_sigmoid_scores(randomize, tmp_path):
    """open_clip's CLIP with init_logit_bias (SigLIP's loss): the manifest keeps the bias, scores sigmoid."""
    from vit_export.text_tower import export_text_tower

    from vit_serve.text import read_text_tower

    model = tiny_clip(randomize, seed=2, init_logit_bias=-10.0)
    torch.save(model.state_dict(), tmp_path / "oc.pt")
    bundle = read_text_tower(tmp_path / "oc.pt", arch=ARCH)
    written = export_text_tower(bundle, None, tmp_path / "out", "sig", family="clip")
    assert written.ok and written.record.scores == "sigmoid"
    assert written.record.logit_bias == pytest.approx(float(model.logit_bias.detach()))


def test_a_checkpoint_without_a_text_tower_is_refused_with_exit_2(tmp_path, capsys):
    from vit_export.cli import main as export_main

    import vit_serve

    vit_serve.save(vit_serve.create_model("Ti/16", depth=2, num_classes=3, img_size=32), tmp_path / "plain.safetensors")
    out = tmp_path / "out"
    rc = export_main([str(tmp_path / "plain.safetensors"), "--text-tower", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "no text tower" in err and len(err.splitlines()) == 1
    assert not out.exists() or not any(out.iterdir())  # nothing written


def test_the_templates_of_convert_travel_into_the_text_manifest(randomize, tmp_path):
    """`vit-serve convert --zero-shot --templates` then `vit-export --text-tower`: NAME_text.json holds those
    templates (not only the default one), so that labels at request time are prompted as the head's were."""
    from vit_export.cli import main as export_main

    from vit_serve.cli import main as serve_main

    templates = ["a photo of a {}.", "a sketch of a {}.", "itap of my {}."]
    torch.save(tiny_clip(randomize, seed=4).state_dict(), tmp_path / "oc.pt")
    (tmp_path / "labels.txt").write_text("cat\ndog\n")
    (tmp_path / "templates.txt").write_text("\n".join(templates) + "\n")
    assert serve_main(["convert", str(tmp_path / "oc.pt"), str(tmp_path / "zs.safetensors"), "--arch", ARCH,
                       "--zero-shot", str(tmp_path / "labels.txt"), "--templates",
                       str(tmp_path / "templates.txt")]) == 0
    out = tmp_path / "out"
    assert export_main([str(tmp_path / "zs.safetensors"), "--text-tower", "--out", str(out), "--name", "zs"]) == 0
    assert json.loads((out / "zs_text.json").read_text())["templates"] == templates
