"""Tests for vit_serve.checkpoints.jax_npz (vit_jax / AugReg / big_vision .npz checkpoints).

The reference is timm: `timm.models.vision_transformer._load_weights` (its official-checkpoint loader) and
timm's own VisionTransformer / hybrid forward passes. The .npz files are written by `timm_to_npz`, which
inverts `_load_weights`; each test first checks that timm's loader reads the file back to the very same
weights, so the files are in the layout timm (and vit_jax) read. Models are tiny and randomly initialised;
nothing is downloaded.
"""

from __future__ import annotations

import copy
import math
from functools import partial

import numpy as np
import pytest
import torch

from vit_serve.checkpoints.converted import CheckpointError, build_model
from vit_serve.checkpoints.io import read_npz
from vit_serve.checkpoints.jax_npz import convert_npz, is_npz_layout

timm = pytest.importorskip("timm")
from timm.layers import HybridEmbed  # noqa: E402
from timm.models.vision_transformer import VisionTransformer as TimmViT  # noqa: E402
from timm.models.vision_transformer import _load_weights  # noqa: E402
from timm.models.vision_transformer_hybrid import _resnetv2  # noqa: E402

ATOL = 1e-5


# --------------------------------------------------------------------------------------------------------
# timm model -> .npz (the inverse of timm's `_load_weights`)
# --------------------------------------------------------------------------------------------------------


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.float32)


def _conv(w: torch.Tensor) -> np.ndarray:
    return _np(w).transpose(2, 3, 1, 0)  # OIHW -> HWIO


def timm_to_npz(
    model: torch.nn.Module, layout: str = "vit_jax", stacked: bool = False
) -> dict[str, np.ndarray]:
    """A timm VisionTransformer (plain or hybrid) as a flax parameter tree, inverting `_load_weights`.

    layout "vit_jax": `Transformer/posembed_input/pos_embedding`, blocks `encoderblock_{i}` with
    MultiHeadDotProductAttention_1 / LayerNorm_2 / MlpBlock_3. layout "big_vision": `params/` prefix,
    top-level `pos_embedding`, MultiHeadDotProductAttention_0 / LayerNorm_1 / MlpBlock_0, and with `stacked`
    one `Transformer/encoderblock/` whose arrays carry a leading depth axis (flax nn.scan).
    """
    big_vision = layout == "big_vision"
    p = "params/" if big_vision else ""
    w: dict[str, np.ndarray] = {}
    pe = model.patch_embed
    if hasattr(pe, "backbone"):
        bb = pe.backbone
        stem = bb.stem if hasattr(bb, "stem") else bb
        w[f"{p}conv_root/kernel"] = _conv(stem.conv.weight)
        w[f"{p}gn_root/scale"], w[f"{p}gn_root/bias"] = _np(stem.norm.weight), _np(stem.norm.bias)
        for i, stage in enumerate(getattr(bb, "stages", [])):
            for j, blk in enumerate(stage.blocks):
                bp = f"{p}block{i + 1}/unit{j + 1}/"
                for r in (1, 2, 3):
                    w[f"{bp}conv{r}/kernel"] = _conv(getattr(blk, f"conv{r}").weight)
                    w[f"{bp}gn{r}/scale"] = _np(getattr(blk, f"norm{r}").weight)
                    w[f"{bp}gn{r}/bias"] = _np(getattr(blk, f"norm{r}").bias)
                if blk.downsample is not None:
                    w[f"{bp}conv_proj/kernel"] = _conv(blk.downsample.conv.weight)
                    w[f"{bp}gn_proj/scale"] = _np(blk.downsample.norm.weight)
                    w[f"{bp}gn_proj/bias"] = _np(blk.downsample.norm.bias)
    w[f"{p}embedding/kernel"] = _conv(pe.proj.weight)
    w[f"{p}embedding/bias"] = _np(pe.proj.bias)
    if model.cls_token is not None:
        w[f"{p}cls"] = _np(model.cls_token)
    pos_key = "pos_embedding" if big_vision else "Transformer/posembed_input/pos_embedding"
    w[p + pos_key] = _np(model.pos_embed)
    w[f"{p}Transformer/encoder_norm/scale"] = _np(model.norm.weight)
    w[f"{p}Transformer/encoder_norm/bias"] = _np(model.norm.bias)
    if isinstance(model.head, torch.nn.Linear):
        w[f"{p}head/kernel"], w[f"{p}head/bias"] = _np(model.head.weight).T, _np(model.head.bias)

    mha, ln2, mlp = (
        ("MultiHeadDotProductAttention_0", "LayerNorm_1", "MlpBlock_0")
        if big_vision
        else ("MultiHeadDotProductAttention_1", "LayerNorm_2", "MlpBlock_3")
    )
    layers = []
    for blk in model.blocks:
        d = blk.norm1.weight.shape[0]
        heads = blk.attn.num_heads
        b: dict[str, np.ndarray] = {
            "LayerNorm_0/scale": _np(blk.norm1.weight),
            "LayerNorm_0/bias": _np(blk.norm1.bias),
            f"{ln2}/scale": _np(blk.norm2.weight),
            f"{ln2}/bias": _np(blk.norm2.bias),
        }
        qkv_w = _np(blk.attn.qkv.weight).reshape(3, d, d)  # [3, out, in]
        qkv_b = _np(blk.attn.qkv.bias).reshape(3, d)
        for n, name in enumerate(("query", "key", "value")):
            b[f"{mha}/{name}/kernel"] = qkv_w[n].T.reshape(d, heads, d // heads)
            b[f"{mha}/{name}/bias"] = qkv_b[n].reshape(heads, d // heads)
        b[f"{mha}/out/kernel"] = _np(blk.attn.proj.weight).reshape(d, heads, d // heads).transpose(1, 2, 0)
        b[f"{mha}/out/bias"] = _np(blk.attn.proj.bias)
        for r, fc in enumerate((blk.mlp.fc1, blk.mlp.fc2)):
            b[f"{mlp}/Dense_{r}/kernel"] = _np(fc.weight).T
            b[f"{mlp}/Dense_{r}/bias"] = _np(fc.bias)
        layers.append(b)
    if stacked:
        for k in layers[0]:
            w[f"{p}Transformer/encoderblock/{k}"] = np.stack([b[k] for b in layers])
    else:
        for i, b in enumerate(layers):
            w.update({f"{p}Transformer/encoderblock_{i}/{k}": v for k, v in b.items()})
    return {k: np.ascontiguousarray(v) for k, v in w.items()}


# --------------------------------------------------------------------------------------------------------
# Reference models
# --------------------------------------------------------------------------------------------------------


def _timm_tiny(randomize, seed: int = 0) -> torch.nn.Module:
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, act_layer="gelu_tanh")
    return randomize(model, seed)


def _timm_small_vit(randomize, seed: int = 0, **kw) -> torch.nn.Module:
    args = dict(
        img_size=64, patch_size=16, embed_dim=192, depth=2, num_heads=3, num_classes=10, act_layer="gelu_tanh"
    )
    return randomize(TimmViT(**{**args, **kw}), seed)


def _timm_hybrid(randomize, layers: tuple[int, ...], kernel: int, seed: int = 0) -> torch.nn.Module:
    embed = partial(HybridEmbed, backbone=_resnetv2(layers))
    model = TimmViT(
        img_size=64,
        patch_size=kernel,
        embed_dim=192,
        depth=2,
        num_heads=3,
        num_classes=10,
        act_layer="gelu_tanh",
        embed_layer=embed,
    )
    return randomize(model, seed)


def _fresh_like(model: torch.nn.Module) -> torch.nn.Module:
    """Same architecture, different weights: what timm's loader must overwrite completely."""
    fresh = copy.deepcopy(model)
    with torch.no_grad():
        for prm in fresh.parameters():
            prm.normal_()
    return fresh


def _save(tmp_path, name: str, arrays: dict[str, np.ndarray]):
    path = tmp_path / name
    np.savez(path, **arrays)
    return path


def _assert_timm_reads_back(model: torch.nn.Module, path) -> None:
    """timm's own `_load_weights` turns our file into exactly the weights it was written from."""
    fresh = _fresh_like(model)
    _load_weights(fresh, str(path))
    ref, got = model.state_dict(), fresh.state_dict()
    for k, v in ref.items():
        assert torch.equal(got[k], v), f"timm's _load_weights read {k} back differently"


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _parity(model: torch.nn.Module, ours: torch.nn.Module, img: int, label: str) -> tuple[float, float]:
    x = torch.randn(2, 3, img, img, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = model(x)
        fused = ours(x)
        explicit = ours(x, return_attention=True)[0]
    e_fused, e_explicit = _max_err(fused, ref), _max_err(explicit, ref)
    print(
        f"{label}: |logits| max {ref.abs().max().item():.2f}, max |Δ| fused {e_fused:.2e}, "
        f"explicit {e_explicit:.2e}"
    )
    assert ref.abs().max() > 1.0  # logits are O(1-10), so the absolute tolerance means something
    assert e_fused <= ATOL and e_explicit <= ATOL
    return e_fused, e_explicit


def _load_ours(path, **overrides):
    conv = convert_npz(read_npz(path), **overrides)
    return conv, build_model(conv)


# --------------------------------------------------------------------------------------------------------
# 1. Plain ViT: reference timm vit_tiny_patch16_224 + timm's _load_weights
# --------------------------------------------------------------------------------------------------------


def test_vit_tiny_parity_with_timm(tmp_path, randomize):
    model = _timm_tiny(randomize)
    arrays = timm_to_npz(model)
    assert is_npz_layout(arrays)
    path = _save(tmp_path, "vit_tiny.npz", arrays)
    _assert_timm_reads_back(model, path)

    conv, ours = _load_ours(path)
    cfg = conv.config
    assert (cfg.img_size, cfg.patch_size, cfg.embed_dim, cfg.depth, cfg.num_heads, cfg.mlp_dim) == (
        (224, 224),
        16,
        192,
        12,
        3,
        768,
    )
    assert (cfg.num_classes, cfg.class_token, cfg.pool, cfg.qkv_bias, cfg.representation_size) == (
        10,
        True,
        "token",
        True,
        None,
    )
    assert (cfg.gelu, cfg.layer_norm_eps, cfg.resample_mode, cfg.resnet_layers) == ("tanh", 1e-6, "jax", None)
    pre = conv.preprocess
    assert (pre.input_size, pre.mean, pre.std, pre.interpolation, pre.crop_pct) == (
        (224, 224),
        (0.5,) * 3,
        (0.5,) * 3,
        "bicubic",
        0.9,
    )
    assert conv.labels is None  # a 10-class head has no known class names
    for k, v in model.state_dict().items():  # same names, same values
        assert torch.equal(conv.state_dict[k], v), k
    _parity(model, ours, 224, "vit_tiny_patch16_224 vs timm")


# --------------------------------------------------------------------------------------------------------
# 2. representation_size / pre_logits: reference = hand-written tanh(W x + b) (timm dropped pre_logits)
# --------------------------------------------------------------------------------------------------------


def test_pre_logits_against_hand_written_expectation(tmp_path, randomize):
    model = _timm_small_vit(randomize)
    arrays = timm_to_npz(model)
    rep, k = 48, 10
    rng = np.random.default_rng(0)
    kernel = (rng.standard_normal((192, rep)) / math.sqrt(192)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(rep)).astype(np.float32)
    head_k = rng.standard_normal((rep, k)).astype(np.float32)
    head_b = (0.1 * rng.standard_normal(k)).astype(np.float32)
    arrays.update(
        {"pre_logits/kernel": kernel, "pre_logits/bias": bias, "head/kernel": head_k, "head/bias": head_b}
    )
    conv, ours = _load_ours(_save(tmp_path, "pre_logits.npz", arrays))
    assert conv.config.representation_size == rep and conv.config.num_classes == k

    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        feats = ours.forward_features(x)
        e_feats = _max_err(feats, model.forward_features(x))  # the body is timm's
        pre = ours.forward_head(feats, pre_logits=True)
        logits = ours(x)
    expect_pre = np.tanh(_np(feats[:, 0]).astype(np.float64) @ kernel + bias)
    expect_logits = expect_pre @ head_k + head_b
    e_pre = np.abs(_np(pre) - expect_pre).max()
    e_logits = np.abs(_np(logits) - expect_logits).max()
    print(
        f"pre_logits: features vs timm {e_feats:.2e}, pre_logits {e_pre:.2e}, logits {e_logits:.2e} "
        f"(|logits| max {np.abs(expect_logits).max():.2f})"
    )
    assert pre.shape == (2, rep)
    assert e_feats <= ATOL and e_pre <= ATOL and e_logits <= ATOL


# --------------------------------------------------------------------------------------------------------
# 3. GAP model (no [class] token): reference timm VisionTransformer(global_pool='avg', class_token=False)
# --------------------------------------------------------------------------------------------------------


def test_gap_model_parity_with_timm(tmp_path, randomize):
    model = _timm_small_vit(randomize, class_token=False, global_pool="avg", fc_norm=False)
    path = _save(tmp_path, "gap.npz", timm_to_npz(model))
    _assert_timm_reads_back(model, path)
    conv, ours = _load_ours(path)
    assert (conv.config.class_token, conv.config.pool, conv.config.img_size) == (False, "gap", (64, 64))
    assert "cls_token" not in conv.state_dict
    _parity(model, ours, 64, "GAP ViT vs timm")


# --------------------------------------------------------------------------------------------------------
# 4. Hybrid (paper §3.1): reference timm's HybridEmbed + ResNetV2 (`_resnetv2`) and timm's _load_weights
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layers, kernel", [((), 4), ((2, 1), 2), ((1, 1, 1), 1)])
def test_hybrid_parity_with_timm(tmp_path, randomize, layers, kernel):
    model = _timm_hybrid(randomize, layers, kernel)
    path = _save(tmp_path, "hybrid.npz", timm_to_npz(model))
    _assert_timm_reads_back(model, path)

    weights = read_npz(path)
    native = convert_npz(weights).config  # vit_jax's own numerics are recorded without overrides
    assert (native.std_conv_style, native.std_conv_eps, native.group_norm_eps) == ("std", 1e-5, 1e-6)
    assert (native.gelu, native.layer_norm_eps) == ("tanh", 1e-6)
    assert native.resnet_layers == layers and native.resnet_width == 64
    assert native.patch_size == 16 and native.img_size == (64, 64)

    # timm standardises with w / sqrt(var + 1e-8) and uses GroupNorm eps 1e-5: match it for the parity.
    conv, ours = _load_ours(path, std_conv_style="var", std_conv_eps=1e-8, group_norm_eps=1e-5)
    for k, v in model.state_dict().items():
        if not layers:  # timm's stem-only backbone is the stem itself; ours keeps ResNetV2's names
            k = k.replace("patch_embed.backbone.", "patch_embed.backbone.stem.")
        assert torch.equal(conv.state_dict[k], v), k
    _parity(model, ours, 64, f"hybrid layers={layers} kernel={kernel} vs timm")


# --------------------------------------------------------------------------------------------------------
# 5. big_vision layout (params/ prefix, pos_embedding, stacked scan blocks): reference = the vit_jax layout
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("class_token", [True, False])
@pytest.mark.parametrize("stacked", [False, True])
def test_big_vision_layout_matches_vit_jax_layout(tmp_path, randomize, class_token, stacked):
    kw = {} if class_token else dict(class_token=False, global_pool="avg", fc_norm=False)
    model = _timm_small_vit(randomize, **kw)
    ref = convert_npz(timm_to_npz(model))
    path = _save(tmp_path, "bv.npz", timm_to_npz(model, layout="big_vision", stacked=stacked))
    _assert_timm_reads_back(model, path)
    conv = convert_npz(read_npz(path))
    assert conv.config == ref.config
    assert conv.source.startswith("big_vision")
    assert conv.state_dict.keys() == ref.state_dict.keys()
    for k, v in ref.state_dict.items():
        assert torch.equal(conv.state_dict[k], v), k


@pytest.mark.parametrize("prefix", ["opt/target/", "params/img/"])
def test_prefixed_layouts(randomize, prefix):
    model = _timm_small_vit(randomize)
    arrays = timm_to_npz(model)
    ref = convert_npz(arrays)
    conv = convert_npz({prefix + k: v for k, v in arrays.items()} | {"params/txt/unrelated": np.zeros(3)})
    assert conv.config == ref.config
    for k, v in ref.state_dict.items():
        assert torch.equal(conv.state_dict[k], v), k


def test_big_vision_class_token_without_position_slot(randomize):
    """big_vision adds pos_embedding to the patches before prepending [class]: a zero [class] slot for us."""
    model = _timm_small_vit(randomize)
    with torch.no_grad():
        model.pos_embed[:, 0] = 0
    arrays = timm_to_npz(model, layout="big_vision")
    arrays["params/pos_embedding"] = arrays["params/pos_embedding"][:, 1:]  # [1, N, D], no [class] slot
    conv = convert_npz(arrays)
    assert conv.config.img_size == (64, 64) and conv.config.class_token
    assert torch.equal(conv.state_dict["pos_embed"], model.pos_embed.detach())
    _parity(model, build_model(conv), 64, "big_vision [class] without position slot vs timm")


def test_dtypes_are_cast_to_float32(randomize):
    model = _timm_small_vit(randomize)
    arrays = timm_to_npz(model)
    ref = convert_npz(arrays)
    half = convert_npz({k: v.astype(np.float16 if "Dense" in k else np.float64) for k, v in arrays.items()})
    assert all(v.dtype == torch.float32 for v in half.state_dict.values())
    for k, v in ref.state_dict.items():
        atol = 2e-3 * v.abs().max().item() if "mlp" in k else 0
        torch.testing.assert_close(half.state_dict[k], v, atol=atol, rtol=0)


def test_preprocess_contract_at_384(randomize):
    model = _timm_small_vit(randomize)
    arrays = timm_to_npz(model)
    pos = arrays["Transformer/posembed_input/pos_embedding"]
    arrays["Transformer/posembed_input/pos_embedding"] = np.zeros((1, 1 + 24 * 24, pos.shape[-1]), np.float32)
    conv = convert_npz(arrays)
    assert conv.config.img_size == (384, 384) and conv.preprocess.crop_pct == 1.0
    assert conv.preprocess.input_size == (384, 384)


# --------------------------------------------------------------------------------------------------------
# 6. Bad input: clear CheckpointErrors (reference: what the file / key set is)
# --------------------------------------------------------------------------------------------------------


def test_truncated_npz_file(tmp_path, randomize):
    path = _save(tmp_path, "whole.npz", timm_to_npz(_timm_small_vit(randomize)))
    data = path.read_bytes()
    bad = tmp_path / "truncated.npz"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as info:
        read_npz(bad)
    assert type(info.value) is CheckpointError
    msg = str(info.value)
    assert "\n" not in msg and str(bad) in msg and "Traceback" not in msg


def test_missing_encoder_norm(randomize):
    arrays = timm_to_npz(_timm_small_vit(randomize))
    del arrays["Transformer/encoder_norm/scale"]
    assert is_npz_layout(arrays)
    with pytest.raises(CheckpointError, match="Transformer/encoder_norm/scale"):
        convert_npz(arrays)


def test_missing_keys_are_all_listed(randomize):
    arrays = timm_to_npz(_timm_small_vit(randomize))
    for k in ("Transformer/encoderblock_1/LayerNorm_2/bias", "head/bias", "embedding/bias"):
        del arrays[k]
    with pytest.raises(CheckpointError, match="missing 3 array") as info:
        convert_npz(arrays)
    assert "encoderblock_1/LayerNorm_2/bias" in str(info.value) and "head/bias" in str(info.value)


def test_unrelated_arrays():
    arrays = {"weights": np.zeros((3, 3), np.float32), "conv1/kernel": np.zeros((3, 3, 3, 8), np.float32)}
    assert not is_npz_layout(arrays)
    with pytest.raises(CheckpointError, match="embedding/kernel"):
        convert_npz(arrays)


def test_unexpected_arrays_are_reported(randomize):
    arrays = timm_to_npz(_timm_small_vit(randomize))
    arrays["Transformer/encoderblock_0/extra/kernel"] = np.zeros((2, 2), np.float32)
    with pytest.raises(CheckpointError, match="encoderblock_0/extra/kernel"):
        convert_npz(arrays)


def test_map_head_is_rejected(randomize):
    model = _timm_small_vit(randomize, class_token=False, global_pool="avg", fc_norm=False)
    arrays = timm_to_npz(model, layout="big_vision")
    arrays["params/MAPHead_0/probe"] = np.zeros((1, 1, 192), np.float32)
    with pytest.raises(CheckpointError, match="map pooling is not supported"):
        convert_npz(arrays)


def test_non_square_grid_fails_clearly(randomize):
    arrays = timm_to_npz(_timm_small_vit(randomize))
    arrays["Transformer/posembed_input/pos_embedding"] = np.zeros((1, 1 + 4 * 6, 192), np.float32)
    with pytest.raises(CheckpointError, match="square"):
        convert_npz(arrays)


def test_raw_bfloat16_arrays(randomize):
    """bfloat16 arrays saved without ml_dtypes come back from numpy as 2-byte void ('V2') words."""
    arrays = timm_to_npz(_timm_small_vit(randomize))
    key = "Transformer/encoderblock_0/MlpBlock_3/Dense_0/kernel"
    words = (arrays[key].view(np.uint32) >> 16).astype(np.uint16)
    arrays[key] = words.view(np.dtype("V2"))
    conv = convert_npz(arrays)
    expect = torch.from_numpy((words.astype(np.uint32) << 16).view(np.float32).T.copy())
    assert torch.equal(conv.state_dict["blocks.0.mlp.fc1.weight"], expect)


def test_overrides(randomize):
    arrays = timm_to_npz(_timm_small_vit(randomize))
    conv = convert_npz(arrays, layer_norm_eps=1e-5, gelu="exact")
    assert (conv.config.layer_norm_eps, conv.config.gelu) == (1e-5, "exact")
    with pytest.raises(TypeError, match="not_a_field"):
        convert_npz(arrays, not_a_field=1)
    with pytest.raises(CheckpointError, match="pool"):
        convert_npz(arrays, pool="bogus")


def _vit_jax_std_conv(conv: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """vit_jax's `models_resnet.StdConv`, written from its definition with torch primitives:
    w <- w - mean(w); w <- w / (std(w) + 1e-5), the moments over (H, W, in) of each output filter."""
    from timm.layers import pad_same

    w = conv.weight
    w = w - w.mean(dim=(1, 2, 3), keepdim=True)
    w = w / (w.pow(2).mean(dim=(1, 2, 3), keepdim=True).sqrt() + 1e-5)
    if conv.same_pad:
        x = pad_same(x, conv.kernel_size, conv.stride, conv.dilation)
    return torch.nn.functional.conv2d(x, w, None, conv.stride, conv.padding, conv.dilation, conv.groups)


@pytest.mark.parametrize("layers, kernel", [((2, 1), 2), ((1, 1, 1), 1)])
def test_hybrid_vit_jax_numerics(tmp_path, randomize, layers, kernel):
    """The hybrid as converted, with no overrides (vit_jax's numerics), against an independent reference:
    timm's hybrid with its weight standardisation replaced by vit_jax's (w - mean) / (std + 1e-5) and its
    GroupNorms at flax's default eps 1e-6."""
    from timm.layers import StdConv2dSame as TimmStdConv

    model = _timm_hybrid(randomize, layers, kernel)
    path = _save(tmp_path, "hybrid.npz", timm_to_npz(model))
    _, ours = _load_ours(path)  # the checkpoint's own numerics: std style, eps 1e-5, GroupNorm eps 1e-6
    timm_numerics = _parity_err(model, ours)
    reference = copy.deepcopy(model)
    swapped = 0
    for m in reference.modules():
        if isinstance(m, TimmStdConv):
            m.forward = partial(_vit_jax_std_conv, m)
            swapped += 1
        elif isinstance(m, torch.nn.GroupNorm):
            m.eps = 1e-6
    assert swapped >= 4
    err = _parity_err(reference, ours)
    print(f"hybrid layers={layers}: ours (vit_jax numerics) vs vit_jax reference {err:.2e}; "
          f"vs timm's numerics {timm_numerics:.2e}")
    assert err <= ATOL
    assert timm_numerics > 10 * err  # the reference tells the two numerics apart


def _parity_err(ref: torch.nn.Module, ours: torch.nn.Module) -> float:
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = ref(x)
        assert want.abs().max() > 1.0
        return max(_max_err(ours(x), want), _max_err(ours(x, return_attention=True)[0], want))
