"""benchmarks/serve_load.py's pure pieces: unique payloads are unique; the stage split sums to the latency; the
uploads checks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_load.py"


def _script():
    spec = importlib.util.spec_from_file_location("serve_load", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _jpeg(exif_orientation: int | None = None) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (24, 40, 3), dtype=np.uint8))
    buf = io.BytesIO()
    kw = {}
    if exif_orientation:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        kw["exif"] = exif.tobytes()
    img.save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


def test_unique_payloads_have_distinct_sha256_and_decode_to_the_same_pixels_as_pillow():
    """Reference: hashlib's sha256 (the gateway's image id) and Pillow's decode of the original bytes."""
    import hashlib
    import io

    import numpy as np
    from PIL import Image, ImageOps

    m = _script()
    bases = [_jpeg(), _jpeg(exif_orientation=6)]
    bodies = m.payloads(bases, 0, 10)
    assert len({hashlib.sha256(b).hexdigest() for b in bodies}) == 10
    assert m.payloads(bases, 3, 4) == bodies[3:7]  # deterministic, and the indices run on across levels
    for i, body in enumerate(bodies[:2]):
        with Image.open(io.BytesIO(body)) as got, Image.open(io.BytesIO(bases[i])) as want:
            assert got.getexif().get(0x0112) == want.getexif().get(0x0112)  # the EXIF segment is kept
            assert np.array_equal(np.asarray(ImageOps.exif_transpose(got)), np.asarray(ImageOps.exif_transpose(want)))
    repeated = m.payloads(bases, 0, 8, repeats=4)  # each image 4 times in a row: the crop store answers 3 of 4
    assert len({hashlib.sha256(b).hexdigest() for b in repeated}) == 2 and repeated[0] == repeated[3]
    with pytest.raises(ValueError, match="JPEG"):
        m.unique_jpeg(b"\x89PNG\r\n", 0)


def test_stage_split_sums_to_the_latency():
    m = _script()
    timing = m.server_timing("read;dur=2.5, decode_wait;dur=10, decode;dur=30.25, queue;dur=4, infer;dur=8, "
                             "total;dur=55")
    assert timing == {"read": 2.5, "decode_wait": 10.0, "decode": 30.25, "queue": 4.0, "infer": 8.0, "total": 55.0}
    split = m.stage_split(60.0, timing)
    assert list(split) == list(m.STAGES)
    assert sum(split.values()) == pytest.approx(60.0)
    assert split["response"] == pytest.approx(5.25)


def test_upload_checks_and_the_memory_ceiling():
    m = _script()
    tp = {("fast", "phone", 16): 14.0, ("exact", "phone", 16): 5.0, ("fast", "small", 16): 17.0,
          ("exact", "small", 16): 17.2}
    assert [ok for *_, ok in m.upload_checks(tp)] == [True, True, True]
    tp["exact", "phone", 16] = 6.0  # 2.33x: below the 2.5x target
    assert [ok for *_, ok in m.upload_checks(tp)] == [False, True, True]
    settings = {"max_body_bytes": 10 * 2**20, "decode_workers": 1, "max_pixels": 50_000_000, "max_queue": 256,
                "store_size": 256}
    one, more = m.memory_ceiling(100.0, settings, 1, (224, 224)), m.memory_ceiling(100.0, settings, 64, (224, 224))
    assert more - one == pytest.approx(63 * 20)  # two body copies of 10 MB per more connection
    settings["decode_workers"] = 2
    assert m.memory_ceiling(100.0, settings, 1, (224, 224)) - one == pytest.approx(6 * 50_000_000 / 2**20)


def test_the_middleware_cost_is_measured_against_the_bare_app():
    """The security mode's direct measurement: the real ApiKeys + RequestId around an app that answers at once
    cost something positive, and far less than a millisecond, per request."""
    us = _script().middleware_cost_us("bench-key", n=2000)
    assert 0 < us < 1000


def test_the_abusive_requests_are_what_they_claim():
    """The measured attack as the issue describes it: 3,000 1x1 PBMs (Pillow opens each) in a 48 KB JSON body,
    its gzip form 100x smaller at least; binary tensors whose lengths add up; shapes that overflow int64.
    Reference: json, gzip and Pillow reading the bodies back."""
    import base64
    import gzip
    import io
    import json

    import numpy as np
    from PIL import Image

    m = _script()
    reqs = {r.name.split(" (")[0]: r for r in m.abuse_requests("model", (32, 48), 16)}
    many = reqs["3000 1x1 PBMs, JSON"]
    doc = json.loads(many.body)
    assert 40_000 < len(many.body) < 60_000 and doc["inputs"][0]["shape"] == [3000]
    with Image.open(io.BytesIO(base64.b64decode(doc["inputs"][0]["data"][0]))) as img:
        assert img.size == (1, 1) and img.format == "PPM"
    packed = reqs["the same, gzip"]
    assert gzip.decompress(packed.body) == many.body and len(packed.body) * 100 < len(many.body)
    for name in ("3000 1x1 PBMs, binary tensor", "pixel_values [17, 3, 32, 48], binary tensor"):
        r = reqs[name]
        n = int(dict(r.headers)[b"inference-header-content-length"])
        head = json.loads(r.body[:n])
        assert head["inputs"][0]["parameters"]["binary_data_size"] == len(r.body) - n, name
    assert reqs["pixel_values [17, 3, 32, 48], binary tensor"].expect == {400, 413}
    wraps = json.loads(reqs["shape [2**32, 2**32]"].body)["inputs"][0]["shape"]
    assert int(np.prod(wraps, dtype=np.int64)) == 0  # numpy's int64 product wraps: 2**64 -> 0
    with pytest.raises(OverflowError):
        np.prod(json.loads(reqs["shape [2**70]"].body)["inputs"][0]["shape"], dtype=np.int64)
    assert all(r.expect <= {400, 413} for r in reqs.values())


def test_the_abusive_requests_get_their_expected_answers_from_the_real_gateway(tmp_path, save_tiny):
    """Each of the benchmark's abusive requests, sent to the real app (Starlette's TestClient) serving a tiny
    checkpoint with the default bounds, answers what `expect` says; a normal upload still answers 200."""
    from starlette.testclient import TestClient

    from vit_serve.serve.app import create_app
    from vit_serve.serve.settings import ServeSettings

    m = _script()
    ckpt = save_tiny(tmp_path / "tiny.safetensors", (32, 32), 0, [f"c{i}" for i in range(10)])
    settings = ServeSettings(model=str(ckpt), device="cpu", threads=1, decode_workers=2, max_batch=4)
    with TestClient(create_app(settings)) as client:
        for req in m.abuse_requests("tiny", (32, 32), 4):
            r = client.post(req.path, content=req.body, headers=list(req.headers))
            print(f"{req.name}: {r.status_code} {r.text[:120]}")
            assert r.status_code in req.expect, (req.name, r.status_code, r.text[:300])
        good = client.post("/classify", files={"file": ("photo.jpg", _jpeg(), "image/jpeg")})
        assert good.status_code == 200, good.text


def test_abuse_checks_and_ceiling():
    m = _script()
    ok = m.abuse_checks([20.0, 21.0], [17.0, 18.0], 900.0, 1000.0, 0, 0)
    assert [c[-1] for c in ok] == [True, True, True, True]
    slow = m.abuse_checks([20.0, 21.0], [15.0, 16.0], 1100.0, 1000.0, 2, 1)  # 0.76x, over the ceiling, 5xx
    assert [c[-1] for c in slow] == [False, False, False, False]
    settings = {"max_body_bytes": 10 * 2**20, "decode_workers": 2, "max_pixels": 50_000_000, "max_queue": 256,
                "store_size": 256, "max_images_per_request": 0, "max_batch": 16}
    base = m.memory_ceiling(100.0, settings, 20, (224, 224))
    extra = m.abuse_memory_ceiling(100.0, settings, 20, (224, 224)) - base
    assert extra == pytest.approx(20 * (10 * 2**20 + 16 * 4 * 3 * 224 * 224) / 2**20)
    settings["max_images_per_request"] = 64  # the setting, not max_batch, bounds a request's decoded images
    assert m.abuse_memory_ceiling(100.0, settings, 20, (224, 224)) - base == pytest.approx(
        20 * (10 * 2**20 + 64 * 4 * 3 * 224 * 224) / 2**20)
