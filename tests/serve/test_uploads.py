"""Reading an upload (`vit_serve.serve.uploads.read_image`): the sha256 is updated chunk by chunk as the body
arrives, and equals hashlib's over the whole body; the routes use that digest instead of hashing again."""

from __future__ import annotations

import hashlib

import pytest
from gateway_helpers import run, serving, settings_for
from starlette.requests import Request

from vit_serve.serve import images, uploads


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


def test_multipart_file_is_hashed_in_chunks(monkeypatch):
    updates: list[int] = []
    monkeypatch.setattr(uploads, "sha256", lambda: SpySha256(updates))
    data = bytes(range(256)) * 1024  # 256 KiB: several reads of the spooled file
    boundary = "b0undary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x.jpg\"\r\n"
            f"Content-Type: image/jpeg\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    upload = run(uploads.read_image(_request([body], f"multipart/form-data; boundary={boundary}", [], updates)))
    assert upload.data == data
    assert upload.sha256 == hashlib.sha256(data).hexdigest()
    assert len(updates) == len(data) // uploads.CHUNK and sum(updates) == len(data)


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
    assert a.json()["id"] == b.json()["id"] == hashlib.sha256(data).hexdigest()
    assert calls == []
