"""benchmarks/serve_abuse.py (`serve_load.py --mode abuse`): its abusive requests are what they claim, and each
kind gets the answer it expects from the real gateway: the /v2 bombs (Starlette's TestClient), and the labels,
duplicate key headers and stalled uploads against a real uvicorn over a real text-tower export, keys on."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_abuse.py"


def _script():
    spec = importlib.util.spec_from_file_location("serve_abuse", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _jpeg() -> bytes:
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (24, 40, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="JPEG")
    return buf.getvalue()


def test_the_abusive_requests_are_what_they_claim():
    """The measured attack as the issue describes it: 3,000 1x1 PBMs (Pillow opens each) in a 48 KB JSON body,
    its gzip form 100x smaller at least; binary tensors whose lengths add up; shapes that overflow int64.
    Reference: json, gzip and Pillow reading the bodies back."""
    import base64
    import gzip
    import json

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


@pytest.fixture(scope="module")
def clip_gateway(tmp_path_factory):
    """(module, URL, settings) of a real uvicorn over the benchmark's CLIP export (80 templates, text tower), keys
    on from the benchmark's key file (the labels key slower); stalled bodies end after 1 s and a key holds at most
    2 requests."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))
    from gateway_helpers import live_server, settings_for

    m = _script()
    # the labels key at one prompt a second: its first request runs, its next is a 429 on any machine's speed
    m.KEYS = {**m.KEYS, "labels": (m.KEYS["labels"][0], "rate=1 burst=1")}
    folder = tmp_path_factory.mktemp("abuse")
    repo = m.export_clip(folder / "repo")
    settings = settings_for(repo, default_model="clip", api_keys_file=str(m.key_file(folder / "keys.txt")),
                            body_timeout_s=1.0, max_concurrent_per_key=2, grpc_port=0)
    with live_server(settings) as url:
        yield m, url, settings


def test_the_labels_and_key_header_kinds_get_their_expected_answers(clip_gateway):
    """64 labels x 80 templates: 200, then 429 once the key's prompt budget is spent (its next requests wait);
    65 labels: 400; random-unicode labels: 200 or 429; more than one key header: 400. Sent over real sockets."""
    import httpx

    m, url, settings = clip_gateway
    kinds = [*m.label_requests("clip", settings.max_labels, len(m.clip_templates()), _jpeg(), n_random=4),
             *m.key_header_requests(_jpeg())]
    seen: dict[str, list[int]] = {}
    with httpx.Client(base_url=url, timeout=300) as client:
        for req in kinds:
            for k in range(2):
                r = client.post(req.path_for(k), content=req.body, headers=list(req.headers))
                seen.setdefault(req.name, []).append(r.status_code)
                assert r.status_code in req.expect, (req.name, r.status_code, r.text[:300])
    many = next(name for name in seen if "x 80 templates" in name)
    assert seen[many] == [200, 429], seen  # 5,120 prompts from a bucket of 1: the second request waits
    assert all(s == [400, 400] for name, s in seen.items() if "header" in name or "max_labels" in name), seen


def test_stalled_uploads_are_answered_408_or_429_and_never_hold_a_slot_forever(clip_gateway):
    """4 stalled uploads on one key against body_timeout_s 1 and max_concurrent_per_key 2: the first two get 408
    when their body deadline ends, the others 429 at once; none is left without an answer for long."""
    m, url, _ = clip_gateway
    seen: dict[str, Counter[int]] = {}

    async def run() -> None:
        stop = asyncio.Event()
        task = asyncio.ensure_future(m.stall(url, m.stalled_upload(), 4, stop, seen))
        await asyncio.sleep(3.5)
        stop.set()
        await task

    asyncio.run(run())
    counts = seen[m.stalled_upload().name]
    assert set(counts) <= m.stalled_upload().expect, counts
    assert counts[408] >= 2 and counts[429] >= 1, counts
