"""`vit-serve predict --max-patches N` on a SigLIP 2 NaFlex checkpoint: each row's embedding equals what
transformers' own Siglip2ImageProcessor(max_num_patches=N) and Siglip2VisionModel give for the same file (PNG
photos of three aspect ratios, lossless so both read the same pixels), whatever the batch holds; bounds and
refusals in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from naflex_models import aspect_photos, siglip2_tower
from PIL import Image

from vit_serve.checkpoints import convert
from vit_serve.predict import PredictOptions, predict

transformers = pytest.importorskip("transformers")
skimage_data = pytest.importorskip("skimage.data")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(HF model, our converted checkpoint, folder of photos, {name: pixels})."""
    root = tmp_path_factory.mktemp("naflex_predict")
    ref = siglip2_tower(root / "hf", seed=5)
    convert(root / "hf", root / "ours.safetensors")
    images = aspect_photos()
    (root / "photos").mkdir()
    for name, pixels in images.items():
        Image.fromarray(pixels).save(root / "photos" / f"{name}.png")
    return ref, root / "ours.safetensors", root / "photos", images


def _run(ckpt: Path, photos: Path, out: Path, **kw) -> dict[str, dict]:
    predict(PredictOptions(model=str(ckpt), src=str(photos), out=str(out), quiet=True, embeddings=True,
                           workers=1, **kw))
    return {Path(r["path"]).stem: r for r in map(json.loads, out.read_text().splitlines())}


@pytest.mark.parametrize("n,batch", [(64, 2), (32, 3), (256, 1)])
def test_rows_equal_hf_processor_and_model(setup, tmp_path, n, batch):
    ref, ckpt, photos, images = setup
    rows = _run(ckpt, photos, tmp_path / "p.jsonl", max_patches=n, batch_size=batch)
    for name, pixels in images.items():
        x = transformers.Siglip2ImageProcessor(max_num_patches=n)(images=[pixels], return_tensors="pt")
        with torch.no_grad():
            want = ref(**x).pooler_output[0].numpy()
        assert np.abs(np.array(rows[name]["embedding"]) - want).max() <= 1e-4, name


def test_budget_bounds_and_refusals(setup, tmp_path):
    _, ckpt, photos, _ = setup
    with pytest.raises(ValueError, match=r"--max-patches 300: must be an integer from 1 to 256"):
        _run(ckpt, photos, tmp_path / "a.jsonl", max_patches=300)
    with pytest.raises(ValueError, match="--max-patches must be at least 1"):
        PredictOptions(model=str(ckpt), src=str(photos), out=str(tmp_path / "b.jsonl"), max_patches=0)
    with pytest.raises(ValueError, match="not --explain"):
        PredictOptions(model=str(ckpt), src=str(photos), out=str(tmp_path / "c.jsonl"), max_patches=8, explain=True)


def test_fixed_size_model_refuses(setup, tmp_path, save_tiny):
    _, _, photos, _ = setup
    ckpt = save_tiny(tmp_path / "tiny.safetensors", (32, 32), 3, ["a", "b", "c"])
    with pytest.raises(ValueError, match="--max-patches 8: this model takes fixed-size images"):
        _run(ckpt, photos, tmp_path / "d.jsonl", max_patches=8)


@pytest.fixture(scope="module")
def exported(setup, tmp_path_factory):
    import vit_export

    out = tmp_path_factory.mktemp("naflex_export")
    result = vit_export.export(setup[1], vit_export.ExportOptions(out=out, name="s2", naflex=True,
                                                                    outputs="logits,embedding"))
    assert result.ok
    return result


def test_onnx_export_with_its_naflex_graph(setup, exported, tmp_path):
    """The onnxruntime backend serves NAME_naflex.onnx beside NAME.onnx: the same rows as transformers."""
    ref, _, photos, images = setup
    rows = _run(exported.onnx, photos, tmp_path / "p.jsonl", max_patches=64, batch_size=2)
    for name, pixels in images.items():
        x = transformers.Siglip2ImageProcessor(max_num_patches=64)(images=[pixels], return_tensors="pt")
        with torch.no_grad():
            want = ref(**x).pooler_output[0].numpy()
        assert np.abs(np.array(rows[name]["embedding"]) - want).max() <= 1e-4, name


def test_a_naflex_graph_of_another_export_is_not_used(setup, exported, tmp_path):
    import shutil

    from vit_export.naflex_graph import export_naflex

    from vit_serve.checkpoints import load
    from vit_serve.runtime.backends.onnxruntime import OnnxRuntimeBackend

    assert OnnxRuntimeBackend(exported.onnx).info.max_patches == 256
    for f in (exported.onnx, exported.onnx.with_suffix(".json")):
        shutil.copy(f, tmp_path / f.name)
    export_naflex(load(setup[1]), tmp_path / "s2_naflex.onnx", graph_sha256="0" * 64)  # names another graph
    backend = OnnxRuntimeBackend(tmp_path / "s2.onnx")
    assert backend.info.max_patches is None
    with pytest.raises(NotImplementedError, match="NaFlex inputs"):
        backend.embed_patches(np.zeros((1, 5, 768), np.float32))
