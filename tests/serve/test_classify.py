"""POST /classify end to end (the app in-process over ASGI): the answer's shape and numbers against the library
(`vit_serve.preprocess` + the PyTorch model), on the torch and the onnxruntime backends."""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from gateway_helpers import LABELS, run, serving, settings_for

from vit_serve.preprocess import preprocess


def _reference(model, data: bytes) -> np.ndarray:
    with torch.no_grad():
        logits = model(preprocess(data, model.preprocess_cfg)[None])[0].double()
    return torch.softmax(logits, -1).numpy()


def test_classify_multipart_and_raw_body(tiny_ckpt, tiny_model, photos):
    async def scenario():
        async with serving(settings_for(tiny_ckpt)) as (client, _):
            out = {}
            for name, data in photos.items():
                kind = "image/png" if name.endswith(".png") else "image/jpeg"
                a = await client.post("/classify", files={"file": (name, data, kind)})
                b = await client.post("/classify?top_k=3", content=data, headers={"Content-Type": kind})
                out[name] = (a, b)
            return out

    for name, (a, b) in run(scenario()).items():
        assert a.status_code == 200, a.text
        assert b.status_code == 200, b.text
        body = a.json()
        assert set(body) == {"id", "model", "version", "resolution", "predictions", "timing_ms"}
        assert body["id"] == b.json()["id"] != hashlib.sha256(photos[name]).hexdigest()  # HMAC'd: stores.secret
        assert body["model"] == "tiny"
        assert body["resolution"] == [32, 48]
        assert set(body["timing_ms"]) == {"decode", "queue", "infer", "total", "batch_size"}
        # Server-Timing (W3C): the finer split that benchmarks/serve_load.py reads, each stage with dur=ms
        stages = dict(part.strip().split(";dur=") for part in a.headers["server-timing"].split(","))
        assert set(stages) == {"read", "decode_wait", "decode", "queue", "infer", "total"}, stages
        assert all(float(v) >= 0 for v in stages.values())
        assert float(stages["total"]) >= float(stages["decode"]) + float(stages["infer"]) - 0.01
        preds = body["predictions"]
        assert len(preds) == 5 and len(b.json()["predictions"]) == 3
        probs = _reference(tiny_model, photos[name])
        best = np.argsort(-probs)[:5]
        assert [p["index"] for p in preds] == best.tolist()
        assert [p["label"] for p in preds] == [LABELS[i] for i in best]
        np.testing.assert_allclose([p["score"] for p in preds], probs[best], atol=1e-5)
        assert b.json()["predictions"] == preds[:3]


def test_top_k_larger_than_classes_gives_all_classes(tiny_ckpt, photos):
    async def scenario():
        async with serving(settings_for(tiny_ckpt)) as (client, _):
            return await client.post("/classify?top_k=50", content=photos["coffee.jpg"],
                                     headers={"Content-Type": "image/jpeg"})

    r = run(scenario())
    scores = [p["score"] for p in r.json()["predictions"]]
    assert len(scores) == 10
    assert scores == sorted(scores, reverse=True)
    assert abs(sum(scores) - 1) < 1e-6


def test_onnxruntime_backend_serves_the_same_predictions(tiny_ckpt, tiny_onnx, photos):
    async def answers(model):
        async with serving(settings_for(model)) as (client, _):
            return [(await client.post("/classify", files={"file": (n, d, "image/jpeg")})).json()
                    for n, d in photos.items()]

    by_torch, by_ort = run(answers(tiny_ckpt)), run(answers(tiny_onnx))
    for a, b in zip(by_torch, by_ort, strict=True):
        assert a["id"] == b["id"]
        assert [p["index"] for p in a["predictions"]] == [p["index"] for p in b["predictions"]]
        np.testing.assert_allclose([p["score"] for p in a["predictions"]], [p["score"] for p in b["predictions"]],
                                   atol=1e-5)
