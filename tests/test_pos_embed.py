"""resample_pos_embed against the implementation each mode is named after."""

import numpy as np
import pytest
import torch

from vit_serve.pos_embed import resample_pos_embed

GRIDS = [((14, 14), (24, 24)), ((14, 14), (24, 32)), ((24, 32), (14, 14)), ((7, 5), (9, 11))]


def _pos(grid, prefix=1, dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, prefix + grid[0] * grid[1], dim, generator=g)


@pytest.mark.parametrize("old, new", GRIDS)
def test_jax_mode_equals_scipy_zoom(old, new):
    """Reference: vit_jax checkpoint.interpolate_posembed, scipy.ndimage.zoom(order=1) on the grid."""
    scipy_ndimage = pytest.importorskip("scipy.ndimage")
    pos = _pos(old)
    grid = pos[0, 1:].numpy().astype(np.float64).reshape(old[0], old[1], -1)
    zoom = (new[0] / old[0], new[1] / old[1], 1)
    ref = scipy_ndimage.zoom(grid, zoom, order=1)
    assert ref.shape[:2] == new
    ours = resample_pos_embed(pos, old, new, 1, "jax")
    err = np.abs(ours[0, 1:].numpy().reshape(ref.shape) - ref).max()
    assert err <= 2e-6, err
    assert torch.equal(ours[:, :1], pos[:, :1])


@pytest.mark.parametrize("old, new", GRIDS)
@pytest.mark.parametrize("prefix", [0, 1])
def test_timm_mode_equals_timm(old, new, prefix):
    """Reference: timm.layers.resample_abs_pos_embed (bicubic, antialias)."""
    timm_layers = pytest.importorskip("timm.layers")
    pos = _pos(old, prefix)
    ref = timm_layers.resample_abs_pos_embed(pos, list(new), list(old), num_prefix_tokens=prefix)
    ours = resample_pos_embed(pos, old, new, prefix, "timm")
    assert (ours - ref).abs().max() <= 1e-6


@pytest.mark.parametrize("new", [(24, 24), (24, 32), (20, 16)])
def test_hf_mode_equals_transformers(new):
    """Reference: transformers ViTEmbeddings.interpolate_pos_encoding."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ViTConfig(hidden_size=32, image_size=224, patch_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=64)
    emb = transformers.models.vit.modeling_vit.ViTEmbeddings(cfg)
    with torch.no_grad():
        emb.position_embeddings.copy_(_pos((14, 14)))
        h, w = new[0] * 16, new[1] * 16
        ref = emb.interpolate_pos_encoding(torch.zeros(1, 1 + new[0] * new[1], 32), h, w)
    ours = resample_pos_embed(emb.position_embeddings.detach(), (14, 14), new, 1, "hf")
    assert (ours - ref).abs().max() <= 1e-6


@pytest.mark.parametrize("new", [(24, 24), (10, 10)])
def test_torchvision_mode_equals_torchvision(new):
    """Reference: torchvision.models.vision_transformer.interpolate_embeddings (square grids only)."""
    tv = pytest.importorskip("torchvision.models.vision_transformer")
    pos = _pos((14, 14))
    ref = tv.interpolate_embeddings(new[0] * 16, 16, {"encoder.pos_embedding": pos})["encoder.pos_embedding"]
    ours = resample_pos_embed(pos, (14, 14), new, 1, "torchvision")
    assert (ours - ref).abs().max() <= 1e-6


@pytest.mark.parametrize("mode", ["jax", "timm", "hf", "torchvision"])
def test_same_grid_is_exact_input(mode):
    pos = _pos((14, 10))
    assert resample_pos_embed(pos, (14, 10), (14, 10), 1, mode) is pos


def test_prefix_tokens_untouched_and_shape():
    pos = _pos((6, 8), prefix=1)
    out = resample_pos_embed(pos, (6, 8), (12, 4), 1, "timm")
    assert out.shape == (1, 1 + 48, 32)
    assert torch.equal(out[:, 0], pos[:, 0])


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown resample mode 'area'"):
        resample_pos_embed(_pos((4, 4)), (4, 4), (8, 8), 1, "area")
    with pytest.raises(ValueError, match="pos_embed has 17 tokens, expected 1 \\+ 5x5"):
        resample_pos_embed(_pos((4, 4)), (5, 5), (8, 8), 1, "timm")


# -- the portable (exported) form: weight matrices and matmul instead of F.interpolate / ONNX Resize ------------
PORTABLE_GRIDS = [*GRIDS, ((24, 24), (40, 14)), ((14, 14), (1, 1)), ((1, 1), (3, 4)), ((2, 3), (2, 3))]
F_MODES = {"jax": ("bilinear", True, False), "timm": ("bicubic", False, True), "hf": ("bicubic", False, False),
           "torchvision": ("bicubic", True, False)}


def _interpolate(x: torch.Tensor, size, mode: str) -> torch.Tensor:
    kind, align_corners, antialias = F_MODES[mode]
    return torch.nn.functional.interpolate(x, size=size, mode=kind, align_corners=align_corners, antialias=antialias)


@pytest.mark.parametrize("old, new", PORTABLE_GRIDS)
@pytest.mark.parametrize("mode", list(F_MODES))
def test_interpolation_weights_are_torch_kernels_formula(mode, old, new):
    """Reference: torch's F.interpolate in float64 (its CPU kernel's own weights, up / down, align_corners, antialias,
    size 1): the matrices applied on both axes reproduce it to float64 rounding."""
    from vit_serve.pos_embed import interpolation_weights

    x = torch.randn(1, 8, *old, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    kind, align_corners, antialias = F_MODES[mode]
    w_h = interpolation_weights(old[0], new[0], kind, align_corners, antialias, torch.float64)
    w_w = interpolation_weights(old[1], new[1], kind, align_corners, antialias, torch.float64)
    assert w_h.shape == (new[0], old[0]) and w_w.shape == (new[1], old[1])
    ours = torch.einsum("ai,cij,bj->cab", w_h, x[0], w_w)[None]
    assert (ours - _interpolate(x, new, mode)).abs().max() <= 1e-12


@pytest.mark.parametrize("old, new", PORTABLE_GRIDS)
@pytest.mark.parametrize("mode", list(F_MODES))
def test_portable_float32_is_within_rounding_of_the_exact_result(mode, old, new):
    """Reference: F.interpolate in float64 on the same grid. The float32 matmul form (what an exported graph runs) is
    within 5e-6 of it on N(0, 1) embeddings; torch's float32 kernel itself is up to ~1.1e-5 away at these grids,
    so the two float32 forms are compared through the exact result, not with each other."""
    pos = _pos(old)
    exact = _interpolate(pos[:, 1:].double().reshape(1, *old, -1).permute(0, 3, 1, 2), new, mode)
    exact = exact.permute(0, 2, 3, 1).reshape(1, -1, pos.shape[-1])
    ours = resample_pos_embed(pos, old, new, 1, mode, portable=True)
    assert ours.dtype == torch.float32 and ours.shape == (1, 1 + new[0] * new[1], 32)
    assert torch.equal(ours[:, :1], pos[:, :1])
    assert (ours[:, 1:].double() - exact).abs().max() <= 5e-6
    eager = resample_pos_embed(pos, old, new, 1, mode)
    assert (eager - ours).abs().max() <= 2e-5  # both float32 roundings of one result


@pytest.mark.parametrize("mode", list(F_MODES))
def test_portable_identity_is_exact(mode):
    """At the native grid (what a dynamic graph computes at its own size) the weights are exactly the identity."""
    from vit_serve.pos_embed import interpolation_weights

    kind, align_corners, antialias = F_MODES[mode]
    for n in (1, 7, 14, 24):
        assert torch.equal(interpolation_weights(n, n, kind, align_corners, antialias), torch.eye(n))


def test_export_keeps_the_portable_form_with_symbolic_size():
    """torch.export with a dynamic grid: no upsample op is captured (so no ONNX Resize), and the exported program
    matches the eager F.interpolate at grids other than the example's."""
    from torch.export import Dim, export

    class Resample(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = torch.nn.Parameter(_pos((14, 14)))

        def forward(self, x):
            return resample_pos_embed(self.pos, (14, 14), (x.shape[-2], x.shape[-1]), 1, "timm")

    m = Resample()
    ep = export(m, (torch.zeros(1, 1, 14, 14),), dynamic_shapes={"x": {2: Dim("h", max=64), 3: Dim("w", max=64)}})
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert not any("upsample" in o or "interpolate" in o for o in ops), ops
    assert any("matmul" in o or "mm" in o for o in ops), ops
    for size in [(24, 24), (20, 16), (9, 31)]:
        with torch.no_grad():
            got = ep.module()(torch.zeros(1, 1, *size))
            want = m(torch.zeros(1, 1, *size))
        assert (got - want).abs().max() <= 2e-5
