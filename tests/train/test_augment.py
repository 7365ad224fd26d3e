"""Training augmentation: the train / eval transforms (eval is exactly `preprocess`), RandAugment specs,
Mixup / CutMix (compared with timm.data.Mixup on the same draws) and the soft-target cross-entropy."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from skimage import data as skdata
from timm import data as timm_data
from timm.data.mixup import Mixup, cutmix_bbox_and_lam, rand_bbox

from vit_serve.preprocess import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, PreprocessConfig, preprocess, to_tensor
from vit_serve.train.augment import (
    INCEPTION_CROP_RATIO,
    INCEPTION_CROP_SCALE,
    MixParams,
    MixupCutmix,
    cutmix_box,
    eval_transform,
    parse_randaugment,
    soft_target_cross_entropy,
    train_transform,
)

CFG = PreprocessConfig(input_size=(48, 40))  # non-square on purpose; inception mean/std 0.5 -> [-1, 1]
CFG_IN = PreprocessConfig(input_size=(32, 32), mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD)


@pytest.fixture(scope="module")
def photo() -> Image.Image:
    return Image.fromarray(skdata.chelsea()).resize((90, 60), Image.Resampling.BILINEAR)


# --------------------------------------------------------------------------------------------------------
# train_transform / eval_transform
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [CFG, CFG_IN])
@pytest.mark.parametrize("randaugment", [None, "rand-m9-n2"])
def test_train_transform_shape_dtype_range(photo, cfg, randaugment):
    t = train_transform(cfg, randaugment=randaugment)
    lo = min((0 - m) / s for m, s in zip(cfg.mean, cfg.std, strict=True)) - 1e-6
    hi = max((1 - m) / s for m, s in zip(cfg.mean, cfg.std, strict=True)) + 1e-6
    buf = io.BytesIO()
    photo.save(buf, format="PNG")
    for src in (photo, buf.getvalue(), photo.convert("L"), photo.convert("RGBA")):
        x = t(src)
        assert x.shape == (3, *cfg.input_size) and x.dtype == torch.float32
        assert lo <= float(x.min()) and float(x.max()) <= hi


def test_train_transform_reads_paths_and_digits(tmp_path, photo):
    photo.save(tmp_path / "cat.jpg")
    assert train_transform(CFG)(tmp_path / "cat.jpg").shape == (3, 48, 40)
    digit = Image.fromarray((np.arange(64).reshape(8, 8) * 4).astype(np.uint8), mode="L")
    x = train_transform(CFG)(digit)  # 8x8 greyscale -> the model resolution, 3 identical channels
    assert x.shape == (3, 48, 40) and torch.equal(x[0], x[1]) and torch.equal(x[1], x[2])


def test_train_transform_inception_crop_parameters():
    crop = train_transform(CFG).ops.transforms[0]
    assert type(crop).__name__ == "RandomResizedCrop"
    assert tuple(crop.scale) == INCEPTION_CROP_SCALE == (0.05, 1.0)
    assert tuple(crop.ratio) == INCEPTION_CROP_RATIO and list(crop.size) == [48, 40]
    assert crop.interpolation.value == CFG.interpolation


@pytest.mark.parametrize("cfg", [CFG, CFG_IN, PreprocessConfig(input_size=(16, 32), crop_pct=1.0)])
def test_train_transform_without_crop_is_timms_eval_geometry(photo, cfg):
    """Without the Inception crop, training sees the pictures evaluation sees (timm's eval transform: keep the
    aspect ratio, centre-crop), also at non-square sizes, where a plain Resize(input_size) would squash them."""
    reference = timm_data.create_transform(input_size=(3, *cfg.input_size), interpolation=cfg.interpolation,
                                           mean=cfg.mean, std=cfg.std, crop_pct=cfg.crop_pct,
                                           crop_mode=cfg.crop_mode)
    got = train_transform(cfg, inception_crop=False, flip=False)(photo)
    torch.testing.assert_close(got, reference(photo), rtol=0, atol=0)
    squashed = to_tensor(photo.resize(cfg.input_size[::-1], Image.Resampling.BICUBIC), cfg)
    assert (got - squashed).abs().max() > 0.1


def test_train_transform_without_crop_is_resize_then_flip(photo):
    resized = preprocess(photo, CFG)
    torch.testing.assert_close(train_transform(CFG, inception_crop=False, flip=False)(photo), resized, rtol=0, atol=0)
    flips = set()
    t = train_transform(CFG, inception_crop=False, flip=True)
    for seed in range(12):
        torch.manual_seed(seed)
        x = t(photo)
        if torch.equal(x, resized):
            flips.add(False)
        else:
            torch.testing.assert_close(x, resized.flip(-1), rtol=0, atol=0)
            flips.add(True)
    assert flips == {False, True}


def test_randaugment_changes_the_image(photo):
    plain = train_transform(CFG, inception_crop=False, flip=False)(photo)
    t = train_transform(CFG, inception_crop=False, flip=False, randaugment="rand-m10-n2")
    changed = 0
    for seed in range(6):
        torch.manual_seed(seed)
        changed += not torch.equal(t(photo), plain)
    assert changed >= 3


@pytest.mark.parametrize("randaugment", [None, "rand-m9-n2"])
def test_train_transform_is_deterministic_under_a_seed(photo, randaugment):
    t = train_transform(CFG, randaugment=randaugment)
    torch.manual_seed(7)
    a = [t(photo) for _ in range(3)]
    torch.manual_seed(7)
    b = [t(photo) for _ in range(3)]
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert not torch.equal(a[0], a[1])  # ... and random between calls


def test_eval_transform_is_preprocess(tmp_path, photo):
    path = tmp_path / "cat.png"
    photo.save(path)
    t = eval_transform(CFG)
    for src in (photo, path, path.read_bytes()):
        torch.testing.assert_close(t(src), preprocess(src, CFG), rtol=0, atol=0)


def test_transforms_pickle():
    import pickle

    for t in (train_transform(CFG, randaugment="rand-m9-n2"), eval_transform(CFG)):
        assert callable(pickle.loads(pickle.dumps(t)))


# --------------------------------------------------------------------------------------------------------
# RandAugment specs
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("rand-m9-n2", (9, 2)), ("rand-n3-m5", (5, 3)), ("rand-m0-n1", (0, 1)), ("rand-m10", (10, 2)), ("rand", (9, 2))],
)
def test_parse_randaugment(spec, expected):
    assert parse_randaugment(spec) == expected


@pytest.mark.parametrize(
    "spec", ["", "randaug", "rand-m9-x2", "m9-n2", "rand-m9-n2-", "rand-m-n2", "rand-m11-n2", "rand-m9-n0",
             "rand-m9-m3", "rand-m9-n2\n", "RAND-M9-N2", "rand-m9.5-n2", None, 9]
)  # fmt: skip
def test_parse_randaugment_errors(spec):
    with pytest.raises(ValueError, match="RandAugment spec"):
        parse_randaugment(spec)


def test_train_transform_rejects_a_bad_spec_up_front():
    with pytest.raises(ValueError, match="rand-m9-n2"):
        train_transform(CFG, randaugment="autoaugment")
    ra = train_transform(CFG, randaugment="rand-m7-n3").ops.transforms[-1]
    assert (ra.magnitude, ra.num_ops, ra.num_magnitude_bins) == (7, 3, 11)  # timm's 0..10 magnitude scale


# --------------------------------------------------------------------------------------------------------
# Mixup / CutMix
# --------------------------------------------------------------------------------------------------------


def _batch(b: int = 6, h: int = 16, w: int = 12, k: int = 10):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, 3, h, w, generator=g)
    y = torch.tensor([0, 3, 5, 1, 9, 4][:b])
    return x, y


def test_no_alpha_only_converts_labels():
    x, y = _batch()
    m = MixupCutmix(10, label_smoothing=0.1)
    state = torch.random.get_rng_state()
    xm, ys = m(x, y)
    assert torch.equal(torch.random.get_rng_state(), state)  # no random draws
    assert torch.equal(xm, x) and ys.shape == (6, 10) and ys.dtype == torch.float32
    expected = torch.full((6, 10), 0.01)
    expected[torch.arange(6), y] = 0.91  # on = 1 - s + s/K, off = s/K
    torch.testing.assert_close(ys, expected, rtol=0, atol=1e-7)
    assert torch.equal(MixupCutmix(10)(x, y)[1], F.one_hot(y, 10).float())


@pytest.mark.parametrize(("mixup", "cutmix"), [(0.8, 0.0), (0.0, 1.0), (0.8, 1.0)])
def test_shapes_rows_sum_to_one_and_input_untouched(mixup, cutmix):
    x, y = _batch()
    x0 = x.clone()
    m = MixupCutmix(10, mixup_alpha=mixup, cutmix_alpha=cutmix, label_smoothing=0.1)
    for _ in range(5):
        xm, ys = m(x, y)
        assert xm.shape == x.shape and ys.shape == (6, 10)
        torch.testing.assert_close(ys.sum(1), torch.ones(6), rtol=0, atol=1e-6)
        assert torch.equal(x, x0)


def test_mixup_lam_consistency():
    x, y = _batch()
    torch.manual_seed(0)
    xm, ys = MixupCutmix(10, mixup_alpha=0.8)(x, y)
    lam = float(ys[0, y[0]])
    assert 0 < lam < 1
    torch.testing.assert_close(ys[0, y.flip(0)[0]], torch.tensor(1 - lam))
    torch.testing.assert_close(xm, lam * x + (1 - lam) * x.flip(0))


def test_cutmix_pixel_fraction_equals_one_minus_lam():
    b, h, w = 6, 16, 12
    x = torch.arange(1, b + 1, dtype=torch.float32).view(b, 1, 1, 1).expand(b, 3, h, w).contiguous()
    y = torch.tensor([0, 3, 5, 1, 9, 4])
    m = MixupCutmix(10, cutmix_alpha=1.0)
    seen = 0
    for seed in range(20):
        torch.manual_seed(seed)
        xm, ys = m(x, y)
        for i in range(b):
            lam = float(ys[i, y[i]])
            from_flipped = xm[i] == x.flip(0)[i]
            assert float(from_flipped.float().mean()) == pytest.approx(1 - lam, abs=1e-6)
            assert float(ys[i, y.flip(0)[i]]) == pytest.approx(1 - lam, abs=1e-6)
            rows, cols = from_flipped[0].any(1), from_flipped[0].any(0)
            assert int(from_flipped[0].sum()) == int(rows.sum()) * int(cols.sum())  # one rectangle
        seen += 0 < float(ys[0, y[0]]) < 1
    assert seen >= 10


def test_sample_statistics():
    torch.manual_seed(0)
    m = MixupCutmix(10, mixup_alpha=0.8, cutmix_alpha=1.0, switch_prob=0.3)
    params = [m.sample(16, 12) for _ in range(600)]
    cut = [p for p in params if p.box is not None]
    assert 0.22 < len(cut) / len(params) < 0.38
    for p in cut:
        y0, y1, x0, x1 = p.box
        assert 0 <= y0 <= y1 <= 16 and 0 <= x0 <= x1 <= 12
        assert p.lam == pytest.approx(1 - (y1 - y0) * (x1 - x0) / (16 * 12))
    lams = np.array([p.lam for p in params if p.box is None])
    assert abs(lams.mean() - 0.5) < 0.05 and lams.min() >= 0 and lams.max() <= 1
    never = MixupCutmix(10, mixup_alpha=0.8, prob=0.0)
    assert all(never.sample(8, 8) == MixParams() for _ in range(20)) and not never.enabled


def test_seeded_mixing_is_deterministic():
    x, y = _batch()
    m = MixupCutmix(10, mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1)
    torch.manual_seed(3)
    a = [m(x, y) for _ in range(4)]
    torch.manual_seed(3)
    b = [m(x, y) for _ in range(4)]
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize(("mixup", "cutmix"), [(0.8, 0.0), (0.0, 1.0), (0.8, 1.0)])
def test_matches_timm_mixup_on_the_same_draws(mixup, cutmix):
    """timm draws with numpy: replay its draws (seeded) to get lam and the box, then apply ours with them."""
    x, y = _batch()
    ref = Mixup(mixup_alpha=mixup, cutmix_alpha=cutmix, label_smoothing=0.1, num_classes=10, mode="batch")
    ours = MixupCutmix(10, mixup_alpha=mixup, cutmix_alpha=cutmix, label_smoothing=0.1)
    modes = set()
    for seed in range(8):
        np.random.seed(seed)
        lam, use_cutmix = ref._params_per_batch()
        box = None
        if use_cutmix:
            (y0, y1, x0, x1), lam = cutmix_bbox_and_lam(x.shape, lam, correct_lam=True)
            box = (int(y0), int(y1), int(x0), int(x1))
        modes.add(use_cutmix)
        np.random.seed(seed)
        x_ref, y_ref = ref(x.clone(), y)
        x_ours, y_ours = ours.mix(x, y, MixParams(lam=float(lam), box=box))
        torch.testing.assert_close(x_ours, x_ref, rtol=0, atol=0)
        torch.testing.assert_close(y_ours, y_ref.float(), rtol=0, atol=1e-7)
    assert modes == ({True, False} if mixup and cutmix else {bool(cutmix)})


def test_cutmix_box_matches_timm_rand_bbox():
    rng = np.random.default_rng(0)
    for h, w in ((16, 12), (7, 9), (224, 224)):
        for lam in rng.uniform(0, 1, 25):
            np.random.seed(int(rng.integers(1 << 30)))
            state = np.random.get_state()
            expected = tuple(int(v) for v in rand_bbox((1, 3, h, w), lam))
            np.random.set_state(state)  # timm draws cy then cx, uniform over the image
            cy, cx = np.random.randint(0, h), np.random.randint(0, w)
            assert cutmix_box(h, w, float(lam), int(cy), int(cx)) == expected


def test_mixup_cutmix_errors():
    with pytest.raises(ValueError, match="num_classes"):
        MixupCutmix(0)
    with pytest.raises(ValueError, match="mixup_alpha"):
        MixupCutmix(10, mixup_alpha=-1)
    with pytest.raises(ValueError, match="label_smoothing"):
        MixupCutmix(10, label_smoothing=1.5)
    m = MixupCutmix(10, mixup_alpha=1.0)
    x, y = _batch()
    with pytest.raises(ValueError, match=r"labels must be in 0\.\.9"):
        m(x, y + 5)
    with pytest.raises(ValueError, match="integer labels"):
        m(x, F.one_hot(y, 10))
    with pytest.raises(ValueError, match=r"\[B, C, H, W\]"):
        m(x[0], y)


# --------------------------------------------------------------------------------------------------------
# soft_target_cross_entropy
# --------------------------------------------------------------------------------------------------------


def test_soft_target_cross_entropy_matches_cross_entropy():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 10, generator=g, requires_grad=True)
    y = torch.randint(0, 10, (8,), generator=g)
    loss = soft_target_cross_entropy(logits, F.one_hot(y, 10).float())
    torch.testing.assert_close(loss, F.cross_entropy(logits, y))
    smoothed = MixupCutmix(10, label_smoothing=0.1).targets(y)
    torch.testing.assert_close(
        soft_target_cross_entropy(logits, smoothed), F.cross_entropy(logits, y, label_smoothing=0.1)
    )
    loss.backward()
    assert logits.grad is not None and logits.grad.shape == logits.shape
    assert soft_target_cross_entropy(logits.detach().bfloat16(), smoothed).dtype == torch.float32
    with pytest.raises(ValueError, match="same shape"):
        soft_target_cross_entropy(logits, smoothed[:, :5])
