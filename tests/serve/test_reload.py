"""Hot reload (`vit_serve.serve.repository`, `model_version`, `metrics`, `deps`): a version reloaded in place keeps
its gauges (the HPA scales on `vit_serve_queue_depth`); an unload waits at most `unload_grace_s` for the requests
still in flight, then answers them 503; and the version a request uses is chosen once its body is read, so that a
client uploading slowly does not keep a replaced version's weights alive.

References: the runner's own queue and batch (`runner.depth`, `runner.running`) for the gauges' values, the
repository index for what is loaded, a weakref for what is freed, and real model threads held busy through the
runner's `call` (no mock stands in for a runner or a backend)."""

from __future__ import annotations

import asyncio
import gc
import json
import shutil
import socket
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
from gateway_helpers import LABELS, RES, live_app, run, serving, settings_for

JPEG = {"Content-Type": "image/jpeg"}


def samples(text: str, name: str, **labels: str) -> list[float]:
    """The values of the samples `name` with exactly these labels, read by prometheus_client's own parser (an
    absent series is an empty list, not 0)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name and s.labels == labels]


async def until(what: str, ready: Callable[[], bool], timeout: float = 60.0) -> None:
    """Wait until `ready()` (a state of the server, polled), failing with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout:g} s: {what}")
        await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory, save_tiny) -> Path:
    """Other weights for the same model (same architecture, labels and contract)."""
    return save_tiny(tmp_path_factory.mktemp("new") / "new.safetensors", RES, 7, LABELS)


def _model_repo(root: Path, ckpt: Path) -> Path:
    """REPO with one model, vit, at version 1 (its weights at vit/1/w.safetensors)."""
    (root / "vit" / "1").mkdir(parents=True)
    shutil.copy(ckpt, root / "vit" / "1" / "w.safetensors")
    return root


def _rewrite(target: Path, source: Path) -> None:
    """Replace a file atomically (a poll sees the old one or the new one)."""
    staged = target.parent / f".{target.name}.tmp"
    shutil.copy(source, staged)
    staged.replace(target)


@pytest.mark.parametrize("control", ["poll", "explicit"])
def test_an_in_place_reload_keeps_the_versions_gauges(tmp_path, tiny_ckpt, new_weights, photos, control):
    """vit version 1 rewritten in place and reloaded (by the poll, or the repository API's load): once the old
    ModelVersion is closed, /metrics still has vit_serve_ready / queue_depth / inflight / memory of (vit, 1), with
    the new version's values; and the queue depth follows the new version's queue (3 requests, its model thread
    held: one in the batch, two waiting)."""
    repo = _model_repo(tmp_path / "repo", tiny_ckpt)
    mode = {"repository_poll_s": 0.2} if control == "poll" else {"load_models": ["vit"], "allow_any_key_admin": True}
    settings = settings_for(repo, model_control=control, max_batch=1, **mode)
    vit1 = {"model": "vit", "version": "1"}

    async def scenario():
        async with serving(settings) as (client, app):
            gateway = app.state.gateway
            old = gateway.model("vit")
            _rewrite(repo / "vit" / "1" / "w.safetensors", new_weights)
            if control == "explicit":
                load = await client.post("/v2/repository/models/vit/load")
                assert load.status_code == 200, load.text
            await until("the rewritten version switched in", lambda: gateway.model("vit") is not old)
            await old.wait_closed()  # the replaced ModelVersion is unloaded: its runner, thread and gauges
            new = gateway.model("vit")
            settled = (await client.get("/metrics")).text
            release = threading.Event()
            held = asyncio.ensure_future(new.runner.call(release.wait))  # the model thread is busy until released
            try:
                posts = [asyncio.create_task(client.post("/classify?model=vit", content=photos["coffee.jpg"],
                                                         headers=JPEG)) for _ in range(3)]
                await until("one request in the batch, two queued",
                            lambda: new.runner.running == 1 and new.runner.depth == 2)
                busy = (await client.get("/metrics")).text
                depth, running = new.runner.depth, new.runner.running
            finally:
                release.set()
            answers = await asyncio.gather(*posts)
            await held
            return settled, busy, depth, running, answers, new.memory_bytes

    settled, busy, depth, running, answers, memory = run(scenario())
    assert samples(settled, "vit_serve_ready", **vit1) == [1.0]
    assert samples(settled, "vit_serve_queue_depth", **vit1) == [0.0]
    assert samples(settled, "vit_serve_inflight_requests", **vit1) == [0.0]
    assert samples(settled, "vit_serve_model_memory_bytes", **vit1) == [float(memory)]
    assert samples(busy, "vit_serve_queue_depth", **vit1) == [float(depth)] == [2.0]
    assert samples(busy, "vit_serve_inflight_requests", **vit1) == [float(running)] == [1.0]
    assert [r.status_code for r in answers] == [200] * 3
    assert {r.json()["version"] for r in answers} == {"1"}


def test_an_unload_answers_the_requests_still_in_flight_503_after_the_grace(tmp_path, tiny_ckpt, photos):
    """--model-control explicit, unload_grace_s 0.5: a request whose batch waits for the model thread (held busy)
    when the model is unloaded is answered 503 once the grace is over (not left to the request timeout's 504),
    and the version is closed."""
    repo = _model_repo(tmp_path / "repo", tiny_ckpt)
    settings = settings_for(repo, model_control="explicit", load_models=["vit"], allow_any_key_admin=True,
                            max_batch=1, unload_grace_s=0.5, request_timeout_s=20)

    async def scenario():
        async with serving(settings) as (client, app):
            mv = app.state.gateway.model("vit")
            release = threading.Event()
            held = asyncio.ensure_future(mv.runner.call(release.wait))
            try:
                post = asyncio.create_task(client.post("/classify?model=vit", content=photos["coffee.jpg"],
                                                       headers=JPEG))
                await until("the request in a batch, waiting for the model thread", lambda: mv.runner.running == 1)
                unload = await client.post("/v2/repository/models/vit/unload")
                answer = await post
                assert answer.status_code == 503, (answer.status_code, answer.text)
                await mv.wait_closed()
                index = (await client.post("/v2/repository/index")).json()
            finally:
                release.set()
            await held
            return unload, answer, index

    unload, answer, index = run(scenario())
    assert unload.status_code == 200
    assert "vit version 1 was unloaded" in answer.json()["detail"]
    assert "0.5 s" in answer.json()["detail"] and answer.headers["Retry-After"] == "1"
    assert [(r["name"], r["version"], r["state"]) for r in index] == [("vit", "1", "UNAVAILABLE")]


def _open(url: str, path: str, body: bytes, content_type: str) -> socket.socket:
    """A raw HTTP/1.1 request with its headers and the first half of its body sent (the rest: `_finish`)."""
    host = urlsplit(url)
    sock = socket.create_connection((host.hostname, host.port), timeout=120)
    head = (f"POST {path} HTTP/1.1\r\nHost: {host.netloc}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    sock.sendall(head + body[:len(body) // 2])
    return sock


def _finish(sock: socket.socket, body: bytes) -> tuple[int, dict]:
    """Send the rest of the body; the answer's status and JSON body (the server closes: Connection: close)."""
    sock.sendall(body[len(body) // 2:])
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    head, _, content = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(content)


def test_a_trickled_upload_does_not_pin_the_version_it_started_on(tmp_path, tiny_ckpt, new_weights, photos):
    """A real uvicorn with --model-control poll. Four clients send half of their bodies (POST /classify, /embed,
    /explain, /v2/models/vit/infer) and stop; version 2 is dropped in. Version 1 is unloaded, and its backend
    freed, while the bodies are still coming (unload_grace_s is far longer than the test: nothing waits it out);
    then the bodies are finished and version 2 answers all four."""
    repo = _model_repo(tmp_path / "repo", tiny_ckpt)
    settings = settings_for(repo, model_control="poll", repository_poll_s=0.2, unload_grace_s=600)
    pixels = np.random.default_rng(0).normal(size=(1, 3, *RES)).astype(np.float32)
    v2_body = json.dumps({"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": list(pixels.shape),
                                      "data": pixels.ravel().tolist()}]}).encode()
    photo = photos["chelsea.jpg"]
    requests = {"/classify?top_k=1": (photo, "image/jpeg"), "/embed": (photo, "image/jpeg"),
                "/explain?format=json": (photo, "image/jpeg"), "/v2/models/vit/infer": (v2_body, "application/json")}

    def index(url: str) -> dict[str, str]:
        return {r["version"]: r["state"] for r in httpx.post(f"{url}/v2/repository/index").json()}

    async def wait(what: str, ready: Callable[[], bool]) -> None:
        await until(what, ready, timeout=90)

    with live_app(settings) as (url, app):
        gateway = app.state.gateway
        v1_backend = weakref.ref(gateway.model("vit").backend)
        socks = {path: _open(url, path, body, ctype) for path, (body, ctype) in requests.items()}
        try:
            # every request reached its route and is announced to version 1's batcher, its body half read
            asyncio.run(wait("four uploads under way", lambda: gateway.model("vit").runner.incoming == 4))
            staging = repo / "vit" / ".staging2"
            staging.mkdir()
            shutil.copy(new_weights, staging / "w.safetensors")
            staging.rename(repo / "vit" / "2")
            asyncio.run(wait("version 2 in service and version 1 unloaded, the uploads unfinished",
                             lambda: index(url) == {"1": "UNAVAILABLE", "2": "READY"}))
            gc.collect()
            assert v1_backend() is None, "version 1's backend is still alive"
        finally:
            answers = {path: _finish(sock, requests[path][0]) for path, sock in socks.items()}
    for path, (status, body) in answers.items():
        assert status == 200, (path, status, body)
        assert body.get("version", body.get("model_version")) == "2", (path, body)

