"""FlexiViT patch resizing served: an export made with `vit-export --patch-size 8` (onnxruntime backend) and the
checkpoint resized with `vit-serve convert --patch-size 8` (torch backend) answer /classify and /explain as the
library's resized model does, and the rollout map's grid follows the patch (2x3 at patch 16 -> 4x6 at 8).
Reference: `VisionTransformer.set_patch_size` (itself checked against timm in tests/test_patch_resize.py) and
`vit_serve.explain.rollout`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gateway_helpers import run, serving, settings_for

import vit_serve
from vit_serve.explain import rollout
from vit_serve.preprocess import preprocess

JPEG = {"Content-Type": "image/jpeg"}


@pytest.fixture(scope="module")
def resized(tiny_ckpt):
    model = vit_serve.load(tiny_ckpt).eval()
    model.set_patch_size(8)
    return model


def _reference(model, data: bytes) -> tuple[np.ndarray, np.ndarray]:
    with torch.no_grad():
        logits, attn = model(preprocess(data, model.preprocess_cfg)[None], return_attention=True)
    return logits[0].numpy(), rollout(attn, (4, 6), model.num_prefix_tokens, model.cfg.pool, "mean", 0.9).map[0].numpy()


def _answers(model_path, data: bytes, **kw):
    async def go():
        async with serving(settings_for(model_path, **kw)) as (client, _):
            c = await client.post("/classify?top_k=10", content=data, headers=JPEG)
            e = await client.post("/explain?format=json", content=data, headers=JPEG)
            return c, e

    return run(go())


@pytest.mark.parametrize("how", ["export", "convert"])
def test_a_resized_model_is_served_with_its_grid(how, tiny_ckpt, resized, photos, tmp_path):
    from vit_serve.cli import main

    if how == "export":
        import vit_export

        result = vit_export.export(tiny_ckpt, vit_export.ExportOptions(out=tmp_path, patch_size=8))
        assert result.ok and result.onnx.name == "tiny_32x48_p8.onnx"
        path, backend = result.onnx, "onnxruntime"
    else:
        path, backend = tmp_path / "p8.safetensors", "torch"
        assert main(["convert", str(tiny_ckpt), str(path), "--patch-size", "8"]) == 0
    data = photos["chelsea.jpg"]
    classify, explain = _answers(path, data, backend=backend)
    assert classify.status_code == 200 and explain.status_code == 200, (classify.text, explain.text)
    logits, grid_map = _reference(resized, data)
    top = classify.json()["predictions"][0]
    assert top["index"] == int(logits.argmax())
    body = explain.json()
    assert body["grid"] == [4, 6]
    np.testing.assert_allclose(np.array(body["map"]), grid_map, atol=1e-5)
