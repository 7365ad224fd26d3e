"""Token merging (ToMe) served: `serve --tome R` / `LoadSpec.tome` on a checkpoint (the torch backend), an export
made with `vit-export --tome` read back by the onnxruntime backend, and `/models` saying what runs. The reference
is the library's own model with `set_token_merging(R)` (itself checked against timm's modules in
tests/test_tome.py) on the same preprocessed photos."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gateway_helpers import LABELS, run, serving, settings_for

import vit_serve
from vit_serve.manifest import TokenMergingRecord
from vit_serve.preprocess import preprocess
from vit_serve.runtime import LoadSpec, check, load

RES = (64, 64)  # a 4x4 grid: r = 4 merges whole in both blocks


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, save_tiny):
    return save_tiny(tmp_path_factory.mktemp("tome") / "tome.safetensors", RES, 3, LABELS)


@pytest.fixture(scope="module")
def batch(ckpt, photos) -> np.ndarray:
    cfg = vit_serve.load(ckpt).preprocess_cfg
    return torch.stack([preprocess(b, cfg) for b in photos.values()]).numpy()


def test_the_torch_backend_runs_the_merging_asked_for(ckpt, batch):
    backend = load(LoadSpec(str(ckpt), device="cpu", threads=1, tome=4))
    assert backend.info.token_merging == TokenMergingRecord((4, 4), True)
    ref = vit_serve.load(ckpt).eval()
    with torch.no_grad():
        plain = ref(torch.from_numpy(batch)).numpy()
        ref.set_token_merging(4)
        want = ref(torch.from_numpy(batch)).numpy()
    got = backend.classify(batch)
    assert np.abs(got - want).max() <= 1e-5
    assert np.abs(got - plain).max() > 1e-3  # it merges: not the plain model's logits
    assert load(LoadSpec(str(ckpt), device="cpu", threads=1)).info.token_merging is None


def test_bad_r_and_exports_are_refused_clearly(ckpt, tmp_path):
    with pytest.raises(ValueError, match=r"--tome for tome\.safetensors: token merging: 3 values of r for a model"):
        load(LoadSpec(str(ckpt), device="cpu", tome=[1, 1, 1]))
    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"")
    with pytest.raises(ValueError, match=r"m\.onnx runs the merging it was exported with: export it with vit-export"):
        check(LoadSpec(str(onnx), tome=4))
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"13,13,8 \(per layer\)"):
        settings_for(ckpt, tome="thirteen")


def test_an_export_with_token_merging_is_served_as_exported(ckpt, batch, tmp_path):
    import vit_export

    result = vit_export.export(ckpt, vit_export.ExportOptions(out=tmp_path, tome=4), progress=print)
    assert result.ok and result.onnx.name == "tome_64_tome4.onnx"
    backend = load(LoadSpec(str(result.onnx), device="cpu", threads=1))
    assert backend.info.token_merging == TokenMergingRecord((4, 4), True)
    ref = vit_serve.load(ckpt).eval()
    ref.set_token_merging(4)
    with torch.no_grad():
        want = ref(torch.from_numpy(batch)).numpy()
    assert np.abs(backend.classify(batch) - want).max() <= 1e-4


def test_the_gateway_serves_and_reports_it(ckpt, photos):
    name, data = next(iter(photos.items()))

    async def go():
        async with serving(settings_for(ckpt, tome="4")) as (client, _):
            models = (await client.get("/models")).json()
            return models, await client.post("/classify", files={"file": (name, data, "image/jpeg")})

    models, r = run(go())
    assert models["models"][0]["versions"][0]["token_merging"] == {"r": [4, 4], "prop_attn": True}
    assert r.status_code == 200, r.text
    ref = vit_serve.load(ckpt).eval()
    ref.set_token_merging(4)
    with torch.no_grad():
        top = int(ref(preprocess(data, ref.preprocess_cfg)[None]).argmax())
    assert r.json()["predictions"][0]["label"] == LABELS[top]
