"""Reading an upload (`vit_serve.serve.uploads.read_image`): the sha256 is updated chunk by chunk as the body
arrives, and equals hashlib's over the whole body; the routes use that digest instead of hashing again. And the
formats an upload may be: Pillow opens uploads with an explicit allowlist (`vit_serve.preprocess.IMAGE_FORMATS`),
so that real files Pillow itself writes in the other formats (EPS, ICO, TGA, PCX) answer 415 naming the accepted
ones, while each accepted format is classified (reference: Pillow's own encoders)."""

from __future__ import annotations

import hashlib
import io

import numpy as np
import pytest
from gateway_helpers import run, serving, settings_for
from starlette.requests import Request

from vit_serve.runtime import decode as images
from vit_serve.serve import uploads


class SpySha256:
    """hashlib's sha256, recording the size of each update (a spy around the real object)."""

    def __init__(self, log: list[int]) -> None:
        self._h = hashlib.sha256()
        self._log = log

    def update(self, data: bytes) -> None:
        self._log.append(len(data))
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def _request(chunks: list[bytes], content_type: str, seen: list[int], updates: list[int]) -> Request:
    """A real Starlette request whose body arrives in `chunks`; `seen[k]`: updates made before chunk k was read."""
    pending = list(chunks)

    async def receive():
        seen.append(len(updates))
        body = pending.pop(0) if pending else b""
        return {"type": "http.request", "body": body, "more_body": bool(pending)}

    scope = {"type": "http", "method": "POST", "path": "/classify", "headers": [
        (b"content-type", content_type.encode()), (b"content-length", str(sum(map(len, chunks))).encode())]}
    return Request(scope, receive)


def test_raw_body_is_hashed_as_it_is_read(monkeypatch, photos):
    updates: list[int] = []
    monkeypatch.setattr(uploads, "sha256", lambda: SpySha256(updates))
    data = photos["coffee.jpg"]
    chunks = [data[i:i + 4096] for i in range(0, len(data), 4096)]
    seen: list[int] = []
    upload = run(uploads.read_image(_request(chunks, "image/jpeg", seen, updates)))
    assert upload.data == data
    assert upload.sha256 == hashlib.sha256(data).hexdigest()
    assert updates == [len(c) for c in chunks]
    # when chunk k is read, the k chunks before it are hashed already: no second pass over the body
    assert seen[:len(chunks)] == list(range(len(chunks)))


def _form(data: bytes, boundary: str = "b0undary", before: bytes = b"", after: bytes = b"") -> bytes:
    return (before + f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x.jpg\"\r\n"
            f"Content-Type: image/jpeg\r\n\r\n".encode() + data + f"\r\n--{boundary}\r\n".encode() + after
            ).removesuffix(b"\r\n") + b"--\r\n"


def test_multipart_file_is_hashed_as_it_streams(monkeypatch):
    updates: list[int] = []
    monkeypatch.setattr(uploads, "sha256", lambda: SpySha256(updates))
    data = bytes(range(256)) * 1024  # 256 KiB
    body = _form(data)
    chunks = [body[i:i + 10_000] for i in range(0, len(body), 10_000)]
    seen: list[int] = []
    upload = run(uploads.read_image(_request(chunks, "multipart/form-data; boundary=b0undary", seen, updates)))
    assert upload.data == data
    assert upload.sha256 == hashlib.sha256(data).hexdigest()
    assert sum(updates) == len(data)
    # while the body streams in, the file read so far is hashed already: no spooling, no second pass
    assert all(seen[k] >= k - 1 for k in range(1, len(chunks)))


def test_multipart_reads_what_starlettes_form_parser_reads(photos):
    """A browser-like form (httpx's encoder: other fields around the file) gives the bytes Starlette's own
    `request.form()` (the reference parser) gives for field `file`."""
    import httpx

    data = photos["coffee.jpg"]
    req = httpx.Request("POST", "http://x/classify", data={"note": "a" * 5000, "top_k": "3"},
                        files={"file": ("coffee.jpg", data, "image/jpeg")})
    body, ctype = req.read(), req.headers["content-type"]
    chunks = [body[i:i + 7000] for i in range(0, len(body), 7000)]

    async def starlette_reads() -> bytes:
        form = await _request(chunks, ctype, [], []).form()
        return await form["file"].read()

    upload = run(uploads.read_image(_request(chunks, ctype, [], [])))
    assert upload.data == run(starlette_reads()) == data
    assert upload.sha256 == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize(("body", "status", "words"), [
    (_form(b"x" * 100).removesuffix(b"--\r\n"), 400, "closing boundary"),
    (_form(b"x" * 100)[:60], 400, "closing boundary"),
    (_form(b"x" * 100, after=b'Content-Disposition: form-data; name="other"; filename="y.jpg"\r\n\r\nyy'), 400,
     "Too many files"),
    (b'--b0undary\r\nContent-Disposition: form-data; name="file"\r\n\r\nnot a file\r\n--b0undary--\r\n', 422,
     "is missing"),
    (b'--b0undary\r\nContent-Disposition: form-data; name="file"; filename="a.txt"\r\nContent-Type: text/plain'
     b'\r\n\r\nhello\r\n--b0undary--\r\n', 415, "text/plain"),
    (b"--other\r\n\r\n", 400, "malformed multipart"),
])
def test_malformed_forms_are_refused_with_a_reason(body, status, words):
    from vit_serve.serve.errors import GatewayError

    with pytest.raises(GatewayError) as e:
        run(uploads.read_image(_request([body], "multipart/form-data; boundary=b0undary", [], [])))
    assert e.value.status == status and words in str(e.value), str(e.value)


def test_a_form_without_a_boundary_is_refused():
    from vit_serve.serve.errors import GatewayError

    with pytest.raises(GatewayError, match="no boundary") as e:
        run(uploads.read_image(_request([_form(b"x")], "multipart/form-data", [], [])))
    assert e.value.status == 400


@pytest.mark.parametrize("multipart", [False, True])
def test_routes_do_not_hash_the_body_again(monkeypatch, tiny_ckpt, photos, multipart):
    calls = []
    real = images.image_id

    def spy(data: bytes) -> str:
        calls.append(len(data))
        return real(data)

    monkeypatch.setattr(images, "image_id", spy)
    data = photos["chelsea.jpg"]
    kw = {"files": {"file": ("c.jpg", data, "image/jpeg")}} if multipart else {
        "content": data, "headers": {"Content-Type": "image/jpeg"}}

    async def scenario():
        async with serving(settings_for(tiny_ckpt)) as (client, _):
            return (await client.post("/classify", **kw),
                    await client.post("/explain?format=json", **kw))

    a, b = run(scenario())
    assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
    # One id for the same bytes and caller on both routes, and not the bytes' sha256 (ids are scoped to callers).
    assert a.json()["id"] == b.json()["id"] != hashlib.sha256(data).hexdigest()
    assert calls == []


def _encoded(fmt: str, mode: str = "RGB") -> bytes:
    """A 40x30 gradient written by Pillow's own `fmt` encoder."""
    from PIL import Image

    ramp = np.linspace(0, 255, 40 * 30 * 3).reshape(30, 40, 3).astype(np.uint8)
    img = Image.fromarray(ramp, "RGB").convert(mode)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


ACCEPTED = [("JPEG", "RGB"), ("PNG", "RGB"), ("WEBP", "RGB"), ("BMP", "RGB"), ("GIF", "P"), ("TIFF", "RGB"),
            ("PPM", "RGB"), ("PPM", "L"), ("PPM", "1")]  # PPM's plugin writes P6, P5 (PGM) and P4 (PBM)
REFUSED = ["EPS", "ICO", "TGA", "PCX"]


def test_uploads_outside_the_allowlist_are_415_naming_the_accepted_formats(tiny_ckpt):
    from PIL import Image

    from vit_serve.preprocess import ImageDecodeError, load_image

    accepted = {f"{fmt}/{mode}": _encoded(fmt, mode) for fmt, mode in ACCEPTED}
    refused = {fmt: _encoded(fmt) for fmt in REFUSED}
    assert {f: Image.open(io.BytesIO(d)).format for f, d in refused.items()} == {f: f for f in REFUSED}  # real files
    assert accepted["PPM/L"][:2] == b"P5" and accepted["PPM/1"][:2] == b"P4"

    async def scenario():
        async with serving(settings_for(tiny_ckpt)) as (client, _):
            ok = {k: await client.post("/classify", content=d, headers={"Content-Type": "image/x-anything"})
                  for k, d in accepted.items()}
            bad = {k: await client.post("/classify", content=d, headers={"Content-Type": "image/x-anything"})
                   for k, d in refused.items()}
            form = await client.post("/explain?format=json", files={"file": ("x.eps", refused["EPS"], "image/eps")})
            return ok, bad, form

    ok, bad, form = run(scenario())
    assert {k: r.status_code for k, r in ok.items()} == dict.fromkeys(accepted, 200), [r.text for r in ok.values()]
    assert {k: r.status_code for k, r in bad.items()} == dict.fromkeys(refused, 415), [r.text for r in bad.values()]
    assert form.status_code == 415
    message = bad["EPS"].json()["detail"]
    print(f"\nEPS upload: {message}")
    for name in ("JPEG", "PNG", "WebP", "BMP", "GIF", "TIFF", "PPM/PGM/PBM"):
        assert name in message
    # The library's decoder is the same allowlist (predict and training read files through it).
    with pytest.raises(ImageDecodeError, match="unsupported image format"):
        load_image(refused["EPS"])
