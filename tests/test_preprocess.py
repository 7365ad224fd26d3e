"""Tests for vit_serve.preprocess.

timm (``create_transform(**resolve_data_config(...))``, eval path) is the reference implementation: the
parity tests require our PIL/numpy/torch-only pipeline to match it on real photos and several contracts.
timm and torchvision are test-only dependencies.
"""

from __future__ import annotations

import dataclasses
import io
import json
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from vit_serve.preprocess import (
    IMAGENET_DEFAULT_MEAN,
    IMAGENET_DEFAULT_STD,
    IMAGENET_INCEPTION_MEAN,
    IMAGENET_INCEPTION_STD,
    ImageDecodeError,
    ImageTooLargeError,
    PreprocessConfig,
    _center_crop,
    load_image,
    preprocess,
    preprocess_batch,
    resize_and_crop,
    to_tensor,
)

timm_data = pytest.importorskip("timm.data")
tv_transforms = pytest.importorskip("torchvision.transforms")
tv_functional = pytest.importorskip("torchvision.transforms.functional")

# --------------------------------------------------------------------------------------------------------
# Fixtures / helpers
# --------------------------------------------------------------------------------------------------------


def _photos() -> dict[str, Image.Image]:
    import skimage.data
    from matplotlib import cbook

    photos = {n: Image.fromarray(getattr(skimage.data, n)()) for n in ("astronaut", "chelsea", "coffee")}
    with cbook.get_sample_data("grace_hopper.jpg") as f:
        photos["grace_hopper"] = Image.open(f).convert("RGB")
    return photos


PHOTOS = _photos()
CHELSEA = PHOTOS["chelsea"]  # 451 x 300 (W x H): non-square

CONTRACTS = {
    "224_bicubic_0.9_inception": PreprocessConfig(),
    "384_bicubic_1.0": PreprocessConfig(input_size=(384, 384), crop_pct=1.0),
    "160_bilinear_0.875_default": PreprocessConfig(
        input_size=(160, 160),
        interpolation="bilinear",
        crop_pct=0.875,
        mean=IMAGENET_DEFAULT_MEAN,
        std=IMAGENET_DEFAULT_STD,
    ),
    "192x256_bicubic_0.9": PreprocessConfig(input_size=(192, 256)),
    "squash_224_bilinear": PreprocessConfig(crop_mode="squash", crop_pct=0.875, interpolation="bilinear"),
    "squash_256x192_bicubic_0.95": PreprocessConfig(input_size=(256, 192), crop_mode="squash", crop_pct=0.95),
}


def _timm_transform(cfg: PreprocessConfig):
    """The reference: timm's eval transform built from a pretrained_cfg carrying our contract."""
    pretrained_cfg = {
        "input_size": (3, *cfg.input_size),
        "mean": cfg.mean,
        "std": cfg.std,
        "interpolation": cfg.interpolation,
        "crop_pct": cfg.crop_pct,
        "crop_mode": cfg.crop_mode,
    }
    data_cfg = timm_data.resolve_data_config({}, pretrained_cfg=pretrained_cfg)
    # Make sure every field really went through resolve_data_config (it silently falls back to defaults).
    assert data_cfg == {
        "input_size": (3, *cfg.input_size),
        "interpolation": cfg.interpolation,
        "mean": cfg.mean,
        "std": cfg.std,
        "crop_pct": cfg.crop_pct,
        "crop_mode": cfg.crop_mode,
    }
    return timm_data.create_transform(**data_cfg)


def _identity_cfg(h: int, w: int) -> PreprocessConfig:
    """No resize, no crop, no normalisation: tensor == pixels / 255 for an h x w image."""
    zero, one = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    return PreprocessConfig(input_size=(h, w), crop_pct=1.0, interpolation="nearest", mean=zero, std=one)


def _pixels(src, max_pixels=None) -> np.ndarray:
    """preprocess() with the identity contract, back to uint8 HWC (also checks shape/dtype)."""
    img = load_image(src)
    t = preprocess(src, _identity_cfg(img.height, img.width), max_pixels)
    assert t.shape == (3, img.height, img.width) and t.dtype == torch.float32
    px = (t * 255).round().permute(1, 2, 0).numpy()
    assert np.abs(px - t.permute(1, 2, 0).numpy() * 255).max() < 1e-3
    return px.astype(np.uint8)


def _img(mode: str, arr: np.ndarray) -> Image.Image:
    arr = np.ascontiguousarray(arr)
    return Image.frombytes(mode, (arr.shape[1], arr.shape[0]), arr.tobytes())


def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def _rgb(*vals: int) -> list[int]:
    return list(vals)


# --------------------------------------------------------------------------------------------------------
# Parity with timm
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("contract", list(CONTRACTS))
def test_matches_timm_on_photos(contract: str) -> None:
    cfg = CONTRACTS[contract]
    tf = _timm_transform(cfg)
    # The reference pipeline is what we think it is: resize, centre crop, to-tensor, normalize.
    names = [type(t).__name__ for t in tf.transforms]
    square_scale = cfg.input_size[0] == cfg.input_size[1]
    first = "Resize" if cfg.crop_mode == "squash" or square_scale else "ResizeKeepRatio"
    assert names == [first, "CenterCrop", "MaybeToTensor", "Normalize"]
    for name, photo in PHOTOS.items():
        ref = tf(photo)
        ours = preprocess(photo, cfg)
        assert ref.shape == ours.shape == (3, *cfg.input_size), name
        assert ours.dtype == torch.float32
        assert (ours - ref).abs().max().item() <= 1e-6, (contract, name)


@pytest.mark.parametrize(
    "hw",
    [(37, 500), (500, 37), (17, 19), (249, 250), (250, 249), (223, 224), (301, 299), (5, 60), (248, 331)],
)
def test_matches_timm_on_awkward_sizes(hw: tuple[int, int]) -> None:
    # Odd aspect ratios and upscaling exercise int() truncation (torchvision) and round-half-even (timm).
    rng = np.random.default_rng(hw[0] * 1000 + hw[1])
    img = Image.fromarray(rng.integers(0, 256, (*hw, 3), dtype=np.uint8))
    for cfg in CONTRACTS.values():
        small = cfg.with_size(cfg.input_size[0] // 4, cfg.input_size[1] // 4)
        ref = _timm_transform(small)(img)
        ours = preprocess(img, small)
        assert ref.shape == ours.shape
        assert (ours - ref).abs().max().item() <= 1e-6, (hw, small)


CROP_CASES = [((5, 7), (8, 10)), ((5, 7), (9, 4)), ((6, 6), (3, 6)), ((4, 9), (7, 9))]


@pytest.mark.parametrize("img_hw,crop_hw", CROP_CASES)
def test_center_crop_matches_torchvision_including_padding(img_hw, crop_hw) -> None:
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(1, 256, (*img_hw, 3), dtype=np.uint8))
    ours = np.asarray(_center_crop(img, crop_hw))
    ref = np.asarray(tv_functional.center_crop(img, list(crop_hw)))
    assert ours.shape == (*crop_hw, 3)
    np.testing.assert_array_equal(ours, ref)


def test_to_tensor_matches_torchvision() -> None:
    cfg = CONTRACTS["160_bilinear_0.875_default"]
    img = resize_and_crop(CHELSEA, cfg)
    assert img.size == (160, 160)
    ref = tv_transforms.Normalize(torch.tensor(cfg.mean), torch.tensor(cfg.std))(tv_functional.to_tensor(img))
    assert torch.equal(to_tensor(img, cfg), ref)
    with pytest.raises(ValueError, match="RGB"):
        to_tensor(img.convert("L"), cfg)


def test_preprocess_batch() -> None:
    cfg = PreprocessConfig(input_size=(64, 48))
    photos = list(PHOTOS.values())
    batch = preprocess_batch(photos, cfg)
    assert batch.shape == (len(photos), 3, 64, 48) and batch.dtype == torch.float32
    for i, p in enumerate(photos):
        assert torch.equal(batch[i], preprocess(p, cfg))
    assert preprocess_batch([], cfg).shape == (0, 3, 64, 48)


# --------------------------------------------------------------------------------------------------------
# Input kinds
# --------------------------------------------------------------------------------------------------------


def test_bytes_inputs_equal_pil_input() -> None:
    cfg = PreprocessConfig()
    png = _encode(CHELSEA, "PNG")
    assert torch.equal(preprocess(png, cfg), preprocess(CHELSEA, cfg))  # lossless
    for data in (png, bytearray(png), memoryview(png)):
        assert torch.equal(preprocess(data, cfg), preprocess(CHELSEA, cfg))

    jpeg = _encode(CHELSEA, "JPEG", quality=90)
    decoded = Image.open(io.BytesIO(jpeg)).convert("RGB")
    assert torch.equal(preprocess(jpeg, cfg), preprocess(decoded, cfg))
    assert torch.equal(preprocess(jpeg, cfg), _timm_transform(cfg)(decoded))


def test_path_input(tmp_path) -> None:
    cfg = PreprocessConfig(input_size=(96, 96))
    path = tmp_path / "cat.png"
    CHELSEA.save(path)
    expected = preprocess(CHELSEA, cfg)
    assert torch.equal(preprocess(path, cfg), expected)
    assert torch.equal(preprocess(str(path), cfg), expected)
    with pytest.raises(FileNotFoundError):
        preprocess(tmp_path / "missing.png", cfg)


def test_unsupported_input_type() -> None:
    with pytest.raises(TypeError, match="ndarray"):
        load_image(np.zeros((4, 4, 3), np.uint8))  # type: ignore[arg-type]


EXIF_CASES = [(6, Image.Transpose.ROTATE_270), (3, Image.Transpose.ROTATE_180)]


@pytest.mark.parametrize("orientation,method", EXIF_CASES)
def test_exif_orientation_applied(orientation: int, method: Image.Transpose) -> None:
    exif = Image.Exif()
    exif[0x0112] = orientation
    jpeg = _encode(CHELSEA, "JPEG", quality=92, exif=exif.tobytes())

    raw = Image.open(io.BytesIO(jpeg))
    assert raw.getexif()[0x0112] == orientation
    pixels = np.asarray(raw.convert("RGB"))
    manual = Image.fromarray(pixels).transpose(method)  # fresh image: no EXIF
    unrotated = Image.fromarray(pixels)

    loaded = load_image(jpeg)
    assert loaded.size == manual.size
    np.testing.assert_array_equal(np.asarray(loaded), np.asarray(manual))

    cfg = PreprocessConfig(input_size=(192, 256))
    out = preprocess(jpeg, cfg)
    assert torch.equal(out, preprocess(manual, cfg))
    assert not torch.equal(out, preprocess(unrotated, cfg))
    # An opened-but-untransposed PIL image is treated like its bytes; a transposed one is not rotated twice.
    assert torch.equal(preprocess(Image.open(io.BytesIO(jpeg)), cfg), out)
    from PIL import ImageOps

    assert torch.equal(preprocess(ImageOps.exif_transpose(Image.open(io.BytesIO(jpeg))), cfg), out)


# --------------------------------------------------------------------------------------------------------
# Modes
# --------------------------------------------------------------------------------------------------------


def test_mode_rgb_and_l_and_1() -> None:
    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 256, (6, 10, 3), dtype=np.uint8)
    np.testing.assert_array_equal(_pixels(Image.fromarray(rgb)), rgb)

    grey = (np.arange(60, dtype=np.uint8) * 4).reshape(6, 10)
    np.testing.assert_array_equal(_pixels(_img("L", grey)), np.repeat(grey[..., None], 3, -1))

    bits = rng.integers(0, 2, (6, 10)).astype(bool)
    img1 = Image.fromarray(bits)
    assert img1.mode == "1"
    np.testing.assert_array_equal(_pixels(img1), np.repeat(np.where(bits, 255, 0)[..., None], 3, -1))


def test_mode_rgba_composited_over_white() -> None:
    arr = np.array(
        [
            [[10, 20, 30, 0], [0, 0, 0, 0], [10, 20, 30, 255]],
            [[0, 0, 0, 128], [200, 100, 50, 128], [255, 255, 255, 1]],
        ],
        dtype=np.uint8,
    )
    expected = np.array(
        [
            [_rgb(255, 255, 255), _rgb(255, 255, 255), _rgb(10, 20, 30)],
            [_rgb(127, 127, 127), _rgb(227, 177, 152), _rgb(255, 255, 255)],
        ],
        dtype=np.uint8,
    )
    img = _img("RGBA", arr)
    np.testing.assert_array_equal(_pixels(img), expected)
    np.testing.assert_array_equal(_pixels(_encode(img, "PNG")), expected)
    # premultiplied RGBa gives the same result (up to PIL's own premultiplication rounding)
    assert np.abs(_pixels(img.convert("RGBa")).astype(int) - expected).max() <= 1


def test_mode_la_and_la_premultiplied() -> None:
    arr = np.array([[[100, 0], [100, 255], [100, 128], [0, 128]]], dtype=np.uint8)
    expected_l = np.array([[255, 100, 177, 127]], dtype=np.uint8)  # round((l*a + 255*(255-a)) / 255)
    np.testing.assert_array_equal(_pixels(_img("LA", arr)), np.repeat(expected_l[..., None], 3, -1))
    # "La" stores premultiplied luminance: over white it is l' + 255 - a (PIL cannot convert La at all)
    pre = np.array([[[0, 0], [100, 255], [50, 128], [0, 128]]], dtype=np.uint8)
    expected_pre = np.array([[255, 100, 177, 127]], dtype=np.uint8)
    np.testing.assert_array_equal(_pixels(_img("La", pre)), np.repeat(expected_pre[..., None], 3, -1))


def _palette_image() -> tuple[Image.Image, np.ndarray, np.ndarray]:
    palette = np.zeros((256, 3), np.uint8)
    palette[:4] = [[255, 0, 0], [0, 255, 0], [0, 0, 255], [12, 34, 56]]
    idx = np.array([[0, 1, 2, 3], [3, 2, 1, 0]], dtype=np.uint8)
    img = _img("P", idx)
    img.putpalette(palette.flatten().tolist())
    return img, idx, palette


def test_mode_p_with_and_without_transparency() -> None:
    img, idx, palette = _palette_image()
    np.testing.assert_array_equal(_pixels(img), palette[idx])

    img.info["transparency"] = 3  # palette entry 3 is transparent -> white
    expected = palette[idx].copy()
    expected[idx == 3] = 255
    np.testing.assert_array_equal(_pixels(img), expected)
    reloaded = Image.open(io.BytesIO(_encode(img, "PNG", transparency=3)))
    assert reloaded.mode == "P" and "transparency" in reloaded.info
    np.testing.assert_array_equal(_pixels(_encode(img, "PNG", transparency=3)), expected)

    pa = img.convert("PA")
    assert pa.mode == "PA"
    np.testing.assert_array_equal(_pixels(pa), expected)


def test_mode_grey_png_with_trns_key() -> None:
    grey = np.array([[0, 50, 100, 0]], dtype=np.uint8)
    png = _encode(_img("L", grey), "PNG", transparency=0)
    assert Image.open(io.BytesIO(png)).info.get("transparency") == 0
    np.testing.assert_array_equal(_pixels(png)[..., 0], [[255, 50, 100, 255]])


def test_mode_cmyk_and_other_colour_spaces() -> None:
    cmyk = np.array([[[0, 0, 0, 0], [255, 0, 0, 0], [0, 0, 0, 255], [0, 255, 0, 0]]], dtype=np.uint8)
    expected = np.array([[_rgb(255, 255, 255), _rgb(0, 255, 255), _rgb(0, 0, 0), _rgb(255, 0, 255)]])
    img = _img("CMYK", cmyk)
    np.testing.assert_array_equal(_pixels(img), expected)
    np.testing.assert_array_equal(_pixels(_encode(img, "JPEG", quality=100)) // 16, expected // 16)

    small = CHELSEA.resize((12, 8))
    for mode in ("YCbCr", "LAB", "HSV", "RGBX"):
        converted = small.convert(mode)
        assert converted.mode == mode
        np.testing.assert_array_equal(_pixels(converted), np.asarray(converted.convert("RGB")))
    # round trips through YCbCr/HSV stay close to the original pixels
    assert np.abs(_pixels(small.convert("HSV")).astype(int) - np.asarray(small)).max() <= 8


def test_mode_16bit_scaled_not_saturated() -> None:
    values = np.linspace(0, 65535, 64).round().astype(np.uint16)
    values[1] = 32768
    grad = values.reshape(8, 8)
    expected = np.round(grad / 257).astype(np.uint8)
    assert expected.max() == 255 and expected.flat[1] == 128
    expected3 = np.repeat(expected[..., None], 3, -1)

    img = Image.fromarray(grad)
    assert img.mode == "I;16"
    # PIL's own convert("RGB") saturates: that is the bug load_image avoids.
    assert np.asarray(img.convert("RGB"))[0, 1, 0] == 255
    np.testing.assert_array_equal(_pixels(img), expected3)
    np.testing.assert_array_equal(_pixels(_img("I;16B", grad.astype(">u2"))), expected3)
    np.testing.assert_array_equal(_pixels(_img("I;16L", grad.astype("<u2"))), expected3)
    np.testing.assert_array_equal(_pixels(_encode(img, "PNG")), expected3)  # real 16-bit PNG


def test_mode_i_clipped_then_scaled() -> None:
    vals = np.array([[-5, 0, 128, 257, 32768, 65535, 70000, 2**31 - 1]], dtype=np.int32)
    img = Image.fromarray(vals)
    assert img.mode == "I"
    np.testing.assert_array_equal(_pixels(img)[..., 0], [[0, 0, 0, 1, 128, 255, 255, 255]])


def test_mode_f_clipped_and_rounded() -> None:
    vals = np.array([[-5.0, 0.4, 0.6, 127.4, 127.6, 254.9, 300.0, np.nan]], dtype=np.float32)
    img = Image.fromarray(vals)
    assert img.mode == "F"
    np.testing.assert_array_equal(_pixels(img)[..., 0], [[0, 0, 1, 127, 128, 255, 255, 0]])


# --------------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------------

JPEG = _encode(CHELSEA, "JPEG", quality=90)
PNG = _encode(CHELSEA, "PNG")


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(JPEG[: len(JPEG) // 2], id="truncated-jpeg"),
        pytest.param(PNG[: len(PNG) // 2], id="truncated-png"),
        pytest.param(np.random.default_rng(0).bytes(2000), id="random"),
        pytest.param(b"", id="empty"),
        pytest.param(b"hello, not an image", id="text"),
        pytest.param(JPEG[:200], id="header-only-jpeg"),
    ],
)
def test_decode_errors(data: bytes) -> None:
    with pytest.raises(ImageDecodeError) as info:
        preprocess(data, PreprocessConfig())
    msg = str(info.value)
    assert msg.startswith("cannot decode image: ") and "\n" not in msg
    assert isinstance(info.value, ValueError)


def test_max_pixels() -> None:
    n = CHELSEA.width * CHELSEA.height  # 135300
    with pytest.raises(ImageTooLargeError) as info:
        preprocess(PNG, PreprocessConfig(), max_pixels=n - 1)
    assert str(n) in str(info.value) and str(n - 1) in str(info.value)
    assert preprocess(PNG, PreprocessConfig(), max_pixels=n).shape == (3, 224, 224)
    with pytest.raises(ImageTooLargeError):
        load_image(CHELSEA, max_pixels=1000)
    # checked from the header, before pixel decoding: a truncated file is reported as too large
    with pytest.raises(ImageTooLargeError):
        load_image(JPEG[: len(JPEG) // 2], max_pixels=1000)
    with pytest.raises(ValueError, match="max_pixels"):
        load_image(PNG, max_pixels=0)


def test_pil_decompression_bomb_becomes_too_large(monkeypatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # > 2x the limit: PIL raises
    with pytest.raises(ImageTooLargeError, match="pixels"):
        load_image(PNG)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100_000)  # between 1x and 2x: PIL warns
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with pytest.raises(ImageTooLargeError):
            load_image(PNG)


# --------------------------------------------------------------------------------------------------------
# The contract
# --------------------------------------------------------------------------------------------------------


def test_config_defaults_and_constants() -> None:
    cfg = PreprocessConfig()
    assert cfg.input_size == (224, 224)
    assert cfg.mean == IMAGENET_INCEPTION_MEAN == (0.5, 0.5, 0.5)
    assert cfg.std == IMAGENET_INCEPTION_STD == (0.5, 0.5, 0.5)
    assert (cfg.interpolation, cfg.crop_pct, cfg.crop_mode) == ("bicubic", 0.9, "center")
    assert cfg.decode == "exact"  # timm's transform unless a contract asks for the fast path
    assert IMAGENET_DEFAULT_MEAN == timm_data.IMAGENET_DEFAULT_MEAN
    assert IMAGENET_DEFAULT_STD == timm_data.IMAGENET_DEFAULT_STD
    assert IMAGENET_INCEPTION_MEAN == timm_data.IMAGENET_INCEPTION_MEAN
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.crop_pct = 1.0  # type: ignore[misc]
    hash(cfg)


def test_config_round_trip() -> None:
    cfg = PreprocessConfig(
        input_size=(192, 256), mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD, crop_mode="squash",
        decode="fast",
    )
    d = cfg.to_dict()
    assert d["input_size"] == [192, 256] and isinstance(d["mean"], list) and d["decode"] == "fast"
    assert PreprocessConfig.from_dict(json.loads(json.dumps(d))) == cfg
    # a contract stored before the field existed is the exact path
    old = {k: v for k, v in d.items() if k != "decode"}
    assert PreprocessConfig.from_dict(old).decode == "exact"
    assert cfg.with_decode(None) is cfg and cfg.with_decode("exact") == dataclasses.replace(cfg, decode="exact")
    assert PreprocessConfig.from_dict({}) == PreprocessConfig()
    assert PreprocessConfig.from_dict({"input_size": [384, 384]}) == PreprocessConfig(input_size=(384, 384))
    assert cfg.with_size(320, 320) == dataclasses.replace(cfg, input_size=(320, 320))
    assert PreprocessConfig(input_size=[10, 20]).input_size == (10, 20)  # type: ignore[arg-type]


def test_from_dict_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="num_classes") as info:
        PreprocessConfig.from_dict({"input_size": [224, 224], "num_classes": 1000})
    assert "input_size" not in str(info.value).split(";")[0]
    with pytest.raises(TypeError):
        PreprocessConfig.from_dict([("input_size", [1, 1])])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"input_size": (0, 224)}, "input_size"),
        ({"input_size": (-1, 224)}, "input_size"),
        ({"input_size": (224,)}, "input_size"),
        ({"input_size": (224.0, 224)}, "input_size"),
        ({"input_size": (True, 224)}, "input_size"),
        ({"input_size": "224"}, "input_size"),
        ({"mean": (0.5, 0.5)}, "mean"),
        ({"mean": (0.5, float("nan"), 0.5)}, "mean"),
        ({"std": (0.5, 0.0, 0.5)}, "std"),
        ({"std": (0.5, -1.0, 0.5)}, "std"),
        ({"std": (0.5, 0.5, 0.5, 0.5)}, "std"),
        ({"interpolation": "cubic"}, "interpolation"),
        ({"crop_pct": 0.0}, "crop_pct"),
        ({"crop_pct": 1.01}, "crop_pct"),
        ({"crop_pct": float("nan")}, "crop_pct"),
        ({"crop_mode": "border"}, "crop_mode"),
        ({"decode": "turbo"}, "decode"),
        ({"decode": None}, "decode"),
    ],
)
def test_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PreprocessConfig(**kwargs)
