"""The torch backend's explain on a model with token merging: the rollout follows the merges. Reference:
`vit_serve.explain.explain_forward` on the library's own model with the same `set_token_merging` (that rollout
is checked by hand and against an independent derivation in tests/test_explain_tome.py), on real photos."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gateway_helpers import LABELS

import vit_serve
from vit_serve.explain import explain_forward
from vit_serve.manifest import RolloutSettings
from vit_serve.preprocess import preprocess
from vit_serve.runtime.backends.torch import TorchBackend

RES = (64, 64)  # a 4x4 grid: r = 4 merges whole in both blocks


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, save_tiny):
    return save_tiny(tmp_path_factory.mktemp("tome_explain") / "tome.safetensors", RES, 3, LABELS)


@pytest.mark.parametrize(("fusion", "ratio"), [("mean", 0.9), ("max", 0.5)])
def test_torch_backend_explains_through_the_merges(ckpt, photos, fusion, ratio) -> None:
    backend = TorchBackend(ckpt, device="cpu", threads=1)
    backend.model.set_token_merging(4)
    ref = vit_serve.load(ckpt).eval()
    x = torch.stack([preprocess(b, ref.preprocess_cfg) for b in photos.values()])
    with torch.no_grad():
        plain = explain_forward(ref, x, fusion, ratio).heatmap.map.numpy()
        ref.set_token_merging(4)
        want = explain_forward(ref, x, fusion, ratio)
    assert [m.matching.r for m in want.merges] == [4, 4]
    logits, heat = backend.explain(x.numpy(), RolloutSettings(fusion, ratio))
    assert heat.shape == (3, 4, 4) and np.isfinite(heat).all()
    np.testing.assert_allclose(heat, want.heatmap.map.numpy(), atol=1e-6)
    np.testing.assert_allclose(logits, want.logits.numpy(), atol=1e-5)
    assert np.abs(heat - plain).max() > 1e-3  # not the plain model's map
