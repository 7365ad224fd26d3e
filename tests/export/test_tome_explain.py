"""The explain graph of a model with token merging: its rollout follows the merges inside the graph.

Reference: `vit_export.parity.check_parity`, whose PyTorch side is `vit_serve.explain.explain_forward` (the rollout
through the same pass's merges), with the parity check's own criteria (logits within 1e-4, the rollout within
1e-5 beyond near-threshold flips), on tiny timm-weighted families (tests/family_models.py: DeiT's [dist] token,
SigLIP's MAP head) and a GAP model. The envelope the rollout criterion uses is checked through merges against
brute force: flipping each near-threshold weight alone and rolling out again.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import vit_serve
from tests.family_models import FAMILIES, ours, timm_model
from vit_serve.explain import discard_lowest, explain_forward, fuse_heads, rollout

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")


def model_for(key: str, randomize) -> vit_serve.VisionTransformer:
    """A tiny model of family `key` at a 4 x 4 grid ("gap": a GAP model with one register, random weights)."""
    if key == "gap":
        torch.manual_seed(0)
        return randomize(vit_serve.create_model("Ti/16", depth=2, img_size=64, num_classes=10, pool="gap",
                                                class_token=False, reg_tokens=1, no_embed_class=True)).eval()
    pytest.importorskip("timm")
    fam = dataclasses.replace(FAMILIES[key], img=4 * FAMILIES[key].options["patch_size"])
    return ours(fam, timm_model(fam))


@pytest.mark.parametrize("key", ["deit", "siglip", "gap"])
def test_the_explain_graph_of_a_token_merging_model_passes_parity(tmp_path, key, randomize) -> None:
    from vit_export.onnx_export import export_graph
    from vit_export.parity import check_parity, session

    model = model_for(key, randomize)
    model.set_token_merging([4, 3])
    h, w = model.cfg.img_size
    exported = export_graph(model, tmp_path / "e.onnx", res=(h, w), explain=True)
    report = check_parity(model, exported.path, batch_sizes=(1, 3), info=exported.info)
    print(report.table())
    assert report.ok and all(r.rollout_max_abs is not None for r in report.rows)
    # the graph merges: its map is not the plain model's
    x = torch.randn(2, 3, h, w, generator=torch.Generator().manual_seed(5))
    s = session(exported.path)
    heat = s.run(None, {"pixel_values": x.numpy()})[1]
    model.set_token_merging(0)
    with torch.no_grad():
        plain = explain_forward(model, x).heatmap.map.numpy()
    assert heat.shape == plain.shape == (2, 4, 4) and np.abs(heat - plain).max() > 1e-3


def test_a_dynamic_resolution_explain_graph_with_token_merging_passes_parity(tmp_path, randomize) -> None:
    """The same through a dynamic-resolution graph (the merges' token counts symbolic), at the sizes the parity
    check picks for it."""
    from vit_export.onnx_export import export_graph
    from vit_export.parity import check_parity

    model = model_for("deit", randomize)
    model.set_token_merging([4, 3])
    exported = export_graph(model, tmp_path / "e.onnx", res="dynamic", explain=True)
    report = check_parity(model, exported.path, batch_sizes=(2,), info=exported.info)
    print(report.table())
    assert report.ok and len({r.res for r in report.rows}) >= 2


@pytest.mark.parametrize("key", ["deit", "gap"])
def test_the_envelope_through_merges_is_the_sum_of_single_flips(key, randomize) -> None:
    """rollout_envelope is exact for one flip; its sum over the near-threshold weights must equal, cell by cell,
    the sum of |Δ map| from flipping each of them alone (keeping a dropped weight, dropping a kept one) and rolling
    out again through the same merges (`rollout` on the flipped, already-discarded attentions, ratio 0), float64.
    near_rel is wide here so that each layer has several such weights."""
    from vit_export.parity import rollout_envelope

    model = model_for(key, randomize)
    model.set_token_merging([4, 3])
    x = torch.randn(2, 3, *model.cfg.img_size, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        e = explain_forward(model, x, "mean", 0.9)
    p, pool = model.num_prefix_tokens, model.cfg.pool
    near_rel = 0.05
    counts, envelope = rollout_envelope(e.attentions, p, pool, "mean", 0.9, near_rel=near_rel, merges=e.merges)
    assert all(c > 2 for c in counts)
    fused = [fuse_heads(a.float()).double() for a in e.attentions]  # fused in float32, as the envelope does
    kept = [discard_lowest(f, 0.9, p > 0) for f in fused]

    def rolled(layers: list[torch.Tensor]) -> torch.Tensor:
        return rollout([k[:, None] for k in layers], (4, 4), p, pool, "mean", 0.0, e.merges).map.reshape(2, -1)

    base = rolled(kept)
    total = torch.zeros_like(base)
    flips = 0
    for layer, (f, k) in enumerate(zip(fused, kept, strict=True)):
        flat, kflat = f.reshape(2, -1), k.reshape(2, -1)
        dropped = (kflat == 0) & (flat != 0)
        first = torch.arange(flat.shape[-1]) == 0
        threshold = torch.where(~dropped & ~first, flat, torch.inf).amin(dim=-1, keepdim=True)
        near = ((flat - threshold).abs() <= near_rel * threshold) & ~first
        for b, idx in near.nonzero().tolist():
            flipped = kflat.clone()
            flipped[b, idx] = flat[b, idx] if dropped[b, idx] else 0.0
            layers = list(kept)
            layers[layer] = flipped.reshape(k.shape)
            total[b] += (rolled(layers)[b] - base[b]).abs()
            flips += 1
    assert flips == sum(counts)
    torch.testing.assert_close(envelope, total, rtol=1e-9, atol=1e-12)
