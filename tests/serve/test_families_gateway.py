"""The gateway (the real app, as tests/serve/conftest.py) and `vit-serve predict --embeddings` on a register model
(DINOv2-reg) and an attention-pooled one with sigmoid scores (SigLIP), each a tiny timm model with random weights
(tests/family_models.py) saved as a vit-serve checkpoint. References: timm's logits and `forward_head(pre_logits=
True)` on the pixels `vit_serve.preprocess` makes of each upload; sigmoid(logit) as SigLIP's score;
`vit_serve.explain.rollout` of the model's full attention list (the MAP probe last)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gateway_helpers import run, serving, settings_for

import vit_serve
from tests.family_models import FAMILIES, ours, reference, timm_model
from vit_serve.preprocess import preprocess

pytest.importorskip("timm")

TOL = 1e-5
KEYS = ("dinov2_reg", "siglip")


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """key -> (family, timm model, checkpoint path)."""
    out, done = tmp_path_factory.mktemp("families"), {}
    for key in KEYS:
        fam = FAMILIES[key]
        ref = timm_model(fam)
        done[key] = (fam, ref, vit_serve.save(ours(fam, ref), out / f"{key}.safetensors"))
    return done


@pytest.fixture(scope="module")
def answers(families, photos):
    """Per family: /classify, /embed, /explain?id= (json) and /v2 infer answers for each photo."""
    async def go(ckpt):
        got = {}
        async with serving(settings_for(ckpt)) as (client, _):
            for name, data in photos.items():
                c = await client.post("/classify?top_k=5", files={"file": (name, data)})
                e = await client.post("/embed", files={"file": (name, data)})
                x = await client.get(f"/explain?id={e.json()['id']}&format=json")
                png = await client.get(f"/explain?id={e.json()['id']}")
                got[name] = (c, e, x, png)
            meta = await client.get(f"/v2/models/{Path(ckpt).stem}")
        return got, meta

    return {key: run(go(ckpt)) for key, (_, _, ckpt) in families.items()}


def _pixels(ckpt: Path, data: bytes) -> torch.Tensor:
    return preprocess(data, vit_serve.load(ckpt).preprocess_cfg)[None]


@pytest.mark.parametrize("key", KEYS)
def test_classify_and_embed_equal_timm(families, answers, photos, key):
    fam, ref, ckpt = families[key]
    model = vit_serve.load(ckpt).eval()
    got, _ = answers[key]
    for name, (c, e, _, _) in got.items():
        assert c.status_code == 200 and e.status_code == 200, (c.text, e.text)
        logits, emb = (t[0].numpy().astype(np.float64) for t in reference(fam, ref, model, _pixels(ckpt, photos[name])))
        preds = c.json()["predictions"]
        want = 1 / (1 + np.exp(-logits)) if key == "siglip" else np.exp(logits - logits.max()) / np.exp(
            logits - logits.max()).sum()
        assert [p["index"] for p in preds] == list(np.argsort(-logits, kind="stable"))
        err = max(abs(p["score"] - want[p["index"]]) for p in preds)
        emb_err = float(np.abs(np.array(e.json()["embedding"]) - emb).max())
        print(f"{key} {name}: |d score| {err:.2e} ({'sigmoid' if key == 'siglip' else 'softmax'}), "
              f"|d embedding| {emb_err:.2e}")
        assert err <= TOL and emb_err <= TOL and e.json()["dim"] == model.cfg.embed_dim_out
        if key == "siglip":
            assert abs(sum(p["score"] for p in preds) - 1) > 1e-3  # not a softmax


@pytest.mark.parametrize("key", KEYS)
def test_explain_equals_the_librarys_rollout(families, answers, photos, key):
    from vit_serve.explain import DEFAULT_DISCARD_RATIO, DEFAULT_HEAD_FUSION, rollout

    fam, _, ckpt = families[key]
    model = vit_serve.load(ckpt).eval()
    got, _ = answers[key]
    p = fam.options["patch_size"]
    for name, (_, _, x, png) in got.items():
        assert png.status_code == 200 and png.headers["content-type"] == "image/png"
        with torch.no_grad():
            _, attentions = model(_pixels(ckpt, photos[name]), return_attention=True)
        want = rollout(attentions, (fam.img // p, fam.img // p), model.num_prefix_tokens, model.cfg.pool,
                       DEFAULT_HEAD_FUSION, DEFAULT_DISCARD_RATIO).map[0].numpy()
        assert x.status_code == 200, x.text
        assert x.json()["query"] == ("map-probe" if model.cfg.pool == "map" else "cls")
        assert np.abs(np.array(x.json()["map"]) - want).max() <= TOL


@pytest.mark.parametrize("key", KEYS)
def test_v2_logits_and_embedding(families, answers, photos, key):
    fam, ref, ckpt = families[key]
    _, meta = answers[key]
    outputs = {o["name"]: o["shape"] for o in meta.json()["outputs"]}
    model = vit_serve.load(ckpt).eval()
    assert outputs["embedding"] == [-1, model.cfg.embed_dim_out]
    x = _pixels(ckpt, next(iter(photos.values())))
    request = {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": list(x.shape),
                           "data": x.flatten().tolist()}],
               "outputs": [{"name": "logits"}, {"name": "embedding"}]}

    async def go():
        async with serving(settings_for(ckpt)) as (client, _):
            return await client.post(f"/v2/models/{ckpt.stem}/infer", json=request)

    r = run(go())
    assert r.status_code == 200, r.text
    got = {o["name"]: np.array(o["data"]) for o in r.json()["outputs"]}
    logits, emb = (t[0].numpy() for t in reference(fam, ref, model, x))
    assert np.abs(got["logits"] - logits).max() <= TOL and np.abs(got["embedding"] - emb).max() <= TOL


@pytest.mark.parametrize("key", KEYS)
def test_predict_embeddings_equal_the_models(families, photos, tmp_path, key):
    from vit_serve.cli import main

    fam, ref, ckpt = families[key]
    folder = tmp_path / "imgs"
    folder.mkdir()
    for name, data in photos.items():
        (folder / name).write_bytes(data)
    out = tmp_path / "p.jsonl"
    assert main(["predict", str(ckpt), str(folder), "--out", str(out), "--embeddings", "--threads", "1",
                 "--quiet"]) == 0
    model = vit_serve.load(ckpt).eval()
    fast = model.preprocess_cfg.with_decode("fast")  # predict's default decode path
    for row in map(json.loads, out.read_text().splitlines()):
        x = preprocess(Path(row["path"]).read_bytes(), fast)[None]
        with torch.no_grad():
            want = model.forward_embedding(x)[1][0].numpy()
        assert np.abs(np.array(row["embedding"]) - want).max() <= TOL
        assert np.abs(np.array(row["embedding"]) - reference(fam, ref, model, x)[1][0].numpy()).max() <= TOL


def test_grpc_embedding_and_rollout_of_siglip(families, photos):
    """The Open Inference Protocol over gRPC (tritonclient.grpc): SigLIP's embedding and its rollout map (the
    MAP probe's) in one request, against timm and the library's rollout."""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from gateway_helpers import live_app

    from vit_serve.explain import DEFAULT_DISCARD_RATIO, DEFAULT_HEAD_FUSION, rollout

    fam, ref, ckpt = families["siglip"]
    model = vit_serve.load(ckpt).eval()
    x = torch.cat([_pixels(ckpt, b) for b in photos.values()])
    want_emb = reference(fam, ref, model, x)[1].numpy()
    with torch.no_grad():
        _, attentions = model(x, return_attention=True)
    want_map = rollout(attentions, (2, 2), 0, "map", DEFAULT_HEAD_FUSION, DEFAULT_DISCARD_RATIO).map.numpy()
    images = np.array(list(photos.values()), dtype=object)
    with live_app(settings_for(ckpt, grpc_port=0)) as (_, app):
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{app.state.grpc.port}")
        inp = grpcclient.InferInput("image", [len(images)], "BYTES")
        inp.set_data_from_numpy(images)
        got = client.infer(ckpt.stem, [inp], outputs=[grpcclient.InferRequestedOutput("embedding"),
                                                       grpcclient.InferRequestedOutput("rollout")])
        client.close()
    assert np.abs(got.as_numpy("embedding") - want_emb).max() <= TOL
    assert np.abs(got.as_numpy("rollout") - want_map).max() <= TOL
