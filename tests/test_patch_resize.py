"""FlexiViT patch resizing (Beyer et al. 2023): `resample_patch_embed` against timm's own, and
`VisionTransformer.set_patch_size` against a timm model created at the new patch size from the same weights
(the two steps of timm's `checkpoint_filter_fn`: its patch-embedding resize and position-embedding resampling)."""

from __future__ import annotations

import pytest
import timm
import torch
from timm.layers import resample_abs_pos_embed
from timm.layers import resample_patch_embed as timm_resample_patch_embed

import vit_serve
from vit_serve.checkpoints.timm_state import convert_timm
from vit_serve.cli import main
from vit_serve.pos_embed import resample_patch_embed


@pytest.mark.parametrize("old,new", [(16, (8, 8)), (16, (24, 24)), (4, (2, 2)), (16, (8, 12))])
def test_the_pseudo_inverse_resize_equals_timms(old, new):
    w = torch.randn(12, 3, old, old, generator=torch.Generator().manual_seed(old))
    ours = resample_patch_embed(w, new)
    ref = timm_resample_patch_embed(w, list(new), interpolation="bicubic", antialias=True)
    assert ours.shape == (12, 3, *new) and ours.dtype == w.dtype
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.parametrize("patch", [8, 32])
def test_set_patch_size_equals_timm_at_the_new_patch_on_a_non_square_grid(patch, randomize):
    res = (64, 96)
    src = randomize(timm.create_model("vit_tiny_patch16_224", num_classes=5, depth=2, img_size=res))
    hub = {"architecture": "vit_tiny_patch16_224", "model_args": {"img_size": list(res)}}  # as timm's config.json
    model = vit_serve.checkpoints.build_model(convert_timm(src.state_dict(), "vit_tiny_patch16_224", hub_config=hub))
    model.set_patch_size(patch)
    ref = timm.create_model("vit_tiny_patch16_224", num_classes=5, depth=2, img_size=res, patch_size=patch).eval()
    # timm's checkpoint_filter_fn does this for square grids (it assumes the old one is); on this 4 x 6 grid its
    # two steps are called as it calls them, with the old grid given
    sd = dict(src.state_dict())
    sd["patch_embed.proj.weight"] = timm_resample_patch_embed(sd["patch_embed.proj.weight"], [patch, patch],
                                                              interpolation="bicubic", antialias=True)
    sd["pos_embed"] = resample_abs_pos_embed(sd["pos_embed"], list(ref.patch_embed.grid_size), old_size=[4, 6],
                                             num_prefix_tokens=1, interpolation="bicubic", antialias=True)
    ref.load_state_dict(sd)
    assert model.cfg.patch_size == patch and model.grid_size == (res[0] // patch, res[1] // patch)
    x = torch.randn(2, 3, *res, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(x), ref(x)
    assert (ours - theirs).abs().max() <= 1e-4 * max(1.0, theirs.abs().max().item())


def test_a_patch_that_does_not_divide_the_resolution_is_refused_in_one_line(tmp_path, save_tiny, capsys):
    ckpt = save_tiny(tmp_path / "m.safetensors", (32, 48), 0, ["a", "b"])
    model = vit_serve.load(ckpt)
    with pytest.raises(ValueError, match="patch size 12 does not divide the resolution 32x48"):
        model.set_patch_size(12)
    assert main(["convert", str(ckpt), str(tmp_path / "bad.safetensors"), "--patch-size", "12"]) == 1
    err = capsys.readouterr().err
    assert "patch size 12 does not divide the resolution 32x48" in err and err.count("\n") == 1, err
    assert not (tmp_path / "bad.safetensors").exists()
    assert main(["convert", str(ckpt), str(tmp_path / "p8.safetensors"), "--patch-size", "8"]) == 0
    resized = vit_serve.load(tmp_path / "p8.safetensors")
    assert resized.cfg.patch_size == 8 and resized.grid_size == (4, 6)
    with torch.no_grad():  # the rollout grid follows: one map cell per 8 x 8 patch
        _, attentions = resized(torch.randn(1, 3, 32, 48), return_attention=True)
    assert attentions[0].shape[-1] == 1 + 4 * 6


def test_a_resized_model_exports_with_its_patch_in_the_manifest(tmp_path, save_tiny):
    import vit_export

    ckpt = save_tiny(tmp_path / "m.safetensors", (32, 32), 0, ["a", "b"])
    assert main(["convert", str(ckpt), str(tmp_path / "p8.safetensors"), "--patch-size", "8"]) == 0
    result = vit_export.export(tmp_path / "p8.safetensors", vit_export.ExportOptions(out=tmp_path / "onnx"))
    assert result.ok  # both graphs pass parity against the resized torch model
    assert result.graph.record.architecture.patch_size == 8
    assert tuple(result.explain.record.io.output("rollout").shape[-2:]) == (4, 4)  # the map's grid follows the patch


def test_vit_export_res_and_patch_size_equals_timm_created_at_both(tmp_path, randomize, capsys):
    """`vit-export --res 64 --patch-size 8` of a 32x32 patch-16 timm model: the graph (onnxruntime) equals timm's
    model created at img_size=64, patch_size=8 from the same weights, one resampling of the position embeddings
    (2x2 -> 8x8) as timm's checkpoint_filter_fn; the manifest records the graph's and the source's both."""
    import onnxruntime as ort
    from vit_export.cli import main as export_main

    from vit_serve.manifest import read_manifest

    src = randomize(timm.create_model("vit_tiny_patch16_224", num_classes=3, depth=2, img_size=32))
    hub = {"architecture": "vit_tiny_patch16_224", "model_args": {"img_size": [32, 32]}}
    model = vit_serve.checkpoints.build_model(convert_timm(src.state_dict(), "vit_tiny_patch16_224", hub_config=hub))
    ckpt = vit_serve.save(model, tmp_path / "m.safetensors")
    out = tmp_path / "exports"
    assert export_main([str(ckpt), "--res", "64", "--patch-size", "8", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "res patch batch" in " ".join(table.split()) and " 64x64     8 " in table, table
    onnx = out / "m_64_p8.onnx"
    m = read_manifest(onnx)
    assert m.resolution == (64, 64) and m.architecture.patch_size == 8
    assert m.architecture.trained_patch_size == 16 and m.architecture.trained_resolution == (32, 32)

    ref = timm.create_model("vit_tiny_patch16_224", num_classes=3, depth=2, img_size=64, patch_size=8).eval()
    sd = dict(src.state_dict())
    sd["patch_embed.proj.weight"] = timm_resample_patch_embed(sd["patch_embed.proj.weight"], [8, 8],
                                                              interpolation="bicubic", antialias=True)
    sd["pos_embed"] = resample_abs_pos_embed(sd["pos_embed"], [8, 8], num_prefix_tokens=1,
                                             interpolation="bicubic", antialias=True)
    ref.load_state_dict(sd)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = ref(x).numpy()
    sess = ort.InferenceSession(str(onnx), providers=["CPUExecutionProvider"])
    ours = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    assert abs(ours - theirs).max() <= 1e-4 * max(1.0, abs(theirs).max())


def test_vit_export_refuses_a_patch_that_does_not_divide_res_in_one_line(tmp_path, save_tiny, capsys):
    import vit_export
    from vit_export.cli import main as export_main

    ckpt = save_tiny(tmp_path / "m.safetensors", (32, 32), 0, ["a", "b"])
    out = tmp_path / "exports"
    assert export_main([str(ckpt), "--res", "48", "--patch-size", "10", "--out", str(out)]) != 0
    err = capsys.readouterr().err
    assert "--patch-size" in err and "patch size 10 does not divide the resolution 48x48" in err, err
    assert err.count("\n") == 1 and not out.exists()
    with pytest.raises(vit_export.OptionError, match="patch_size must be a positive integer, got 0"):
        vit_export.ExportOptions(patch_size=0)
