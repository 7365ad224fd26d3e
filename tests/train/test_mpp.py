"""vit_serve.train.mpp: masked patch prediction (paper §4.6, App. B.1.2)."""

from __future__ import annotations

import math

import pytest
import torch

import vit_serve
from vit_serve.data import digits_tensors
from vit_serve.train.mpp import MPPHead, MPPModel, corrupt_patches, denormalize, mpp_targets

TINY = vit_serve.ViTConfig(img_size=16, patch_size=4, embed_dim=64, depth=2, num_heads=4, mlp_dim=128, num_classes=10)


def test_mpp_targets_by_hand():
    # A 2 x 3 grid of 4 x 4 patches with known colours.
    colours = [
        [(1.0, 0.0, 0.0), (1.0, 1.0, 1.0), (0.0, 0.0, 0.0)],  # red, white, black
        [(0.0, 1.0, 0.0), (0.0, 0.0, 1.0), (0.5, 0.25, 0.99)],  # green, blue, mixed
    ]
    x = torch.zeros(1, 3, 8, 12)
    for i, row in enumerate(colours):
        for j, rgb in enumerate(row):
            x[0, :, 4 * i : 4 * i + 4, 4 * j : 4 * j + 4] = torch.tensor(rgb).view(3, 1, 1)
    # A patch whose mean (not its pixels) decides: half 0, half 0.5 -> mean 0.25 -> level 2 in every channel.
    x2 = torch.zeros(1, 3, 4, 4)
    x2[..., :2] = 0.5
    t = mpp_targets(x, patch_size=4)
    assert t.dtype == torch.long and t.shape == (1, 6)
    assert t[0].tolist() == [7 * 64, 511, 0, 7 * 8, 7, 4 * 64 + 2 * 8 + 7]
    assert mpp_targets(x2, 4).item() == 2 * 64 + 2 * 8 + 2
    assert int(t.max()) < MPPHead(8).num_classes == 512


def test_denormalize_inverts_the_preprocessing():
    cfg = vit_serve.PreprocessConfig(input_size=(16, 16), crop_pct=1.0)
    x, _ = digits_tensors("test", cfg)
    pixels = denormalize(x[:8], cfg.mean, cfg.std)
    assert float(pixels.min()) >= -1e-6 and float(pixels.max()) <= 1 + 1e-6
    mean, std = torch.tensor(cfg.mean).view(1, 3, 1, 1), torch.tensor(cfg.std).view(1, 3, 1, 1)
    torch.testing.assert_close((pixels - mean) / std, x[:8])


def _kinds(emb, out, mask_token, corrupted):
    is_mask = (out == mask_token).all(-1)
    kept = (out == emb).all(-1)
    is_random = corrupted & ~is_mask & ~kept
    return is_mask, kept, is_random


def test_corrupt_patches_fractions_and_determinism():
    B, N, D = 64, 49, 8
    g = torch.Generator().manual_seed(0)
    mask_token = torch.full((D,), 1000.0)
    counts = torch.zeros(3)
    total = 0
    for _ in range(40):
        emb = torch.randn(B, N, D, generator=g)
        out, corrupted = corrupt_patches(emb, mask_token, generator=g)
        assert corrupted.dtype == torch.bool and corrupted.shape == (B, N)
        assert (corrupted.sum(1) == round(0.5 * N + 1e-9)).all()  # 25 of 49 per image (round half up)
        is_mask, kept, is_random = _kinds(emb, out, mask_token, corrupted)
        assert (out[~corrupted] == emb[~corrupted]).all()  # untouched outside the corrupted set
        assert not (is_mask & ~corrupted).any()
        # A "random" patch holds another patch's embedding from the batch, never its own.
        flat = emb.reshape(-1, D)
        rows = out[is_random]
        assert all(bool((flat == r).all(-1).any()) for r in rows[:50])
        counts += torch.tensor([is_mask[corrupted].sum(), is_random[corrupted].sum(), kept[corrupted].sum()])
        total += int(corrupted.sum())
    frac = counts / total
    print("mask / random / kept fractions of the corrupted patches:", [round(float(f), 4) for f in frac])
    assert total == 40 * B * 25
    torch.testing.assert_close(frac, torch.tensor([0.8, 0.1, 0.1]), atol=0.01, rtol=0)

    emb = torch.randn(4, 16, D)
    a = corrupt_patches(emb, mask_token, generator=torch.Generator().manual_seed(7))
    b = corrupt_patches(emb, mask_token, generator=torch.Generator().manual_seed(7))
    c = corrupt_patches(emb, mask_token, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[1], c[1])
    with pytest.raises(ValueError):
        corrupt_patches(emb, mask_token, p_mask=0.95, p_random=0.1)


def test_mpp_model_gradients_and_state_dict():
    torch.manual_seed(0)
    vit = vit_serve.create_model(TINY)
    model = MPPModel(vit)
    assert model.mask_token.shape == (64,) and 0.01 < float(model.mask_token.detach().std()) < 0.03
    x = torch.randn(4, 3, 16, 16)
    loss, acc = model(x, return_accuracy=True, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(loss) and 0.0 <= float(acc) <= 1.0
    assert loss.item() == pytest.approx(math.log(512), abs=1.0)  # near-uniform at init
    loss.backward()
    for name in ("patch_embed.proj.weight", "pos_embed", "cls_token", "blocks.0.attn.qkv.weight", "norm.weight"):
        grad = dict(vit.named_parameters())[name].grad
        assert grad is not None and float(grad.abs().sum()) > 0, name
    assert model.mask_token.grad is not None and float(model.mask_token.grad.abs().sum()) > 0
    assert model.mpp_head.proj.weight.grad is not None
    # The wrapped ViT is an ordinary ViT: same keys as a fresh one, and it loads into one for fine-tuning.
    fresh = vit_serve.create_model(TINY)
    assert list(model.vit.state_dict()) == list(fresh.state_dict())
    fresh.load_state_dict(model.vit.state_dict())
    assert {k.split(".")[0] for k in model.state_dict()} == {"vit", "mask_token", "mpp_head"}
    with pytest.raises(ValueError):
        model(x, targets=torch.zeros(4, 15, dtype=torch.long))


def test_mpp_loss_falls_on_digits(one_thread):
    torch.manual_seed(0)
    cfg = vit_serve.PreprocessConfig(input_size=(16, 16), crop_pct=1.0)
    x, _ = digits_tensors("train", cfg)
    model = MPPModel(vit_serve.create_model(TINY), mean=cfg.mean, std=cfg.std)
    targets = model.targets(x)  # [N, 16] colour ids from the un-normalised pixels
    assert targets.shape == (len(x), 16)
    prior = torch.bincount(targets.flatten(), minlength=512).double() / targets.numel()
    prior_entropy = float(-(prior[prior > 0] * prior[prior > 0].log()).sum())  # best loss without context

    x_eval, t_eval = x[:256], targets[:256]

    def held_out_loss():
        model.eval()
        with torch.no_grad():
            loss, acc = model(x_eval, t_eval, return_accuracy=True, generator=torch.Generator().manual_seed(1))
        model.train()
        return float(loss), float(acc)

    start = held_out_loss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(150):
        idx = torch.randint(0, len(x), (32,), generator=g)
        loss = model(x[idx], targets[idx], generator=g)
        opt.zero_grad()
        loss.backward()
        opt.step()
    end = held_out_loss()
    print(
        f"MPP loss {start[0]:.3f} -> {end[0]:.3f} (accuracy {start[1]:.3f} -> {end[1]:.3f}; "
        f"colour-prior entropy {prior_entropy:.3f})"
    )
    assert end[0] < start[0] - 3.0
    assert end[0] < prior_entropy  # it uses the visible patches, not only the colour frequencies
