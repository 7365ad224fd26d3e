"""A model with token merging exported to ONNX (static resolution: the merging runs in the graph), run by
onnxruntime against PyTorch eager on the same weights (tests/family_models.py: a tiny timm DINOv2 with
registers, random weights)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.family_models import FAMILIES, ours, timm_model

pytest.importorskip("onnxruntime")


def test_a_static_export_with_token_merging_matches_pytorch(tmp_path) -> None:
    from vit_export.onnx_export import export_onnx
    from vit_export.parity import session

    fam = dataclasses.replace(FAMILIES["dinov2_reg"], img=84)
    model = ours(fam, timm_model(fam))
    model.set_token_merging([8, 6])
    path = export_onnx(model, tmp_path / "tome.onnx")
    x = torch.randn(3, 3, 84, 84, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(x).numpy()
        model.set_token_merging(0)
        plain = model(x).numpy()
    s = session(path)
    got = s.run(None, {s.get_inputs()[0].name: x.numpy()})[0]
    assert np.abs(got - want).max() <= 1e-4
    assert np.abs(plain - want).max() > 1e-3  # the graph merges: it is not the plain model's
