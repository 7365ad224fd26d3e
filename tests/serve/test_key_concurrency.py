"""The per-key cap on requests in flight (issue 38, point 3: `max_concurrent_per_key`): a key with the cap's number
of requests in flight gets 429 with Retry-After and a message for the next one, other keys are served, and the
key is served again once one of its requests is answered. Real concurrent requests on real sockets: uploads that
have sent their headers and half their body hold their key's slots, as a slow client's do; gRPC calls held in
the batcher hold theirs."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from gateway_helpers import live_app, metric, settings_for

ALICE, BOB = "alice-key-a81f", "bob-key-3c0e"
CAP = 2


def _held_upload(port: int, key: str, jpeg: bytes) -> socket.socket:
    """A POST /classify whose headers and first half of the body are sent; the rest is not (yet)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (f"POST /classify HTTP/1.1\r\nHost: 127.0.0.1\r\nX-API-Key: {key}\r\nContent-Type: image/jpeg\r\n"
            f"Content-Length: {len(jpeg)}\r\n\r\n").encode()
    s.sendall(head + jpeg[: len(jpeg) // 2])
    return s


def _finish(s: socket.socket, jpeg: bytes) -> bytes:
    """Send the rest of a held upload and read its answer's status line."""
    s.sendall(jpeg[len(jpeg) // 2:])
    answer = b""
    while b"\r\n" not in answer:
        chunk = s.recv(4096)
        if not chunk:
            break
        answer += chunk
    s.close()
    return answer.split(b"\r\n", 1)[0]


def test_a_key_with_the_cap_in_flight_gets_429_until_one_is_answered(tiny_ckpt, photos):
    jpeg = photos["coffee.jpg"]
    settings = settings_for(tiny_ckpt, api_keys=[ALICE, BOB], max_concurrent_per_key=CAP)
    with live_app(settings) as (url, app), httpx.Client(base_url=url, timeout=60) as c:
        port = int(url.rsplit(":", 1)[1])
        send = lambda key: c.post("/classify", content=jpeg, headers={"X-API-Key": key,  # noqa: E731
                                                                      "Content-Type": "image/jpeg"})
        assert send(ALICE).status_code == 200
        held = [_held_upload(port, ALICE, jpeg) for _ in range(CAP)]
        deadline = time.monotonic() + 15
        while app.state.keyring.in_flight.counts.total() < CAP and time.monotonic() < deadline:
            time.sleep(0.05)  # until the server has read both held requests' headers
        refused = send(ALICE)
        assert refused.status_code == 429, "a third request of the key was served while two were in flight"
        assert refused.headers["Retry-After"] == "1"
        assert "requests in flight" in refused.json()["detail"] and "max_concurrent_per_key" in refused.json()["detail"]
        assert send(BOB).status_code == 200  # another key is not held back
        assert _finish(held[0], jpeg).startswith(b"HTTP/1.1 200")
        assert send(ALICE).status_code == 200  # a slot is free again
        assert _finish(held[1], jpeg).startswith(b"HTTP/1.1 200")
        assert [send(ALICE).status_code for _ in range(CAP + 1)] == [200] * (CAP + 1)  # one at a time: never held
        text = c.get("/metrics", headers={"X-API-Key": BOB}).text  # /metrics needs a key
        assert metric(text, "vit_serve_key_requests_total", result="too_many_in_flight") >= 1


def test_zero_is_no_cap(tiny_ckpt, photos):
    jpeg = photos["coffee.jpg"]
    settings = settings_for(tiny_ckpt, api_keys=[ALICE], max_concurrent_per_key=0)
    with live_app(settings) as (url, _), httpx.Client(base_url=url, timeout=60) as c:
        port = int(url.rsplit(":", 1)[1])
        held = [_held_upload(port, ALICE, jpeg) for _ in range(3)]
        time.sleep(0.5)
        r = c.post("/classify", content=jpeg, headers={"X-API-Key": ALICE, "Content-Type": "image/jpeg"})
        assert r.status_code == 200
        assert all(_finish(s, jpeg).startswith(b"HTTP/1.1 200") for s in held)


def test_grpc_calls_beyond_the_cap_are_resource_exhausted(tiny_ckpt):
    import numpy as np

    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    settings = settings_for(tiny_ckpt, api_keys=[ALICE, BOB], grpc_port=0, max_concurrent_per_key=1)
    with live_app(settings) as (_, app):
        mv, ring = app.state.gateway.model(), app.state.keyring
        h, w = mv.info.resolution
        x = np.random.default_rng(0).standard_normal((1, 3, h, w)).astype(np.float32)
        inp = grpcclient.InferInput("pixel_values", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)

        def infer(key: str) -> str:
            with grpcclient.InferenceServerClient(app.state.grpc.address) as c:
                try:
                    c.infer("tiny", [inp], headers={"x-api-key": key}, client_timeout=60)
                    return "OK"
                except InferenceServerException as e:
                    return f"{str(e.status()).removeprefix('StatusCode.')}: {e.message()}"

        gate = threading.Event()
        mv.thread.submit(gate.wait)  # the model thread is busy: a call waits in the queue, in flight
        try:
            with ThreadPoolExecutor(1) as pool:
                first = pool.submit(infer, ALICE)
                deadline = time.monotonic() + 15
                while ring.in_flight.counts.total() < 1 and time.monotonic() < deadline:
                    time.sleep(0.05)
                second = infer(ALICE)
                assert second.startswith("RESOURCE_EXHAUSTED") and "requests in flight" in second, second
                gate.set()
                assert first.result(60) == "OK"
        finally:
            gate.set()
        assert infer(ALICE) == "OK" and ring.in_flight.counts.total() == 0
