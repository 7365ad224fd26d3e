"""benchmarks/serve_load.py's pure pieces (and those of harness.py and load_client.py, on which it stands): unique
payloads are unique; the stage split sums to the latency; the uploads checks. The abuse mode's pieces:
test_serve_abuse.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_load.py"


def _script(name: str = "serve_load"):
    """A script of benchmarks/ (serve_load; its siblings harness and load_client, which hold the shared pieces)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPT.with_name(f"{name}.py"))
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

    m = _script("load_client")
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
    m = _script("load_client")
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
    ceiling = _script("harness").memory_ceiling
    one, more = ceiling(100.0, settings, 1, (224, 224)), ceiling(100.0, settings, 64, (224, 224))
    assert more - one == pytest.approx(63 * 20)  # two body copies of 10 MB per more connection
    settings["decode_workers"] = 2
    assert ceiling(100.0, settings, 1, (224, 224)) - one == pytest.approx(6 * 50_000_000 / 2**20)


def test_the_middleware_cost_is_measured_against_the_bare_app():
    """The security mode's direct measurement: the real ApiKeys + RequestId around an app that answers at once
    cost something positive, and far less than a millisecond, per request."""
    us = _script().middleware_cost_us("bench-key", n=2000)
    assert 0 < us < 1000
