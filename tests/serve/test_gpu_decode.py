"""GPU decoding of uploads (`vit_serve.runtime.gpu_decode`). References: Pillow's `ImageOps.exif_transpose` for the
orientation, the CPU path (`vit_serve.preprocess`, exact: timm's transform) for the pixels, with torchvision's
`decode_jpeg` + the same resize code run on the CPU device; on a machine with CUDA, nvJPEG against the CPU path.
Without CUDA the gateway says why it decodes on the CPU, and the decoder's fallback is exercised on the CPU device.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
from gateway_helpers import run, serving, settings_for
from PIL import Image, ImageOps

from vit_serve.preprocess import PreprocessConfig, load_image, preprocess, resize_and_crop
from vit_serve.runtime.gpu_decode import GpuDecoder, decoder_line, orient, resize_crop, unavailable_reason

pytest.importorskip("torchvision.io")
pytest.importorskip("skimage.data")

JPEGS = ("phone_astronaut.jpg", "phone_mosaic_exif6.jpg", "uhd_coffee.jpg", "progressive_hopper.jpg",
         "thumbnail.jpg")
# torchvision's decode_jpeg (libjpeg-turbo) + antialiased resize on the CPU against Pillow's exact path: measured
# 69.9-inf dB and max |Δ| 1-2 (of 255) on the corpus at 224 (bicubic, bilinear, squash) and 32 x 48.
CPU_PSNR_MIN, CPU_MAX_DELTA = 60.0, 3
# nvJPEG's IDCT and chroma upsampling differ from libjpeg's: held to the fast path's bound (the 35 dB).
CUDA_PSNR_MIN = 35.0
CFGS = (PreprocessConfig(), PreprocessConfig(input_size=(32, 48), crop_pct=0.875),
        PreprocessConfig(interpolation="bilinear", crop_mode="squash"))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


@pytest.fixture(scope="module")
def corpus(upload_corpus) -> dict[str, bytes]:
    """The corpus's JPEGs (tests/conftest.py's upload_corpus)."""
    return upload_corpus(JPEGS)


def _exact_crop(data: bytes, cfg: PreprocessConfig) -> np.ndarray:
    return np.asarray(resize_and_crop(load_image(data), cfg))


# --------------------------------------------------------------------------------------------------------
# The GPU path's pieces, on CPU tensors
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orient_is_pillow_exif_transpose(orientation):
    a = np.random.default_rng(orientation).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    img = Image.fromarray(a)
    img.getexif()[0x0112] = orientation
    ref = np.asarray(ImageOps.exif_transpose(img))
    got = orient(torch.from_numpy(a).permute(2, 0, 1), orientation).permute(1, 2, 0).numpy()
    assert got.shape == ref.shape and np.array_equal(got, ref)


@pytest.mark.parametrize("cfg", CFGS, ids=lambda c: f"{c.input_size[0]}x{c.input_size[1]}-{c.interpolation}")
def test_gpu_geometry_on_the_cpu_device_matches_the_exact_path(corpus, cfg):
    from torchvision.io import ImageReadMode, decode_jpeg

    for name, data in corpus.items():
        orientation = Image.open(io.BytesIO(data)).getexif().get(0x0112, 1)
        with warnings.catch_warnings():  # torchvision 0.29 marks its decoders deprecated (for torchcodec)
            warnings.simplefilter("ignore", DeprecationWarning)
            img = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        got = resize_crop(orient(img, orientation), cfg).permute(1, 2, 0).numpy()
        ref = _exact_crop(data, cfg)
        assert got.shape == ref.shape, name
        assert psnr(got, ref) >= CPU_PSNR_MIN, name
        assert np.abs(got.astype(int) - ref).max() <= CPU_MAX_DELTA, name


# --------------------------------------------------------------------------------------------------------
# The decoder: batched, per-image fallback (on the CPU device here)
# --------------------------------------------------------------------------------------------------------


def test_decoder_batch_falls_back_per_image(corpus, monkeypatch):
    import torchvision.io

    decoded = []
    real = torchvision.io.decode_jpeg

    def spy(inp, *args, **kwargs):
        decoded.append(len(inp) if isinstance(inp, list) else 1)
        return real(inp, *args, **kwargs)

    monkeypatch.setattr(torchvision.io, "decode_jpeg", spy)
    cfg = PreprocessConfig(input_size=(32, 48))
    good = corpus["progressive_hopper.jpg"]
    png = io.BytesIO()
    Image.open(io.BytesIO(good)).save(png, "PNG")
    cmyk = io.BytesIO()
    Image.new("CMYK", (300, 200), (10, 20, 30, 40)).save(cmyk, "JPEG")
    batch = [good, png.getvalue(), good[: len(good) // 2], cmyk.getvalue(), b"\xff\xd8\xff not a jpeg", good]
    dec = GpuDecoder(cfg, 50_000_000, device="cpu")
    out = dec.crops(batch)
    assert [o is not None for o in out] == [True, False, False, False, False, True]
    ref = _exact_crop(good, cfg)
    assert psnr(np.asarray(out[0]), ref) >= CPU_PSNR_MIN and np.array_equal(np.asarray(out[0]), np.asarray(out[5]))
    assert dec.fallbacks == {"not a JPEG": 1, "decode_jpeg failed": 1, "JPEG mode CMYK": 1, "header refused": 1}
    assert decoded[0] == 3  # one call for the three JPEGs, then one by one to isolate the truncated one
    # over the pixel limit: refused from the header, nothing reaches the decoder
    decoded.clear()
    small = GpuDecoder(cfg, 1000, device="cpu")
    assert small.crops([good]) == [None] and decoded == [] and small.fallbacks == {"header refused": 1}


def test_filters_torchvision_cannot_apply_fall_back(corpus):
    dec = GpuDecoder(PreprocessConfig(input_size=(32, 48), interpolation="lanczos"), None, device="cpu")
    assert dec.crops([corpus["thumbnail.jpg"]]) == [None]
    assert dec.fallbacks == {"interpolation lanczos": 1}


def test_concurrent_uploads_are_decoded_together(corpus):
    import asyncio

    dec = GpuDecoder(PreprocessConfig(input_size=(32, 48)), None, device="cpu", max_batch=4)
    sizes = []
    real = dec.crops
    dec.crops = lambda datas: sizes.append(len(datas)) or real(datas)  # records the batch sizes

    async def scenario():
        return await asyncio.gather(*(dec.crop(corpus["thumbnail.jpg"]) for _ in range(6)))

    out = run(scenario())
    dec.close()
    assert all(o is not None for o in out)
    assert sum(sizes) == 6 and max(sizes) == 4 and len(sizes) == 2


# --------------------------------------------------------------------------------------------------------
# The gateway
# --------------------------------------------------------------------------------------------------------


def test_unavailable_reasons():
    assert unavailable_reason("cuda", enabled=False) == "gpu_decode is off (VIT_SERVE_GPU_DECODE=false)"
    assert unavailable_reason("cpu") == "the model runs on cpu, not CUDA"
    if not torch.cuda.is_available():
        assert unavailable_reason("cuda") == "no CUDA device is available to PyTorch"
    else:
        assert unavailable_reason("cuda:0") is None
    assert unavailable_reason("the triton server") == "the model runs on the triton server, not CUDA"


def test_the_decoder_line_names_nvjpeg_and_its_device_or_why_not():
    assert decoder_line("cuda:1", None, "vit") == "decode: nvJPEG on cuda:1 (model vit)"
    assert (decoder_line("cuda", "torchvision is not installed (pip install torchvision)", "vit")
            == "decode: CPU, torchvision is not installed (pip install torchvision) (model vit)")


def test_gateway_without_cuda_decodes_on_the_cpu_and_says_why(tiny_ckpt, tiny_model, photos, caplog):
    """... and logs it once at start: which decoder the model's uploads get, in one line."""
    data = photos["coffee.jpg"]
    caplog.set_level("INFO", logger="vit_serve.serve")

    async def scenario():
        async with serving(settings_for(tiny_ckpt)) as (client, app):
            r = await client.post("/classify?top_k=10", content=data, headers={"Content-Type": "image/jpeg"})
            return r, app.state.gateway.model()

    r, gw = run(scenario())
    assert r.status_code == 200
    assert gw.decoder.gpu is None and gw.decoder.gpu_decode_off == "the model runs on cpu, not CUDA"
    said = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("decode: ")]
    assert said == [f"decode: CPU, the model runs on cpu, not CUDA (model {gw.info.name})"], said
    with torch.no_grad():
        ref = torch.softmax(tiny_model(preprocess(data, tiny_model.preprocess_cfg)[None])[0].double(), -1)
    got = {p["index"]: p["score"] for p in r.json()["predictions"]}
    assert max(abs(got[i] - ref[i].item()) for i in range(10)) <= 1e-5


def test_gateway_with_gpu_decode_off_says_so(tiny_ckpt):
    async def scenario():
        async with serving(settings_for(tiny_ckpt, gpu_decode=False)) as (_, app):
            return app.state.gateway.model().decoder.gpu_decode_off

    assert run(scenario()) == "gpu_decode is off (VIT_SERVE_GPU_DECODE=false)"


def test_gateway_gpu_branch_with_the_decoder_on_the_cpu_device(tiny_ckpt, tiny_model, corpus, photos):
    """The gateway's GPU branch end to end, the decoder on the CPU device: a JPEG's answer is the model on the
    decoder's crop, GET /explain reuses that crop, and a PNG falls back to the exact CPU path."""
    cfg = tiny_model.preprocess_cfg
    jpeg, png = corpus["uhd_coffee.jpg"], photos["astronaut.png"]

    async def scenario():
        async with serving(settings_for(tiny_ckpt)) as (client, app):
            gateway = app.state.gateway
            gw = gateway.model()
            gw.decoder.gpu = GpuDecoder(gw.info.preprocess, gw.decoder.max_pixels, device="cpu",
                                on_fallback=lambda why: gateway.metrics.gpu_decode_fallbacks.labels(why).inc())
            a = await client.post("/classify?top_k=10", content=jpeg, headers={"Content-Type": "image/jpeg"})
            e = await client.get(f"/explain?id={a.json()['id']}&format=json")
            b = await client.post("/classify?top_k=10", content=png, headers={"Content-Type": "image/png"})
            bad = await client.post("/classify", content=jpeg[:2000], headers={"Content-Type": "image/jpeg"})
            fallbacks = dict(gw.decoder.gpu.fallbacks)
            metrics = (await client.get("/metrics")).text
            assert 'vit_serve_gpu_decode_fallbacks_total{reason="not a JPEG"} 1.0' in metrics, metrics
            gw.decoder.close()
            return a, e, b, bad, fallbacks

    a, e, b, bad, fallbacks = run(scenario())
    assert a.status_code == 200 and e.status_code == 200 and b.status_code == 200
    assert bad.status_code == 422 and "Traceback" not in bad.text  # the CPU path's answer for a truncated file
    assert fallbacks == {"not a JPEG": 1, "decode_jpeg failed": 1}

    def scores(r):
        s = np.zeros(10)
        for p in r.json()["predictions"]:
            s[p["index"]] = p["score"]
        return s

    crop = GpuDecoder(cfg, None, device="cpu").crops([jpeg])[0]
    from vit_serve.preprocess import to_tensor

    with torch.no_grad():
        want_a = torch.softmax(tiny_model(to_tensor(crop, cfg)[None])[0].double(), -1).numpy()
        want_b = torch.softmax(tiny_model(preprocess(png, cfg)[None])[0].double(), -1).numpy()
    assert np.abs(scores(a) - want_a).max() <= 1e-5
    assert np.abs(scores(b) - want_b).max() <= 1e-5
    assert e.json()["predictions"][0]["index"] == int(np.argmax(want_a))


# --------------------------------------------------------------------------------------------------------
# On CUDA
# --------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: nvJPEG decoding is checked on GPUs only")
def test_cuda_decode_matches_the_cpu_path(corpus, tiny_ckpt):
    for cfg in CFGS:
        dec = GpuDecoder(cfg, 50_000_000, device="cuda")
        crops = dec.crops(list(corpus.values()))
        assert dec.fallbacks == {}
        for (name, data), crop in zip(corpus.items(), crops, strict=True):
            p = psnr(np.asarray(crop), _exact_crop(data, cfg))
            print(f"nvJPEG vs exact, {cfg.input_size} {cfg.interpolation} {name}: {p:.1f} dB")
            assert p >= CUDA_PSNR_MIN, name
        dec.close()

    async def scenario():
        async with serving(settings_for(tiny_ckpt, device="cuda")) as (client, app):
            r = await client.post("/classify", content=corpus["phone_astronaut.jpg"],
                                  headers={"Content-Type": "image/jpeg"})
            decoder = app.state.gateway.model().decoder
            return r, decoder.gpu_decode_off, dict(decoder.gpu.fallbacks)

    r, off, fallbacks = run(scenario())
    assert r.status_code == 200 and off is None and fallbacks == {}
