"""`vit-serve predict --embeddings` over a folder of real photos with a DINOv3 checkpoint (timm's Eva with random
weights, tiny widths, converted from the hub folder timm writes): each row's embedding is the eager model's on the
pixels `vit_serve.preprocess` makes of that file (`--decode contract`: the library's own resize, not the gateway's
faster default), which is timm's [class] token after the final norm, whatever the batch holds."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from rope_models import dinov3_hub

import vit_serve
from vit_serve.checkpoints import convert
from vit_serve.predict import PredictOptions, predict
from vit_serve.preprocess import preprocess

timm = pytest.importorskip("timm")
skimage_data = pytest.importorskip("skimage.data")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(timm's DINOv3, our checkpoint, the photo folder)."""
    root = tmp_path_factory.mktemp("rope_predict")
    ref = dinov3_hub(root / "hub", seed=7, dynamic_img_size=True)
    convert(root / "hub", root / "dinov3.safetensors")
    (root / "photos").mkdir()
    for name in ("astronaut", "coffee", "chelsea"):  # PNG: lossless, both sides read the same pixels
        Image.fromarray(getattr(skimage_data, name)()).save(root / "photos" / f"{name}.png")
    return ref, root / "dinov3.safetensors", root / "photos"


@pytest.mark.parametrize("batch", [1, 3])
def test_embedding_rows_equal_the_eager_model(setup, tmp_path, batch):
    ref, ckpt, photos = setup
    out = tmp_path / "preds.jsonl"
    predict(PredictOptions(model=str(ckpt), src=str(photos), out=str(out), quiet=True, embeddings=True,
                           batch_size=batch, workers=1, decode="contract"))
    rows = {r["path"].rsplit("/", 1)[-1]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(rows) == ["astronaut.png", "chelsea.png", "coffee.png"]
    model = vit_serve.load(ckpt).eval()
    assert model.cfg.rope is not None and model.pos_embed is None
    for name, row in rows.items():
        x = preprocess((photos / name).read_bytes(), model.preprocess_cfg)[None]
        with torch.no_grad():
            eager = model.forward_embedding(x)[1][0].numpy()
            timm_cls = ref.forward_features(x)[0, 0].numpy()
        got = np.asarray(row["embedding"])
        err, err_timm = float(np.abs(got - eager).max()), float(np.abs(got - timm_cls).max())
        print(f"batch {batch} {name}: |Δ| eager {err:.2e}, timm [class] {err_timm:.2e}")
        assert got.shape == (96,) and err <= 1e-5 and err_timm <= 1e-4
