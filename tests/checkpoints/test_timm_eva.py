"""timm `Eva` state dicts (DINOv3, PE, EVA-02, RoPE-ViT) -> our model. Reference: timm 1.0.31's own `Eva` (random
weights, tiny widths), with dynamic_img_size=True so that it computes its RoPE tables and resamples its absolute
embeddings at a size it was not built at: 12 x 9 patches."""

import pytest
import torch

from vit_serve.checkpoints import build_model
from vit_serve.checkpoints.timm_state import convert_timm
from vit_serve.config import get_config
from vit_serve.model import VisionTransformer

timm = pytest.importorskip("timm")

# name -> overrides of timm.create_model (tiny: width 16 per head, 2 blocks); those a timm hub config.json records
# in model_args (num_heads, img_size, global_pool, ref_feat_shape) reach our converter the same way.
CASES = {
    "vit_small_patch16_dinov3": dict(embed_dim=96, img_size=64, global_pool="token"),
    "vit_small_patch16_dinov3-avg": dict(embed_dim=96, img_size=64, global_pool="avg"),
    "vit_small_plus_patch16_dinov3_qkvb": dict(embed_dim=96, img_size=64, global_pool="token"),
    "vit_pe_core_tiny_patch16_384": dict(embed_dim=48, img_size=64, ref_feat_shape=(4, 4)),
    "vit_pe_spatial_tiny_patch16_512": dict(embed_dim=48, img_size=64, ref_feat_shape=(4, 4)),
    "vit_pe_lang_large_patch14_448": dict(embed_dim=64, num_heads=4, img_size=56, ref_feat_shape=(4, 4)),
    "vit_small_patch16_lingbot": dict(embed_dim=96, img_size=64),
    "eva02_tiny_patch14_224": dict(embed_dim=48, img_size=56),
    "eva_giant_patch14_224": dict(embed_dim=64, num_heads=4, img_size=56),
    "eva02_base_patch14_224": dict(embed_dim=96, num_heads=6, img_size=56),
    "eva02_base_patch16_clip_224": dict(embed_dim=96, num_heads=6, img_size=64),
    "vit_small_patch16_rope_224": dict(embed_dim=96, img_size=64),
    "vit_small_patch16_rope_mixed_ape_224": dict(embed_dim=96, img_size=64),
    "vit_medium_patch16_rope_reg1_gap_256": dict(embed_dim=128, img_size=64),
}
_HUB_ARGS = ("num_heads", "img_size", "global_pool", "ref_feat_shape")


@torch.no_grad()
def _reference(case):
    name = case.split("-")[0]
    ref = timm.create_model(name, pretrained=False, num_classes=10, depth=2, dynamic_img_size=True, **CASES[case])
    g = torch.Generator().manual_seed(0)
    for p in ref.state_dict().values():  # zero-initialised biases, LayerScale 1e-5: nothing may stay trivial
        if p.is_floating_point():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return name, ref.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_eva_matches_timm_at_native_and_non_square_sizes(case):
    name, ref = _reference(case)
    hub = {"architecture": name, "model_args": {k: v for k, v in CASES[case].items() if k in _HUB_ARGS}}
    ours = build_model(convert_timm(ref.state_dict(), name, hub_config=hub))
    assert ours.cfg.family == get_config(name).family
    p = ours.cfg.patch_size
    for h, w in (ours.cfg.img_size, (12 * p, 9 * p)):
        x = torch.randn(2, 3, h, w, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected = ref(x)
            pre_expected = ref.forward_head(ref.forward_features(x), pre_logits=True)
            logits, pre = ours.forward_embedding(x)
            explicit, attentions = ours(x, return_attention=True)
        errs = [(t - e).abs().max().item() for t, e in ((logits, expected), (pre, pre_expected), (explicit, expected))]
        print(f"{case} {h}x{w}: |Δ| logits {errs[0]:.1e} embedding {errs[1]:.1e} explicit {errs[2]:.1e} "
              f"(max |logit| {expected.abs().max():.2f})")
        assert max(errs) <= 1e-4
        assert len(attentions) >= 2 and attentions[0].shape[-1] == ours.num_prefix_tokens + h * w // p**2


def test_dinov3_embeds_with_the_class_token_and_no_absolute_embeddings():
    """DINOv3's embedding is its class token as upstream uses it (timm pools the patch average by default)."""
    cfg = get_config("vit_base_patch16_dinov3")
    assert cfg.pool == "token" and not cfg.pos_embed and cfg.rope.kind == "dinov3" and cfg.reg_tokens == 4
    assert get_config("vit_pe_core_large_patch14_336").rope.ref_grid == (24, 24)


def test_a_checkpoint_that_does_not_fit_its_architecture_is_an_error():
    """An EVA-02 state dict named as a DINOv3: the keys do not fit that architecture, and nothing loads."""
    _, ref = _reference("eva02_tiny_patch14_224")
    with pytest.raises(ValueError, match=r"does not fit the model|cannot infer"):
        build_model(convert_timm(ref.state_dict(), "vit_small_patch16_dinov3"))


MODULES = ("vision_transformer", "deit", "eva", "beit", "naflexvit")


def _claim_or_refusal(name):
    """("claimed", config) or ("refused", the one-line reason); anything else fails the test."""
    try:
        return "claimed", get_config(name)
    except ValueError as e:
        msg = str(e)
        assert msg.startswith(f"model {name!r} is not supported: ") and "\n" not in msg, msg
        return "refused", msg


@pytest.mark.parametrize("module", MODULES)
def test_every_timm_name_is_claimed_or_refused_in_one_line(module):
    """timm's registry (timm.list_models(module=...)): no name falls through to key sniffing."""
    names = timm.list_models(module=module)
    assert names, module
    verdicts = {n: _claim_or_refusal(n) for n in names}
    claimed = [n for n, (v, _) in verdicts.items() if v == "claimed"]
    print(f"{module}: {len(claimed)} of {len(names)} claimed")
    if module == "eva":  # each claimed family has a parity case above
        assert {verdicts[n][1].family for n in claimed} <= {get_config(c.split("-")[0]).family for c in CASES}
        assert verdicts["vit_7b_patch16_dinov3"][0] == "refused"


@pytest.mark.parametrize("name", [n for n in timm.list_models(module="eva") if _claim_or_refusal(n)[0] == "claimed"])
def test_every_claimed_eva_name_builds_timms_shapes(name):
    """Every claimed Eva architecture at its real size (meta device): our parameters are timm's, plus the zero key
    bias our fused qkv carries where EVA has q / v biases only; grid and the MLP's width as timm's."""
    cfg = get_config(name, num_classes=0)
    with torch.device("meta"):
        ref = timm.create_model(name, pretrained=False, num_classes=0)
        ours = VisionTransformer(cfg)
    extra = 0 if cfg.k_bias or not cfg.qkv_bias else cfg.depth * cfg.embed_dim
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in ref.parameters()) + extra
    assert cfg.grid_size == tuple(ref.patch_embed.grid_size)
    assert cfg.num_prefix_tokens == ref.num_prefix_tokens and (cfg.rope is None) == (ref.rope is None)


def test_cli_converts_a_timm_eva_hub_folder_and_our_file_keeps_the_rope(tmp_path):
    """`vit-serve convert` of a timm hub folder (config.json + model.safetensors, as timm's save_for_hf writes it):
    our file's config (RoPE, SwiGLU, q/v biases) round-trips and gives timm's logits at a non-square size."""
    import subprocess
    import sys

    from timm.models._hub import save_for_hf

    import vit_serve

    case = "eva02_tiny_patch14_224"
    _, ref = _reference(case)
    save_for_hf(ref, tmp_path / "hub", safe_serialization=True, model_args=dict(img_size=56))
    dst = tmp_path / "eva02.safetensors"
    r = subprocess.run([sys.executable, "-m", "vit_serve", "convert", str(tmp_path / "hub"), str(dst)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    model = vit_serve.load(dst)
    assert model.cfg.rope is not None and model.cfg.rope.ref_grid == (16, 16) and model.cfg.mlp == "swiglu"
    x = torch.randn(1, 3, 12 * 14, 9 * 14, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (model(x) - ref(x)).abs().max() <= 1e-4
