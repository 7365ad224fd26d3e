"""Hugging Face transformers DINOv3 ViT folders (model_type dinov3_vit) -> ours, and the HF folders we refuse.

Reference: the installed transformers' `DINOv3ViTModel` built from tiny configs with random non-trivial weights
(conftest.randomize_; LayerScale gammas, biases, [class] and register tokens all random) and written with
`save_pretrained`; nothing downloaded. Compared: `pooler_output` (the [class] token, DINOv3's embedding) and
`last_hidden_state` (every token after the final LayerNorm), at the native size and at sizes the model was not
built at (non-square included): RoPE follows the grid in both, nothing resampled.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from vit_serve.checkpoints import load  # noqa: E402
from vit_serve.checkpoints.hf_models import convert_hf  # noqa: E402
from vit_serve.checkpoints.unsupported import UnsupportedCheckpoint  # noqa: E402
from vit_serve.cli import main  # noqa: E402

T = transformers
_BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=96, image_size=32,
             patch_size=8)
CONFIGS = {
    # DINOv3's ViT-S/B/L shape: GELU MLP, no key bias, LayerScale, no registers
    "plain": dict(_BASE, layerscale_value=0.5),
    # ViT-H+/7B shape: SwiGLU, registers, and the other biases switched off / on
    "swiglu_reg": dict(_BASE, use_gated_mlp=True, hidden_act="silu", num_register_tokens=4, key_bias=True,
                       proj_bias=False, mlp_bias=False, rope_theta=50.0),
}
SIZES = ((32, 32), (48, 24), (40, 56))


@pytest.fixture(scope="module")
def folders(tmp_path_factory, randomize):
    out = {}
    for i, (kind, kw) in enumerate(CONFIGS.items()):
        ref = randomize(T.DINOv3ViTModel(T.DINOv3ViTConfig(**kw)), seed=20 + i)
        folder = tmp_path_factory.mktemp(kind)
        ref.save_pretrained(folder)
        out[kind] = (folder, ref)
    return out


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_dinov3_equals_hf_at_native_and_other_sizes(folders, kind):
    folder, ref = folders[kind]
    ours = load(folder)
    c = ours.cfg
    assert (c.family, c.pool, c.pos_embed, c.rope.kind, c.rope.rotate_half) == ("dinov3", "token", False, "dinov3",
                                                                                   True)
    assert c.num_prefix_tokens == 1 + CONFIGS[kind].get("num_register_tokens", 0) and ours.labels is None
    assert c.mlp == ("swiglu" if kind == "swiglu_reg" else "gelu")
    assert ours.preprocess_cfg.mean == (0.485, 0.456, 0.406) and ours.preprocess_cfg.interpolation == "bilinear"
    g = torch.Generator().manual_seed(1)
    for size in SIZES:
        x = torch.randn(2, 3, *size, generator=g)
        with torch.no_grad():
            want = ref(pixel_values=x)
            tokens = ours.forward_features(x)
            emb = ours.forward_head(tokens, pre_logits=True)
            explicit = ours(x, return_attention=True)[0]  # the explicit attention path: no head, the embedding
        err = max((t - want.pooler_output).abs().max().item() for t in (emb, explicit))
        tok_err = (tokens - want.last_hidden_state).abs().max().item()
        print(f"HF DINOv3 {kind} {size[0]}x{size[1]}: max |diff| class {err:.2e}, tokens {tok_err:.2e}")
        assert want.pooler_output.abs().max() > 0.5 and err <= 1e-4 and tok_err <= 1e-4


def test_hub_and_in_memory_names_convert_identically(folders):
    """transformers 5 names the encoder `model.layer.*` in memory; the hub's files `layer.*` (its
    conversion_mapping renames them on load): both convert to the same weights."""
    _, ref = folders["plain"]
    sd = ref.state_dict()
    assert any(k.startswith("model.layer.") for k in sd)
    hub = {k.removeprefix("model."): v for k, v in sd.items()}
    a = convert_hf(ref.config.to_dict(), sd).state_dict
    b = convert_hf(ref.config.to_dict(), hub).state_dict
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "blocks.0.attn.qkv.bias" in a and not any("mask_token" in k for k in a)


def test_embedding_recorded_as_the_class_token(folders):
    """The manifest's embedding: HF's pooler_output, the [class] token (DINOv3's own; pool "token" in the config)."""
    from vit_serve.manifest import embedding_of

    folder, _ = folders["plain"]
    cfg = load(folder).cfg
    assert (embedding_of(cfg).kind, embedding_of(cfg).dim, cfg.pool) == ("pooler_output", 64, "token")


def test_img_size_override_needs_no_resampling(folders):
    folder, ref = folders["swiglu_reg"]
    ours = load(folder, img_size=(48, 24))
    assert ours.cfg.img_size == (48, 24) and ours.preprocess_cfg.input_size == (48, 24)
    x = torch.randn(1, 3, 48, 24, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = (ours.forward_head(ours.forward_features(x), pre_logits=True)
               - ref(pixel_values=x).pooler_output).abs().max().item()
    assert err <= 1e-4


@pytest.mark.parametrize("model_type, width, message", [
    ("radio", 64, "RADIO"), ("dinov3_convnext", 64, "ConvNeXt"), ("some_new_vit", 64, "not supported"),
    ("dinov3_vit", 4096, "the 7B DINOv3")])
def test_unsupported_model_types_refused_in_one_line(tmp_path, capsys, model_type, width, message):
    """Refused by config.json (model_type, the 7B's width: the architecture), before any weights are read (the
    folders here have none)."""
    folder = tmp_path / model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": width}))
    with pytest.raises(UnsupportedCheckpoint, match=message):
        load(folder)
    dst = tmp_path / "out.safetensors"
    assert main(["convert", str(folder), str(dst)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and not dst.exists()


def test_backbone_folder_converts_as_the_model(folders, tmp_path):
    """`DINOv3ViTBackbone` (the detection / segmentation wrapper) holds the same weights: its folder gives the same
    model, whose patch tokens are the backbone's last feature map."""
    _, ref = folders["swiglu_reg"]
    backbone = T.DINOv3ViTBackbone(T.DINOv3ViTConfig(**CONFIGS["swiglu_reg"], out_indices=[2])).eval()
    backbone.load_state_dict(ref.state_dict())
    backbone.save_pretrained(tmp_path)
    ours = load(tmp_path)
    x = torch.randn(1, 3, 48, 24, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        (fmap,) = backbone(pixel_values=x).feature_maps  # [1, D, 6, 3]
        tokens = ours.forward_features(x)[:, ours.cfg.num_prefix_tokens:]
    assert (tokens - fmap.flatten(2).transpose(1, 2)).abs().max() <= 1e-4
