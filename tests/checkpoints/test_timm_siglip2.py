"""timm's fixed-resolution SigLIP 2 (`vit_*_siglip_*.v2_webli`) is timm's SigLIP tower as is: the `.v2_webli` tag
names weights, not an architecture (same VisionTransformer, MAP head, no class token, exact GELU for the base
shape). Reference: timm itself (random weights), at the native size and at a non-square size it resamples at run
time (`dynamic_img_size`)."""

import pytest
import torch

from vit_serve.checkpoints import build_model, read_checkpoint

timm = pytest.importorskip("timm")
from timm.models._hub import save_for_hf  # noqa: E402

NAME = "vit_base_patch16_siglip_224.v2_webli"


def test_v2_webli_is_the_siglip_tower(tmp_path):
    ref = timm.create_model(NAME, pretrained=False, embed_dim=96, depth=2, num_heads=12, img_size=32,
                            num_classes=0, dynamic_img_size=True).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ref.state_dict().values():
            if p.is_floating_point():
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    assert ref.pretrained_cfg["tag"] == "v2_webli"
    save_for_hf(ref, tmp_path / "hub", safe_serialization=True, model_args=dict(num_heads=12))
    ours = build_model(read_checkpoint(tmp_path / "hub"))
    c = ours.cfg
    assert (c.family, c.pool, c.class_token, c.gelu, c.resample_mode) == ("siglip", "map", False, "exact", "timm")
    for size in ((32, 32), (32, 48)):
        x = torch.randn(2, 3, *size, generator=g)
        with torch.no_grad():
            want = ref(x)
            got = ours.forward_embedding(x)[1]
        assert (got - want).abs().max() <= 1e-4, size
