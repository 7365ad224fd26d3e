"""GET /explain?method=similarity and POST /embed?tokens=patch on the gateway (in-process, the torch backend): a tiny
open_clip CLIP (random weights) converted with --zero-shot, its text tower served from the checkpoint. The maps equal
`vit_serve.similarity` on the library's model for the same pixels and a query computed here with open_clip's own
text tower (text=), the head's row (label=) or the other image's embedding (query_id=); the cosine is open_clip's;
the patch tokens equal `patch_tokens`; the ONNX backend, POST, a bad query and too many floats answer 400."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gateway_helpers import run, serving, settings_for
from safetensors.torch import save_file

import vit_serve
from vit_serve.checkpoints import convert
from vit_serve.preprocess import preprocess
from vit_serve.similarity import patch_tokens, similarity_map

open_clip = pytest.importorskip("open_clip")
from tests.text import tiny_clip  # noqa: E402

JPEG = {"Content-Type": "image/jpeg"}
LABELS = ["tabby cat", "espresso", "astronaut"]


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """(the converted zero-shot checkpoint, the library's model of it, open_clip's model)."""
    folder = tmp_path_factory.mktemp("simroute")
    tiny_clip.register(folder)
    ref = tiny_clip.randomized("tiny-clip", seed=7)
    save_file(tiny_clip.state_dict(ref), folder / "oc.safetensors")
    dst = folder / "zs.safetensors"
    convert(folder / "oc.safetensors", dst, arch="open_clip:tiny-clip", zero_shot=LABELS)
    return dst, vit_serve.load(dst).eval(), ref


def _pixels(model, data: bytes) -> torch.Tensor:
    return preprocess(data, model.preprocess_cfg)[None]


def test_similarity_maps_equal_the_library(clip, photos):
    ckpt, model, ref = clip
    cat, coffee = photos["chelsea.jpg"], photos["coffee.jpg"]

    async def scenario():
        async with serving(settings_for(ckpt)) as (client, _):
            a = (await client.post("/classify", content=cat, headers=JPEG)).json()["id"]
            b = (await client.post("/embed", content=coffee, headers=JPEG)).json()["id"]
            base = f"/explain?id={a}&method=similarity&format=json"
            return [await client.get(base + q) for q in ("&text=tabby cat", "&label=espresso", f"&query_id={b}",
                                                         "&label=espresso&rollout=true&discard_ratio=0",
                                                         "&text=tabby cat&format=png")]

    text, label, image, times, png = run(scenario())
    for r in (text, label, image, times, png):
        assert r.status_code == 200, r.text
    x, y = _pixels(model, cat), _pixels(model, coffee)
    tok = open_clip.get_tokenizer("tiny-clip")
    with torch.no_grad():
        q_text = ref.encode_text(tok(["a photo of a tabby cat."]))[0]
        q_label = model.head.weight[1]
        q_image = model.forward_embedding(y)[1][0]
        open_clip_cosine = F.cosine_similarity(ref.encode_image(x), q_text[None])[0]
        rollout = vit_serve.explain.explain_forward(model, x, "mean", 0.0).heatmap.map
    for r, q, kind in ((text, q_text, "text"), (label, q_label, "label"), (image, q_image, "image")):
        body = r.json()
        with torch.no_grad():
            want = similarity_map(model, x, q)
        assert body["method"] == "similarity" and body["query"] == kind and body["grid"] == [4, 4]
        np.testing.assert_allclose(np.array(body["map"]), want.map[0].numpy(), atol=1e-5)
        assert body["cosine"] == pytest.approx(float(want.cosine[0]), abs=1e-5)
        assert np.sum(body["map"]) + body["rest"] == pytest.approx(body["cosine"], abs=1e-5)
    assert text.json()["cosine"] == pytest.approx(float(open_clip_cosine), abs=1e-5)
    with torch.no_grad():
        want = similarity_map(model, x, q_label).map * rollout / rollout.max()
    np.testing.assert_allclose(np.array(times.json()["map"]), want[0].numpy(), atol=1e-5)
    assert png.headers["content-type"] == "image/png" and png.content[:4] == b"\x89PNG"


def test_patch_tokens_equal_the_library(clip, photos):
    ckpt, model, _ = clip
    cat = photos["chelsea.jpg"]

    async def scenario():
        async with serving(settings_for(ckpt)) as (client, _):
            return [await client.post(f"/embed?{q}", content=cat, headers=JPEG)
                    for q in ("tokens=patch", "tokens=patch&layer=0", "tokens=patch&layer=2", "")]

    last, first, beyond, plain = run(scenario())
    assert last.status_code == first.status_code == plain.status_code == 200
    x = _pixels(model, cat)
    with torch.no_grad():
        for r, layer in ((last, 1), (first, 0)):
            body = r.json()
            assert body["layer"] == layer and body["grid"] == [4, 4]
            np.testing.assert_allclose(np.array(body["patch_tokens"]), patch_tokens(model, x, layer)[0].numpy(),
                                       atol=1e-5)
            assert body["embedding"] == plain.json()["embedding"]
    assert "patch_tokens" not in plain.json()
    assert beyond.status_code == 400 and "layer must be from -2 to 1" in beyond.json()["detail"]


def test_refusals(clip, photos, tiny_onnx):
    ckpt, _, _ = clip
    cat = photos["chelsea.jpg"]

    async def on_torch():
        async with serving(settings_for(ckpt, max_patch_token_floats=100)) as (client, _):
            a = (await client.post("/classify", content=cat, headers=JPEG)).json()["id"]
            return [await client.get(f"/explain?id={a}&method=similarity&{q}")
                    for q in ("text=a&label=espresso", "", "label=teapot")] + [
                await client.post("/explain?method=similarity&label=espresso", content=cat, headers=JPEG),
                await client.post("/embed?tokens=patch", content=cat, headers=JPEG)]

    async def on_onnx():
        async with serving(settings_for(tiny_onnx)) as (client, _):
            a = (await client.post("/classify", content=cat, headers=JPEG)).json()["id"]
            return [await client.get(f"/explain?id={a}&method=similarity&query_id={a}"),
                    await client.post("/embed?tokens=patch", content=cat, headers=JPEG)]

    two, none, unknown, posted, floats = run(on_torch())
    assert two.status_code == 400 and "exactly one of" in two.json()["detail"]
    assert none.status_code == 400 and "(got none)" in none.json()["detail"]
    assert unknown.status_code == 422 and "teapot" in unknown.json()["detail"]
    assert posted.status_code == 400 and "GET /explain?id=" in posted.json()["detail"]
    assert floats.status_code == 400 and "VIT_SERVE_MAX_PATCH_TOKEN_FLOATS = 100" in floats.json()["detail"]
    for r in run(on_onnx()):
        assert r.status_code == 400 and "needs the torch backend" in r.json()["detail"], r.text


def test_v1_embeddings_patch_tokens(clip, photos):
    """POST /v1/embeddings with "tokens": "patch" (the SDK's extra_body): each image item's tokens equal the
    library's, as floats and as base64; text items have none; beyond the floats bound a 400 in OpenAI's shape."""
    import base64

    ckpt, model, _ = clip
    cat = photos["chelsea.jpg"]
    uri = "data:image/jpeg;base64," + base64.b64encode(cat).decode()
    body = {"input": [uri, "a photo of a cat", uri], "tokens": "patch", "layer": 0}

    async def scenario():
        async with serving(settings_for(ckpt, max_patch_token_floats=2 * 16 * 64)) as (client, _):
            return [await client.post("/v1/embeddings", json={**body, **extra})
                    for extra in ({}, {"encoding_format": "base64"}, {"input": [uri] * 3})]

    floats, b64, over = run(scenario())
    assert floats.status_code == b64.status_code == 200, floats.text
    with torch.no_grad():
        want = patch_tokens(model, _pixels(model, cat), 0)[0].numpy()
    image, text = floats.json()["data"][:2]
    assert image["layer"] == 0 and image["grid"] == [4, 4]
    np.testing.assert_allclose(np.array(image["patch_tokens"]), want, atol=1e-5)
    assert "patch_tokens" not in text
    packed = np.frombuffer(base64.b64decode(b64.json()["data"][2]["patch_tokens"]), "<f4").reshape(16, 64)
    np.testing.assert_allclose(packed, want, atol=1e-5)
    assert over.status_code == 400 and "MAX_PATCH_TOKEN_FLOATS" in over.json()["error"]["message"]
