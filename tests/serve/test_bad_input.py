"""Untrusted input: every bad upload or parameter gets a 4xx with a message, never a 500, and a flood of corrupt
uploads leaves a real server healthy."""

from __future__ import annotations

import asyncio
import gzip
import io
import json

import httpx
import pytest
from gateway_helpers import live_server, metric, run, serving, settings_for
from PIL import Image

JPEG = {"Content-Type": "image/jpeg"}
PNG = {"Content-Type": "image/png"}


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """A 12000 x 12000 PNG (144 megapixels) of a few kilobytes."""
    return _png(Image.new("1", (12000, 12000)))


def _post(client, path: str, data: bytes, ctype: str = "image/jpeg"):
    return client.post(path, content=data, headers={"Content-Type": ctype})


def test_not_an_image_is_415(tiny_ckpt, photos):
    async def scenario():
        async with serving(settings_for(tiny_ckpt)) as (client, _):
            return [
                await _post(client, "/classify", b"hello", "text/plain"),
                await client.post("/classify", json={"image": "x"}),
                await client.post("/classify", content=photos["coffee.jpg"]),  # no Content-Type at all
                await _post(client, "/classify", b"just some words, not pixels", "image/png"),
                await client.post("/classify", files={"file": ("a.png", b"plain text", "image/png")}),
                await client.post("/classify", files={"file": ("a.txt", photos["coffee.jpg"], "text/plain")}),
                await _post(client, "/explain", b"<svg></svg>", "image/svg+xml"),
            ]

    for r in run(scenario()):
        assert r.status_code == 415, r.text
        assert isinstance(r.json()["detail"], str) and r.json()["detail"]


def test_corrupt_truncated_or_empty_image_is_422(tiny_ckpt, photos):
    jpeg, png = photos["chelsea.jpg"], photos["astronaut.png"]

    async def scenario():
        async with serving(settings_for(tiny_ckpt)) as (client, _):
            return [
                await _post(client, "/classify", jpeg[: len(jpeg) // 2]),
                await _post(client, "/classify", png[: len(png) // 3], "image/png"),
                await _post(client, "/classify", png[:100] + bytes(len(png) - 100), "image/png"),
                await client.post("/classify", files={"file": ("t.jpg", jpeg[:2000], "image/jpeg")}),
                await _post(client, "/classify", b"", "image/png"),
            ], await client.post("/classify", files={"image": ("c.jpg", jpeg, "image/jpeg")})

    corrupt, wrong_field = run(scenario())
    for r in corrupt:
        assert r.status_code == 422, r.text
        assert "image" in r.json()["detail"]
    assert wrong_field.status_code == 422
    assert "field 'file'" in wrong_field.json()["detail"]


def test_body_over_the_limit_is_413_naming_it(tiny_ckpt, photos):
    big = photos["astronaut.png"]
    assert len(big) > 50_000

    async def chunks():  # no Content-Length: counted while reading
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    async def scenario():
        async with serving(settings_for(tiny_ckpt, max_body_bytes=50_000)) as (client, _):
            return [
                await _post(client, "/classify", big, "image/png"),
                await client.post("/classify", files={"file": ("a.png", big, "image/png")}),
                await client.post("/classify", content=chunks(), headers=PNG),
                await client.post("/explain", content=chunks(), headers=PNG),
                await client.post("/v2/models/tiny/infer", content=chunks()),
            ], await _post(client, "/classify", photos["coffee.jpg"][:40_000])  # under the limit: decoded

    too_big, under = run(scenario())
    for r in too_big:
        assert r.status_code == 413, r.text
        message = r.json().get("detail") or r.json().get("error")
        assert "50000 bytes" in message
    assert under.status_code == 422  # a truncated JPEG, but read


def test_real_server_refuses_large_bodies_early(tiny_ckpt):
    big = bytes(range(256)) * 4096  # 1 MiB

    def chunks():
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    with live_server(settings_for(tiny_ckpt, max_body_bytes=100_000)) as url:
        declared = httpx.post(f"{url}/classify", content=big, headers=PNG, timeout=30)
        multipart = httpx.post(f"{url}/classify", files={"file": ("a.png", big, "image/png")}, timeout=30)
        chunked = httpx.post(f"{url}/classify", content=chunks(), headers=PNG, timeout=30)
        health = httpx.get(f"{url}/healthz")
    for r in (declared, multipart, chunked):
        assert r.status_code == 413
        assert "limit of 100000 bytes" in r.json()["detail"]
    assert health.status_code == 200


def test_decompression_bomb_and_pixel_cap_are_413(tiny_ckpt, photos, bomb):
    limit = Image.MAX_IMAGE_PIXELS

    async def scenario(**kw):
        async with serving(settings_for(tiny_ckpt, **kw)) as (client, _):
            assert kw.get("max_pixels", 50_000_000) == Image.MAX_IMAGE_PIXELS  # PIL's own guard: the same cap
            return [await _post(client, "/classify", bomb, "image/png"),
                    await _post(client, "/classify", photos["coffee.jpg"])]

    default_bomb, coffee = run(scenario())  # the default cap, 50 megapixels
    assert default_bomb.status_code == 413
    detail = default_bomb.json()["detail"]
    assert "the limit is 50000000 pixels" in detail and f"{12000 * 12000} pixels" in detail
    assert str(2 * 50_000_000) not in detail  # our limit only, not PIL's decompression-bomb one (twice ours)
    assert coffee.status_code == 200
    tight_bomb, tight_coffee = run(scenario(max_pixels=100_000))  # coffee is 600 x 400 = 240000 pixels
    assert tight_bomb.status_code == 413
    assert tight_coffee.status_code == 413
    assert "240000 pixels" in tight_coffee.json()["detail"]
    assert "the limit is 100000 pixels" in tight_bomb.json()["detail"]
    assert str(2 * 100_000) not in tight_bomb.json()["detail"]
    assert limit == Image.MAX_IMAGE_PIXELS  # restored when the server stops


BAD_PARAMS = ["/classify?top_k=0", "/classify?top_k=abc", "/classify?top_k=-3", "/explain?discard_ratio=2",
              "/explain?discard_ratio=-0.1", "/explain?discard_ratio=nan", "/explain?head_fusion=avg",
              "/explain?method=gradcam", "/explain?format=gif", "/explain?alpha=3", "/explain?colormap=viridis",
              "/explain?target=-1", "/explain?size=0", "/explain?size=15", "/explain?size=2049",
              "/explain?size=abc", "/explain?size=1.5"]


def test_bad_parameters_are_422(tiny_ckpt, photos):
    async def scenario():
        async with serving(settings_for(tiny_ckpt)) as (client, _):
            out = [await _post(client, url, photos["coffee.jpg"]) for url in BAD_PARAMS]
            image_id = (await _post(client, "/classify", photos["coffee.jpg"])).json()["id"]
            out.append(await client.get(f"/explain?id={image_id}&discard_ratio=1.5"))
            out.append(await client.get(f"/explain?id={image_id}&method=grad_rollout&target=10"))
            out.append(await client.get("/explain"))  # no id
            return out

    for url, r in zip([*BAD_PARAMS, "GET discard_ratio", "GET target", "GET no id"], run(scenario()), strict=True):
        assert r.status_code == 422, (url, r.text)
        assert r.json()["detail"], url
        if "size=" in url:  # the parameter and its bound are named
            assert r.json()["detail"][0]["loc"] == ["query", "size"], r.text


def test_no_route_answers_500_to_bad_input(tiny_ckpt, tiny_onnx, photos, bomb):
    jpeg = photos["chelsea.jpg"]
    bodies = [b"", b"\x00" * 64, b"garbage", jpeg[:500], bomb, b'{"inputs": 1}', b"--x\r\nbroken multipart"]
    types = ["image/jpeg", "image/png", "text/plain", "application/json", "multipart/form-data; boundary=x",
             "multipart/form-data", "application/octet-stream"]
    v2_bodies = [b'{"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [1, 3, 32, 48], "data": [1]}]}',
                 b'{"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [1, 3, 2, 2], "data": '
                 + b"[" + b",".join([b"0"] * 12) + b"]}]}",
                 b'{"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": ["bm90IGFuIGltYWdl"]}]}',
                 b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]}',
                 b'{"inputs": [{"name": "pixel_values", "datatype": "WAT", "shape": [1], "data": [1]}]}',
                 b'{"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [-1], "data": [1]}]}',
                 b'{"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [1], "data": [NaN]}]}',
                 b'{"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [1], "data": [1e300]}]}',
                 b'{"inputs": [], "outputs": 3}', b"[1, 2]", b"\xff\xfe"]

    async def scenario(model):
        async with serving(settings_for(model, max_body_bytes=200_000)) as (client, _):
            statuses = []
            for path in ("/classify", "/explain", "/explain?method=grad_rollout", "/classify?top_k=1"):
                for body in bodies:
                    for ctype in types:
                        r = await client.post(path, content=body, headers={"Content-Type": ctype})
                        statuses.append((path, ctype, body[:16], r.status_code))
            for body in v2_bodies + bodies:
                r = await client.post("/v2/models/tiny/infer", content=body)
                statuses.append(("v2", "", body[:16], r.status_code))
                assert "error" in r.json()
                r = await client.post("/v2/models/tiny/infer", content=body,
                                      headers={"Inference-Header-Content-Length": "7"})
                statuses.append(("v2 binary", "", body[:16], r.status_code))
            for url in ("/explain?id=" + "f" * 64, "/v2/models/other", "/v2/models/tiny/versions/9", "/nowhere"):
                statuses.append((url, "", b"", (await client.get(url)).status_code))
            metrics = (await client.get("/metrics")).text
            return statuses, metrics

    for model in (tiny_ckpt, tiny_onnx):
        statuses, metrics = run(scenario(model))
        failures = [s for s in statuses if not 400 <= s[-1] < 500]
        assert not failures, failures
        assert 'status="500"' not in metrics


def test_flood_of_corrupt_uploads_leaves_a_real_server_healthy(tiny_ckpt, photos):
    jpeg = photos["chelsea.jpg"]
    corrupt = [jpeg[: 200 + 37 * i] for i in range(100)] + [bytes([i % 256]) * (100 + i) for i in range(100)]

    async def flood(url: str):
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
            rs = await asyncio.gather(*(client.post("/classify", files={"file": ("x.jpg", b, "image/jpeg")})
                                        for b in corrupt))
            health = await client.get("/healthz")
            ready = await client.get("/readyz")
            good = await client.post("/classify", content=jpeg, headers=JPEG)
            return rs, health, ready, good, (await client.get("/metrics")).text

    with live_server(settings_for(tiny_ckpt)) as url:
        rs, health, ready, good, text = run(flood(url))
    assert len(rs) == 200
    assert {r.status_code for r in rs} <= {415, 422}, {r.status_code for r in rs}
    assert health.status_code == 200 and ready.status_code == 200
    assert good.status_code == 200 and len(good.json()["predictions"]) == 5
    assert metric(text, "vit_serve_requests_total", endpoint="/classify", method="POST", status="422") \
        + metric(text, "vit_serve_requests_total", endpoint="/classify", method="POST", status="415") == 200


def test_nested_json_odd_header_lengths_and_overflowing_shapes_are_400(tiny_onnx):
    """Inputs that raised inside the parsers (500): JSON nested past Python's recursion limit (RecursionError in
    json.loads) on every JSON body the gateway parses, an integer of 5,000 digits (int() refuses it), an
    Inference-Header-Content-Length of digits str.isdigit takes and int() does not, and shapes whose element
    count overflows int64 ([2**32, 2**32] wraps to 0 in numpy; [2**70] does not fit at all) or has more
    dimensions than numpy allows. Each answers 400 with a message."""
    nested = b"[" * 100_000 + b"]" * 100_000
    deep_input = b'{"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [1], "data": ' \
        + b"[" * 50_000 + b"1" + b"]" * 50_000 + b"}]}"
    huge_int = b'{"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [' + b"9" * 5000 + b"]}]}"

    def spec(datatype: str, shape: list[int], **kw) -> bytes:
        return json.dumps({"inputs": [{"name": "pixel_values" if datatype != "BYTES" else "image",
                                       "datatype": datatype, "shape": shape, **kw}]}).encode()

    shapes = [spec("FP32", [2**32, 2**32], data=[]), spec("FP32", [2**70], data=[1.0]),
              spec("BYTES", [2**32, 2**32], data=[]), spec("FP32", [2**62, 4], data=[]),
              spec("FP32", [1] * 100, data=[1.0])]
    binary_shape = json.dumps({"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [2**32, 2**32],
                                           "parameters": {"binary_data_size": 0}}]}).encode()

    async def scenario():
        # with an admin key, so that load and unload read their bodies
        async with serving(settings_for(tiny_onnx, api_keys=["user"], admin_api_keys=["admin"])) as (client, _):
            client.headers["Authorization"] = "Bearer admin"
            out = []
            for body in (nested, deep_input, huge_int, *shapes):
                out.append(("infer", body[:40], await client.post("/v2/models/tiny/infer", content=body)))
                out.append(("infer gzip", body[:40], await client.post(
                    "/v2/models/tiny/infer", content=gzip.compress(body), headers={"Content-Encoding": "gzip"})))
            out.append(("binary shape", binary_shape[:40], await client.post(
                "/v2/models/tiny/infer", content=binary_shape,
                headers={"Inference-Header-Content-Length": str(len(binary_shape))})))
            for length in ("\u00b2", "\u00b9", "1\u00b3", "9" * 5000, "-1", " 7 "):  # as latin-1 bytes, as sent
                out.append((f"header {length[:8]!r}", b"", await client.post(
                    "/v2/models/tiny/infer", content=b'{"inputs": []}' + b"\x00" * 8,
                    headers=[(b"Inference-Header-Content-Length", length.encode("latin-1"))])))
            for path in ("/v2/repository/index", "/v2/repository/models/tiny/load",
                         "/v2/repository/models/tiny/unload"):
                for body in (nested, b"9" * 5000):
                    out.append((path, body[:40], await client.post(path, content=body)))
            return out

    answers = run(scenario())
    for what, body, r in answers:
        print(what, body, r.status_code, r.text[:160])
    wrong = [(what, body, r.status_code, r.text[:200]) for what, body, r in answers
             if r.status_code != 400 or not r.json().get("error")]
    assert not wrong, wrong
