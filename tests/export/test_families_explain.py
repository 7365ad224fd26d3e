"""The explain graphs of a register model (DINOv2-reg: registers in the attention graph, cut from the map) and
of a MAP model (SigLIP: the rollout read through the pool's probe, the extra last attention), dynamic resolution:
logits equal timm's (tests/family_models.py) and the rollout equals `vit_serve.explain.rollout` on the model's full
attention list within 1e-4, at the native size and a larger one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.family_models import FAMILIES, ours, reference, timm_model

pytest.importorskip("onnxscript")
pytest.importorskip("timm")

TOL = 1e-4


@pytest.mark.parametrize("key", ["dinov2_reg", "siglip"])
def test_explain_graph(tmp_path, key):
    import onnxruntime as ort
    from vit_export.onnx_export import export_onnx

    from vit_serve.explain import DEFAULT_DISCARD_RATIO, DEFAULT_HEAD_FUSION, rollout

    fam = FAMILIES[key]
    ref = timm_model(fam)
    model = ours(fam, ref)
    p = fam.options["patch_size"]
    sess = ort.InferenceSession(str(export_onnx(model, tmp_path / "e.onnx", res="dynamic", explain=True,
                                                simplify=False)), providers=["CPUExecutionProvider"])
    for size in (fam.img, fam.img + 2 * p):
        x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(size))
        with torch.no_grad():
            _, attentions = model(x, return_attention=True)
            want = rollout(attentions, (size // p, size // p), model.num_prefix_tokens, model.cfg.pool,
                           DEFAULT_HEAD_FUSION, DEFAULT_DISCARD_RATIO).map.numpy()
        logits, heat = sess.run(None, {"pixel_values": x.numpy()})
        d_logits = np.abs(logits - reference(fam, ref, model, x)[0].numpy()).max()
        print(f"{key} explain {size}px: |d logits| {d_logits:.2e}, |d rollout| {np.abs(heat - want).max():.2e}")
        assert d_logits <= TOL
        assert heat.shape == want.shape == (2, size // p, size // p) and np.abs(heat - want).max() <= TOL
