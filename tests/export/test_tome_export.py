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


@pytest.fixture(scope="module")
def dinov2_reg():
    """A tiny DINOv2 with 4 registers (5 prefix tokens) at 84 px: a 6x6 grid, timm's random weights."""
    fam = dataclasses.replace(FAMILIES["dinov2_reg"], img=84)
    return ours(fam, timm_model(fam))


def test_a_dynamic_export_merges_at_every_size_from_its_smallest_grid(dinov2_reg, tmp_path) -> None:
    """r = 4 in both blocks needs 12 patches before the first merge (`fewest_patches`: 4 + 2 x 4): the graph
    takes sides of 4 patches and up, and there matches PyTorch at every size, square or not."""
    from vit_export.graph_info import GraphInfo
    from vit_export.onnx_export import export_graph, min_grid
    from vit_export.parity import check_parity

    model = dinov2_reg
    model.set_token_merging(4)
    try:
        assert min_grid(model) == 4
        written = export_graph(model, tmp_path / "dyn.onnx", res="dynamic")
        info = GraphInfo.read(written.path)
        assert info.token_merging is not None
        assert (info.token_merging.r, info.token_merging.min_grid) == ((4, 4), 4)
        sizes = [(84, 84), (56, 56), (126, 70), (56, 98)]
        report = check_parity(model, written.path, None, batch_sizes=(1, 3), resolutions=sizes)
        print(report.table())
        assert report.ok and len(report.rows) == 2 * len(sizes)
    finally:
        model.set_token_merging(0)


def test_the_export_pipeline_records_r_and_names_the_files(dinov2_reg, tmp_path) -> None:
    import vit_export
    from vit_export.pipeline import tome_tag

    from vit_serve.manifest import read_manifest

    result = vit_export.export(dinov2_reg, vit_export.ExportOptions(out=tmp_path, tome="4,2"), progress=print)
    assert result.ok and result.onnx.name == "vit_84_tome4-2.onnx" and dinov2_reg.token_merging is None
    for path in (result.onnx, result.explain_onnx):
        tm = read_manifest(path).token_merging
        assert tm is not None and (tm.r, tm.prop_attn, tm.min_grid) == ((4, 2), True, None)
    assert [tome_tag(v) for v in (None, 0, 13, [13, 8], (16, -1.0))] == ["", "", "_tome13", "_tome13-8",
                                                                        "_tome16i-1"]


def test_bad_r_is_refused_before_anything_is_written(dinov2_reg, tmp_path, capsys) -> None:
    import vit_export
    from vit_export.cli import main

    with pytest.raises(vit_export.OptionError, match="tome: token merging: 3 values of r for a model of 2 layers"):
        vit_export.export(dinov2_reg, vit_export.ExportOptions(out=tmp_path, tome=[1, 1, 1]))
    with pytest.raises(vit_export.OptionError, match="bad r 'x'"):
        vit_export.ExportOptions(tome="x")
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "none.safetensors"), "--tome", "-3"])
    assert exit_.value.code == 2
    assert "--tome: token merging: r must be a whole number >= 0, got -3" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
