"""The gateway with the torch backend on the 2025-26 encoders: an open_clip PE-Core tower (RoPE, MAP pool; random
weights, a one-layer text tower) converted with `--zero-shot` so that its text tower comes along, and a timm DINOv3
(RoPE only, registers; its embedding is the [class] token) converted from the hub folder timm writes. ?labels=
runs the text tower of NAME_text.onnx beside the checkpoint (`pe`: written by the call `vit-export --text-tower`
makes, vit_export.text_tower), or, with none there, the one the checkpoint stores, with torch (`pe_stored`: the
same file under another name). References:
open_clip's `encode_image` and its zero-shot recipe (normalise, mean over the templates, renormalise,
logit_scale.exp(), softmax), timm's `forward_features` class token after the final norm, on the pixels
`vit_serve.preprocess` makes of each upload (the gateway decodes by the model's contract)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gateway_helpers import run, serving, settings_for
from rope_models import dinov3_hub
from safetensors.torch import save_file

import vit_serve
from vit_serve.checkpoints import convert
from vit_serve.preprocess import preprocess

open_clip = pytest.importorskip("open_clip")
timm = pytest.importorskip("timm")
from tests.text import tiny_clip  # noqa: E402

PE = "PE-Core-T-16-384"

LABELS = ["an astronaut", "a cup of coffee", "a tabby cat", "a lighthouse"]
ASKED = ["a cat", "coffee", "a rocket"]  # ?labels=, not the baked head's
TEMPLATES = ["a photo of {}.", "itap of {}."]
TOL = 1e-4


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """(folder with pe.safetensors and dinov3.safetensors, open_clip's PE-Core, timm's DINOv3)."""
    from vit_export.text_tower import export_text_tower, load_text_bundle

    folder = tmp_path_factory.mktemp("rope_gateway")
    pe = tiny_clip.randomized(PE, seed=41, text_cfg={**open_clip.get_model_config(PE)["text_cfg"], "layers": 1})
    save_file(tiny_clip.state_dict(pe), folder / "pe_open_clip.safetensors")
    convert(folder / "pe_open_clip.safetensors", folder / "repo" / "pe.safetensors", arch=f"open_clip:{PE}",
            zero_shot=LABELS, templates=TEMPLATES)
    pe_ckpt = folder / "repo" / "pe.safetensors"
    written = export_text_tower(load_text_bundle(pe_ckpt), pe_ckpt, folder / "repo", "pe", family="pe")
    assert written.ok and written.record.templates == tuple(TEMPLATES)
    (folder / "repo" / "pe_stored.safetensors").write_bytes(pe_ckpt.read_bytes())
    dino = dinov3_hub(folder / "dino_hub", seed=3)
    convert(folder / "dino_hub", folder / "repo" / "dinov3.safetensors")
    return folder / "repo", pe, dino


@pytest.fixture(scope="module")
def answers(repo, photos):
    folder, _, _ = repo

    async def go():
        got = {}
        async with serving(settings_for(folder, default_model="pe")) as (client, _):
            for name, data in photos.items():
                got[name] = {
                    "pe_embed": await client.post("/embed?model=pe", files={"file": (name, data)}),
                    "pe_head": await client.post("/classify?model=pe&top_k=4", files={"file": (name, data)}),
                    "pe_labels": await client.post(f"/classify?model=pe&top_k=3&labels={','.join(ASKED)}",
                                                   files={"file": (name, data)}),
                    "dino_embed": await client.post("/embed?model=dinov3", files={"file": (name, data)}),
                    "stored_labels": await client.post(f"/classify?model=pe_stored&top_k=3&labels={','.join(ASKED)}",
                                                       files={"file": (name, data)}),
                    "dino_labels": await client.post("/classify?model=dinov3&labels=a,b",
                                                     files={"file": (name, data)}),
                }
        return got

    return run(go())


def _pixels(ckpt, data: bytes) -> torch.Tensor:
    return preprocess(data, vit_serve.load(ckpt).preprocess_cfg)[None]


@torch.no_grad()
def _zero_shot(pe, x: torch.Tensor, labels: list[str]) -> np.ndarray:
    """open_clip's recipe: softmax over logit_scale.exp() x cos(image, mean of normalised template embeddings)."""
    tok = open_clip.get_tokenizer(PE)
    weights = [F.normalize(F.normalize(pe.encode_text(tok([t.format(c) for t in TEMPLATES])), dim=-1).mean(0), dim=-1)
               for c in labels]
    logits = pe.logit_scale.exp() * F.normalize(pe.encode_image(x), dim=-1) @ torch.stack(weights).T
    return logits.softmax(-1)[0].double().numpy()


def _check_scores(r, want: np.ndarray, labels: list[str]) -> float:
    assert r.status_code == 200, r.text
    preds = r.json()["predictions"]
    assert [p["label"] for p in preds] == [labels[i] for i in np.argsort(-want, kind="stable")][: len(preds)]
    return max(abs(p["score"] - want[labels.index(p["label"])]) for p in preds)


def test_pe_core_embed_and_labels_equal_open_clip(repo, answers, photos):
    folder, pe, _ = repo
    for name, got in answers.items():
        x = _pixels(folder / "pe.safetensors", photos[name])
        with torch.no_grad():
            want = pe.encode_image(x)[0].double().numpy()
        e = got["pe_embed"]
        assert e.status_code == 200, e.text
        emb = np.asarray(e.json()["embedding"])
        emb_err = float(np.abs(emb - want).max())  # encode_image itself: projected, not normalised
        head_err = _check_scores(got["pe_head"], _zero_shot(pe, x, LABELS), LABELS)
        labels_err = _check_scores(got["pe_labels"], _zero_shot(pe, x, ASKED), ASKED)
        stored_err = _check_scores(got["stored_labels"], _zero_shot(pe, x, ASKED), ASKED)
        print(f"PE-Core {name}: |Δ embedding| {emb_err:.2e} (norm {np.linalg.norm(emb):.3f}), |Δ score| baked head "
              f"{head_err:.2e}, ?labels= {labels_err:.2e} (ONNX text tower), {stored_err:.2e} (the checkpoint's)")
        assert e.json()["dim"] == want.shape[0] and max(emb_err, head_err, labels_err, stored_err) <= TOL
        no_text = got["dino_labels"]
        assert no_text.status_code == 400 and "no text tower" in no_text.json()["detail"]


def test_dinov3_embed_is_timms_class_token(repo, answers, photos):
    folder, _, dino = repo
    cfg = vit_serve.load(folder / "dinov3.safetensors").cfg
    assert cfg.pos_embed is False and cfg.rope is not None and cfg.pool == "token"
    for name, got in answers.items():
        x = _pixels(folder / "dinov3.safetensors", photos[name])
        with torch.no_grad():
            want = dino.forward_features(x)[0, 0].double().numpy()  # the [class] token after the final norm
        e = got["dino_embed"]
        assert e.status_code == 200, e.text
        err = float(np.abs(np.asarray(e.json()["embedding"]) - want).max())
        print(f"DINOv3 {name}: |Δ embedding| {err:.2e} (max |e| {np.abs(want).max():.2f})")
        assert err <= TOL and e.json()["dim"] == 96
