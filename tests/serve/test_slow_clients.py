"""Slow clients against the gateway under a real uvicorn (`app.server_config`, as `vit-serve serve` starts it), with
raw sockets as a slowloris uses them: headers trickled or never finished are cut off (header timeout), a body that
stalls or trickles gets 408 (body deadline), connections beyond the cap get 503, uploads that stall are no work
ahead for the batcher (requests with a deadline are not refused for them), and a client that half-closes after a
complete request gets its answer, while one that closed its socket is still a hang-up.

Deadlines in the settings are short so that the tests do not wait long; the socket timeouts below only keep a
broken server from hanging the test, nothing asserts how fast anything happened."""

from __future__ import annotations

import asyncio
import io
import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
from gateway_helpers import LABELS, settings_for, wait_ready
from held_model import Gate
from PIL import Image

BOUND_S = 30.0  # no test waits longer than this for the server to act (a broken server fails, it does not hang)
STALLED_S = 1.0  # longer than the runner's STALL_S (0.25 s): an upload silent this long has stalled


@contextmanager
def guarded(settings, http: str = "auto") -> Iterator[tuple[int, object]]:
    """The gateway under a real uvicorn in a thread, configured as `vit-serve serve` configures it
    (`server_config`), on a free port: yields (port, app) once /readyz is 200. `http`: "h11" for uvicorn's other
    HTTP implementation (the guards over h11's protocol)."""
    import uvicorn

    from vit_serve.serve.app import create_app, server_config

    app = create_app(settings)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = server_config(app, settings, log_level="warning", lifespan="on")
    if http == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol

        from vit_serve.serve.slow_clients import http_protocol

        config.http = http_protocol(settings.header_timeout_s, settings.max_connections, H11Protocol)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        if not wait_ready(f"http://127.0.0.1:{port}", thread.is_alive):
            raise RuntimeError("the test server did not become ready")
        yield port, app
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
    return sock


def head(path: str, length: int, content_type: str = "image/jpeg", extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: gateway\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed this connection (EOF or reset), waiting for it at most BOUND_S."""
    try:
        return sock.recv(65536) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """The final answer on this connection (interim 1xx answers skipped): status, headers, body (by its
    Content-Length)."""
    data = b""
    while True:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                raise AssertionError(f"the connection closed before an answer: {data!r}")
            data += chunk
        top, data = data.split(b"\r\n\r\n", 1)
        lines = top.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        if status >= 200:
            break
    length = int(headers["content-length"])
    while len(data) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError("the connection closed inside the answer's body")
        data += chunk
    return status, headers, data[:length]


def jpeg(size: tuple[int, int], seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


# ---- a gateway with short deadlines ------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["auto", "h11"])
def short(tiny_ckpt, request) -> Iterator[tuple[int, object]]:
    """Header timeout 0.5 s, body deadline 1 s; over uvicorn's httptools protocol (its "auto") and its h11 one."""
    with guarded(settings_for(tiny_ckpt, header_timeout_s=0.5, body_timeout_s=1.0, max_batch=4,
                              request_timeout_s=60), request.param) as served:
        yield served


def test_a_connection_that_never_finishes_its_headers_is_closed(short):
    port, _ = short
    with connect(port) as sock:
        sock.sendall(b"POST /classify HTTP/1.1\r\nHost: gateway\r\n")
        assert closed_by_server(sock)
    with connect(port) as sock:  # nothing at all
        assert closed_by_server(sock)


def test_a_connection_trickling_its_headers_is_closed(short):
    """A byte of header every 50 ms: each keeps the connection busy, none completes the headers."""
    port, _ = short
    with connect(port) as sock:
        sock.sendall(b"POST /classify HTTP/1.1\r\nHost: gateway\r\nX-Padding: ")
        closed = False
        until = time.monotonic() + BOUND_S
        while not closed and time.monotonic() < until:
            try:
                sock.sendall(b"a")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            if select.select([sock], [], [], 0.05)[0]:
                closed = closed_by_server(sock)
        assert closed


@pytest.mark.parametrize("path", ["/classify", "/v2/models/tiny/infer"])
def test_an_upload_that_stalls_gets_408_and_is_closed(short, path):
    port, _ = short
    with connect(port) as sock:
        sock.sendall(head(path, 1000, "image/jpeg" if path == "/classify" else "application/json") + b"\xff\xd8xx")
        status, headers, body = read_answer(sock)
        assert status == 408
        message = json.loads(body)["detail" if path == "/classify" else "error"]
        assert "VIT_SERVE_BODY_TIMEOUT_S" in message
        assert headers["connection"] == "close"
        assert closed_by_server(sock)


def test_an_upload_trickling_a_byte_now_and_then_gets_408(short):
    """Each byte comes well within the deadline of the one before; the whole body does not."""
    port, _ = short
    with connect(port) as sock:
        sock.sendall(head("/classify", 100_000))
        answer = None
        for _ in range(int(BOUND_S / 0.05)):
            try:
                sock.sendall(b"x")
            except (BrokenPipeError, ConnectionResetError):
                break
            if select.select([sock], [], [], 0.05)[0]:
                answer = read_answer(sock)
                break
        assert answer is not None and answer[0] == 408


def test_a_normal_request_is_answered(short, photos):
    """The guards leave a normal client alone (keep-alive: two requests on one connection)."""
    port, _ = short
    image = photos["coffee.jpg"]
    with connect(port) as sock:
        for _ in range(2):
            sock.sendall(head("/classify", len(image)) + image)
            status, _, body = read_answer(sock)
            assert status == 200
            assert json.loads(body)["predictions"][0]["label"] in LABELS


def test_a_client_that_half_closes_after_its_request_gets_the_answer(short, photos):
    """shutdown(SHUT_WR) once the request is sent (as `nc -N` does) is no hang-up: the answer comes, then the
    server closes. The request waits in the queue (the model held) while the EOF arrives."""
    port, app = short
    mv = app.state.gateway.model()
    image = photos["coffee.jpg"]
    gate = Gate(mv)
    gate.close()
    try:
        with connect(port) as sock:
            sock.sendall(head("/classify", len(image)) + image)
            sock.shutdown(socket.SHUT_WR)
            time.sleep(STALLED_S)  # the EOF reaches the server while the request waits
            gate.open()
            status, _, body = read_answer(sock)
            assert status == 200
            assert json.loads(body)["predictions"][0]["label"] in LABELS
            assert closed_by_server(sock)
    finally:
        gate.open()


def test_a_client_that_closes_after_its_request_is_still_a_hang_up(short, photos):
    """A socket closed entirely sends the same EOF as a half-close; it is still told apart: the request leaves
    the queue unrun (hangup), and the request behind it is answered."""
    port, app = short
    mv = app.state.gateway.model()
    image = photos["coffee.jpg"]
    gate = Gate(mv)
    gate.close()

    async def scenario() -> int:
        async with httpx.AsyncClient(timeout=BOUND_S) as client:
            url = f"http://127.0.0.1:{port}/classify"
            keeper = asyncio.create_task(client.post(url, content=image, headers={"Content-Type": "image/jpeg"}))
            await _until(lambda: mv.runner.running == 1)
            with connect(port) as sock:
                sock.sendall(head("/classify", len(image)) + image)
                await _until(lambda: mv.runner.depth == 1)
            await _until(lambda: mv.runner.depth == 0)  # it left the queue: its client is gone
            gate.open()
            return (await keeper).status_code

    try:
        assert asyncio.run(scenario()) == 200
    finally:
        gate.open()


async def _until(predicate, timeout: float = BOUND_S) -> None:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


# ---- the connection cap -----------------------------------------------------------------------------------

def test_connections_beyond_the_cap_get_503(tiny_ckpt, photos):
    image = photos["coffee.jpg"]
    with guarded(settings_for(tiny_ckpt, max_connections=4, header_timeout_s=BOUND_S)) as (port, _):
        idle = [connect(port) for _ in range(4)]
        try:
            for sock in idle:
                sock.sendall(b"GET /healthz HTTP/1.1\r\n")  # headers not finished: each holds a connection
            with connect(port) as sock:
                sock.sendall(head("/classify", len(image)) + image)
                status, headers, body = read_answer(sock)
            assert status == 503
            assert headers["retry-after"] == "1"
            assert "VIT_SERVE_MAX_CONNECTIONS" in json.loads(body)["detail"]
        finally:
            for sock in idle:
                sock.close()
        for _ in range(int(BOUND_S / 0.05)):  # once they have gone, requests are served again
            with connect(port) as sock:
                sock.sendall(head("/classify", len(image)) + image)
                status, _, _ = read_answer(sock)
            if status == 200:
                break
            time.sleep(0.05)
        assert status == 200


# ---- stalled uploads and the batcher ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def slow_ckpt(save_tiny, tmp_path_factory) -> Path:
    """The tiny 2-block Ti/16 at 224 x 224: a few milliseconds an image, so that 200 images of work ahead are
    far beyond the deadline below, and one image far within it."""
    return save_tiny(tmp_path_factory.mktemp("slow") / "slow.safetensors", (224, 224), 3, LABELS)


def test_stalled_uploads_are_no_work_ahead_for_deadlines(slow_ckpt):
    """200 uploads send their headers and 4 bytes and stall (the body deadline is long: they stay open, announced
    to the batcher). Normal requests with a deadline, four at a time, are then all answered 200: the stalled
    uploads neither count as work ahead of them (504 before they are read) nor make batches wait."""
    image = jpeg((224, 224))
    settings = settings_for(slow_ckpt, max_batch=1, body_timeout_s=BOUND_S * 4, max_connections=1000,
                            request_timeout_s=60)
    with guarded(settings) as (port, app):
        runner = app.state.gateway.model().runner
        url = f"http://127.0.0.1:{port}/classify"

        async def normal(client: httpx.AsyncClient, n: int, timeout_ms: float | None) -> list[int]:
            params = {} if timeout_ms is None else {"timeout_ms": timeout_ms}
            codes = []
            for _ in range(n):
                r = await client.post(url, content=image, headers={"Content-Type": "image/jpeg"}, params=params)
                codes.append(r.status_code)
            return codes

        async def traffic(timeout_ms: float | None) -> list[int]:
            async with httpx.AsyncClient(timeout=BOUND_S) as client:
                runs = await asyncio.gather(*(normal(client, 10, timeout_ms) for _ in range(4)))
            return [code for run in runs for code in run]

        assert set(asyncio.run(traffic(None))) == {200}  # the batcher learns the model's time per image
        stalled = []
        try:
            for _ in range(200):
                sock = connect(port)
                sock.sendall(head("/classify", len(image)) + image[:4])
                stalled.append(sock)
            for _ in range(int(BOUND_S / 0.05)):
                if runner.incoming == 200:
                    break
                time.sleep(0.05)
            assert runner.incoming == 200  # every one is being read
            assert runner.coming() <= 1  # of which at most max_batch x instances count as coming
            time.sleep(STALLED_S)
            assert runner.coming() == 0  # and none once they have stalled
            codes = asyncio.run(traffic(1000))
        finally:
            for sock in stalled:
                sock.close()
        assert codes == [200] * 40
