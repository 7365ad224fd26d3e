"""One decode per upload: counted with spies around Pillow's real `Image.open` (headers parsed) and
`ImageFile.load` (pixel data decoded, counted when it has tiles left to decode). POST /classify and POST /explain
decode once, and what they keep lets GET /explain and a repeated upload decode nothing."""

from __future__ import annotations

import base64

import pytest
from gateway_helpers import run, serving, settings_for
from PIL import Image, ImageFile


@pytest.fixture
def decodes(monkeypatch) -> dict[str, int]:
    counts = {"open": 0, "pixels": 0}
    real_open, real_load = Image.open, ImageFile.ImageFile.load

    def open_spy(*args, **kwargs):
        counts["open"] += 1
        return real_open(*args, **kwargs)

    def load_spy(self):
        if self.tile:  # tiles still to decode: this call decodes pixels
            counts["pixels"] += 1
        return real_load(self)

    monkeypatch.setattr(Image, "open", open_spy)
    monkeypatch.setattr(ImageFile.ImageFile, "load", load_spy)
    return counts


@pytest.mark.parametrize("decode", ["exact", "fast"])
def test_each_upload_is_decoded_once(tiny_ckpt, photos, decodes, decode):
    jpeg, png = photos["coffee.jpg"], photos["astronaut.png"]
    steps: list[tuple[str, dict[str, int]]] = []

    async def scenario():
        async with serving(settings_for(tiny_ckpt, decode=decode)) as (client, _):
            async def step(name, call):
                before = dict(decodes)
                r = await call
                assert r.status_code == 200, (name, r.text)
                steps.append((name, {k: decodes[k] - before[k] for k in decodes}))
                return r

            c = await step("classify", client.post("/classify", files={"file": ("c.jpg", jpeg, "image/jpeg")}))
            await step("explain by id (png)", client.get(f"/explain?id={c.json()['id']}"))
            await step("explain by id (json)", client.get(f"/explain?id={c.json()['id']}&format=json"))
            await step("classify again", client.post("/classify", content=jpeg,
                                                     headers={"Content-Type": "image/jpeg"}))
            await step("explain upload", client.post("/explain", content=png, headers={"Content-Type": "image/png"}))
            v2 = {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                              "parameters": {"content_type": "base64"},
                              "data": [base64.b64encode(photos["chelsea.jpg"]).decode()]}]}
            await step("v2 infer", client.post("/v2/models/tiny/infer", json=v2))

    run(scenario())
    assert dict(steps) == {
        "classify": {"open": 1, "pixels": 1},
        "explain by id (png)": {"open": 0, "pixels": 0},
        "explain by id (json)": {"open": 0, "pixels": 0},
        "classify again": {"open": 0, "pixels": 0},  # the crop from the first decode
        "explain upload": {"open": 1, "pixels": 1},
        "v2 infer": {"open": 1, "pixels": 1},
    }


def test_a_transparent_12mp_upload_makes_no_full_size_copy_in_numpy():
    """Compositing alpha over white used to hold several full-size arrays (int32, 4 bytes a channel) at once:
    about 560 MB traced for this 12 MP RGBA PNG. numpy's allocations are traced by tracemalloc (Pillow's own are
    not), so the traced peak must stay under the size of one RGB copy of the image."""
    import io
    import tracemalloc

    import numpy as np

    from vit_serve.preprocess import PreprocessConfig, load_image
    from vit_serve.runtime.decode import decode as decode_upload

    w, h = 4032, 3024
    g = Image.linear_gradient("L").resize((w, h))
    img = Image.merge("RGBA", (g, g.transpose(Image.Transpose.ROTATE_180), g.transpose(Image.Transpose.FLIP_LEFT_RIGHT),
                               g))
    buf = io.BytesIO()
    img.save(buf, "PNG", compress_level=1)
    data = buf.getvalue()
    cfg = PreprocessConfig(input_size=(224, 224), decode="fast")  # a PNG: both paths convert the same way
    tracemalloc.start()
    try:
        out = decode_upload(data, cfg, 50_000_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < w * h * 3, f"{peak / 2**20:.0f} MiB traced"
    # and the pixels are the composite over white: (c * a + 255 * (255 - a)) / 255, rounded
    rgba = np.asarray(img).astype(np.float64)
    ref = np.rint((rgba[..., :3] * rgba[..., 3:] + 255 * (255 - rgba[..., 3:])) / 255)
    assert np.array_equal(np.asarray(load_image(data)), ref.astype(np.uint8))
    assert out.crop.size == (224, 224)


def test_a_store_hit_is_only_the_callers_own(tiny_ckpt, photos, decodes):
    """Caller A's upload is kept; caller B's identical upload is decoded again (so its `timing_ms.decode` and
    `Server-Timing` decode are a decode's, never the store hit that would tell B that someone sent this file),
    while A's own repeat decodes nothing. Counted with the Pillow spies above."""
    data = photos["coffee.jpg"]
    a = {"X-API-Key": "caller-a-key-0123456789", "Content-Type": "image/jpeg"}
    b = {"X-API-Key": "caller-b-key-0123456789", "Content-Type": "image/jpeg"}
    steps: dict[str, dict[str, int]] = {}

    async def scenario():
        async with serving(settings_for(tiny_ckpt, api_keys=[a["X-API-Key"], b["X-API-Key"]])) as (client, _):
            for name, headers, path in (("a", a, "/classify"), ("b", b, "/classify"), ("a again", a, "/classify"),
                                        ("b embed", b, "/embed"), ("b explain", b, "/explain?format=json")):
                before = dict(decodes)
                r = await client.post(path, content=data, headers=headers)
                assert r.status_code == 200, (name, r.text)
                assert "decode" in r.json()["timing_ms"]
                steps[name] = {k: decodes[k] - before[k] for k in decodes}

    run(scenario())
    assert steps == {"a": {"open": 1, "pixels": 1}, "b": {"open": 1, "pixels": 1},
                     "a again": {"open": 0, "pixels": 0}, "b embed": {"open": 0, "pixels": 0},
                     "b explain": {"open": 0, "pixels": 0}}
