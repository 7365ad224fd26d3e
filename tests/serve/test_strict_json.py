"""Strict JSON (RFC 8259) on every route when the model's outputs are not finite, as from an fp16 engine that
overflows: real PyTorch models whose weights hold inf / NaN, served by the gateway (torch backend). Each JSON
body is parsed with a parser that refuses the `NaN` / `Infinity` tokens (Python's json.loads with
parse_constant raising, as orjson or JSON.parse would); non-finite numbers must come out as null, finite ones
unchanged, and the /v2 binary tensor extension must carry the exact IEEE values.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from gateway_helpers import RES, run, serving, settings_for
from PIL import Image

import vit_serve
from vit_serve.preprocess import preprocess

INF, NAN = float("inf"), float("nan")


def _strict(text: str | bytes):
    def refuse(token: str):
        raise ValueError(f"not RFC 8259 JSON: {token}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def image() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def non_finite_head(tmp_path_factory, randomize):
    """Logits 0, 1, 2 are +inf, -inf and NaN (the head's biases); the other seven are finite."""
    model = randomize(vit_serve.create_model("Ti/16", depth=2, num_classes=10, img_size=RES), seed=5)
    with torch.no_grad():
        model.head.bias[:3] = torch.tensor([INF, -INF, NAN])
    path = tmp_path_factory.mktemp("nonfinite") / "head.safetensors"
    vit_serve.save(model, path)
    return path, vit_serve.load(path).eval()


@pytest.fixture(scope="module")
def nan_attention(tmp_path_factory, randomize):
    """The last block's qkv bias is NaN: every attention weight, the rollout map and the logits are NaN."""
    model = randomize(vit_serve.create_model("Ti/16", depth=2, num_classes=10, img_size=RES), seed=6)
    with torch.no_grad():
        model.blocks[-1].attn.qkv.bias.fill_(NAN)
    path = tmp_path_factory.mktemp("nonfinite") / "attention.safetensors"
    vit_serve.save(model, path)
    return path, vit_serve.load(path).eval()


def _v2_request(x: np.ndarray, binary: bool) -> dict:
    return {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": list(x.shape),
                        "data": x.ravel().tolist()}], "parameters": {"binary_data_output": binary}}


def _binary_outputs(r) -> dict[str, np.ndarray]:
    n = int(r.headers["inference-header-content-length"])
    header, offset, out = _strict(r.content[:n]), n, {}
    for o in header["outputs"]:
        size = o["parameters"]["binary_data_size"]
        out[o["name"]] = np.frombuffer(r.content[offset:offset + size], "<f4").reshape(o["shape"])
        offset += size
    return out


def test_non_finite_logits_are_null_in_json_and_exact_in_binary(non_finite_head, image):
    path, model = non_finite_head
    x = preprocess(image, model.preprocess_cfg)[None]
    with torch.no_grad():
        want = model(x)[0].numpy()
    assert np.isposinf(want[0]) and np.isneginf(want[1]) and np.isnan(want[2]) and np.isfinite(want[3:]).all()

    async def scenario():
        async with serving(settings_for(path, model_name="nonfinite")) as (client, _):
            kind = {"Content-Type": "image/png"}
            return (await client.post("/classify?top_k=10", content=image, headers=kind),
                    await client.post("/explain?format=json", content=image, headers=kind),
                    await client.post("/v2/models/nonfinite/infer", json=_v2_request(x.numpy(), False)),
                    await client.post("/v2/models/nonfinite/infer", json=_v2_request(x.numpy(), True)))

    classify, explain, v2_json, v2_binary = run(scenario())
    for r in (classify, explain, v2_json):
        assert r.status_code == 200, r.text
    body = _strict(classify.text)
    # Ranked by logit (+inf first, -inf and NaN last); the softmax of an inf or NaN logit is undefined: null.
    assert [p["index"] for p in body["predictions"]] == [0, *np.argsort(-want[3:]) + 3, 1, 2]
    assert all(p["score"] is None for p in body["predictions"])
    assert all(p["score"] is None for p in _strict(explain.text)["predictions"])
    logits = {o["name"]: o for o in _strict(v2_json.text)["outputs"]}["logits"]
    assert logits["data"][:3] == [None, None, None]
    np.testing.assert_allclose(logits["data"][3:], want[3:], atol=1e-5)
    raw = _binary_outputs(v2_binary)["logits"][0]  # the binary extension keeps the IEEE values
    assert np.isposinf(raw[0]) and np.isneginf(raw[1]) and np.isnan(raw[2])
    np.testing.assert_allclose(raw[3:], want[3:], atol=1e-5)


def test_nan_attention_gives_a_null_map_on_explain_and_v2(nan_attention, image):
    path, model = nan_attention

    async def scenario():
        async with serving(settings_for(path, model_name="nanattn")) as (client, _):
            kind = {"Content-Type": "image/png"}
            posted = await client.post("/explain?format=json", content=image, headers=kind)
            by_id = await client.get("/explain", params={"id": posted.json()["id"], "format": "json"})
            x = preprocess(image, model.preprocess_cfg)[None].numpy()
            v2 = await client.post("/v2/models/nanattn/infer", json=_v2_request(x, False))
            classes = await client.post("/v2/models/nanattn/infer", json={
                **_v2_request(x, False), "outputs": [{"name": "logits", "parameters": {"classification": 2}}]})
            return posted, by_id, v2, classes

    posted, by_id, v2, classes = run(scenario())
    for r in (posted, by_id):
        assert r.status_code == 200, r.text
        body = _strict(r.text)
        assert body["map"] == [[None] * 3] * 2
        assert all(p["score"] is None for p in body["predictions"])
    outputs = {o["name"]: o for o in _strict(v2.text)["outputs"]}
    assert outputs["logits"]["data"] == [None] * 10 and outputs["rollout"]["data"] == [None] * 6
    # Triton's classification of NaN values: std::to_string(NaN) is "nan".
    assert _strict(classes.text)["outputs"][0]["data"] == ["nan:0", "nan:1"]
