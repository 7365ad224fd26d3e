"""timm's DeiT, DINOv2 (+registers), CLIP and SigLIP state dicts -> our model. Reference: timm itself (random
weights), at the native size and resampled (timm's checkpoint_filter_fn into a model built at the new size)."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from vit_serve.checkpoints import CheckpointError, build_model, read_checkpoint
from vit_serve.checkpoints.timm_state import convert_timm

timm = pytest.importorskip("timm")
from timm.models._hub import save_for_hf  # noqa: E402
from timm.models.vision_transformer import checkpoint_filter_fn  # noqa: E402

# name -> (heads of the arch, img, resampled img); width 8 * heads so that --arch alone gives the heads.
FAMILIES = {
    "deit_small_distilled_patch16_224": (6, 32, 48),
    "vit_small_patch14_dinov2": (6, 28, 42),
    "vit_small_patch14_reg4_dinov2": (6, 28, 56),
    "vit_giant_patch14_dinov2": (24, 28, 42),
    "vit_base_patch16_clip_224": (12, 32, 48),
    "vit_base_patch16_clip_quickgelu_224": (12, 32, 48),
    "vit_base_patch16_siglip_224": (12, 32, 48),
}


def _tiny(name, img, **kw):
    heads = FAMILIES[name][0]
    return timm.create_model(name, pretrained=False, embed_dim=8 * heads, depth=2, num_heads=heads, img_size=img,
                             num_classes=10, **kw)


@torch.no_grad()
def _randomised(name, img):
    m = _tiny(name, img)
    g = torch.Generator().manual_seed(0)
    for p in m.state_dict().values():
        if p.is_floating_point():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return m.eval()


def _errs(ours, ref, img):
    x = torch.randn(2, 3, img, img, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        t_ref, t = ref.forward_features(x), ours.forward_features(x)
        return ((ours.forward_head(t) - ref.forward_head(t_ref)).abs().max().item(),
                (ours.forward_head(t, pre_logits=True) - ref.forward_head(t_ref, pre_logits=True)).abs().max().item())


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_timm(name, tmp_path):
    _, img, new = FAMILIES[name]
    ref = _randomised(name, img)
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    save_for_hf(ref, tmp_path / "hub", safe_serialization=True, model_args=dict(num_heads=FAMILIES[name][0]))
    save_file(sd, tmp_path / "bare.safetensors")
    hub = build_model(read_checkpoint(tmp_path / "hub"))
    bare = build_model(read_checkpoint(tmp_path / "bare.safetensors", arch=name))
    family = next(f for f in ("deit", "dinov2", "clip", "siglip") if f in name)
    assert hub.cfg == bare.cfg and bare.cfg.family == family
    for ours in (hub, bare):
        logits, pre = _errs(ours, ref, img)
        print(f"{name} native: |Δ| logits {logits:.1e} pre-logits {pre:.1e}")
        assert logits <= 1e-5 and pre <= 1e-5
    # Resampled: timm's own filter into a model built at the new size vs ours set_resolution (convert --res).
    big = _tiny(name, new).eval()
    big.load_state_dict(checkpoint_filter_fn(sd, big))
    bare.set_resolution(new)
    logits, pre = _errs(bare, big, new)
    print(f"{name} {img}->{new}: |Δ| logits {logits:.1e} pre-logits {pre:.1e}")
    assert logits <= 1e-5 and pre <= 1e-5


def test_cli_converts_a_timm_hub_folder(tmp_path):
    ref = _randomised("vit_small_patch14_reg4_dinov2", 28)
    save_for_hf(ref, tmp_path / "hub", safe_serialization=True, model_args=dict(num_heads=6))
    dst = tmp_path / "out.safetensors"
    r = subprocess.run([sys.executable, "-m", "vit_serve", "convert", str(tmp_path / "hub"), str(dst), "--res", "42"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    import vit_serve

    m = vit_serve.load(dst)
    assert m.cfg.reg_tokens == 4 and m.cfg.no_embed_class and m.cfg.img_size == (42, 42)


def _refusal_cases():
    """Refused by architecture, in one line; a bare state dict (PE-Core's: its RoPE has no keys) needs --arch."""
    pe = timm.create_model("vit_pe_core_tiny_patch16_384", pretrained=False, depth=1, img_size=32, num_classes=2)
    beit = timm.create_model("beit_base_patch16_224", pretrained=False, embed_dim=96, depth=1, img_size=32,
                             num_classes=2)
    aim = timm.create_model("aimv2_large_patch14_224", pretrained=False, embed_dim=64, num_heads=4, depth=1,
                            img_size=28, num_classes=2)
    big = timm.create_model("vit_7b_patch16_dinov3", pretrained=False, embed_dim=64, num_heads=2, depth=1,
                            img_size=32, num_classes=2)
    return {"bare_pe": (pe, None, "pass --arch NAME"),
            "beit": (beit, "beit_base_patch16_224", "relative position bias"),
            "rmsnorm": (aim, "aimv2_large_patch14_224", "RMSNorm"), "dinov3_7b": (big, "vit_7b_patch16_dinov3", "7B")}


@pytest.mark.parametrize("case", ["bare_pe", "beit", "rmsnorm", "dinov3_7b"])
def test_unsupported_models_are_refused_in_one_line(case, tmp_path):
    model, arch, what = _refusal_cases()[case]
    src = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, src)
    with pytest.raises(CheckpointError, match=what):
        convert_timm(model.state_dict(), arch)
    dst = tmp_path / "out.safetensors"
    argv = [sys.executable, "-m", "vit_serve", "convert", str(src), str(dst)] + (["--arch", arch] if arch else [])
    r = subprocess.run(argv, capture_output=True, text=True)
    assert r.returncode == 2 and what in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not dst.exists()
