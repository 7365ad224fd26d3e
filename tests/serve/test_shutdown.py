"""Graceful shutdown (vit_serve.serve.shutdown) with real servers and clients: SIGTERM to a `vit-serve serve`
under load answers every request it accepted, /readyz turns 503 before the listener closes; a queue still
waiting when the grace ends is answered 503 + Retry-After."""

from __future__ import annotations

import io
import itertools
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import tritonclient.grpc as grpcclient
import uvicorn
from gateway_helpers import settings_for, wait_ready
from PIL import Image

from vit_serve.serve.app import create_app
from vit_serve.serve.shutdown import DrainingServer, graceful_timeout
from vit_serve.tune.server_process import ServerExitedError, ServerProcess

CLIENTS = 20


def _png(i: int) -> bytes:
    """A unique small PNG (no two requests share an image)."""
    arr = np.random.default_rng(i).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


class Load:
    """CLIENTS clients, each sending unique images one at a time on a new connection (no keep-alive) until the
    load balancer stops sending (`stop`); every outcome is kept: a status, or "lost" (a connection that got no
    answer: reset, closed early, timed out) or "refused" (no connection at all)."""

    def __init__(self, url: str) -> None:
        self.url, self.outcomes, self._ids = url, [], itertools.count()
        self._lock = threading.Lock()
        self.retry_after: list[str | None] = []
        self.stop = threading.Event()

    def _record(self, send) -> object:
        try:
            r = send()
        except httpx.ConnectError:
            outcome = "refused"
        except httpx.HTTPError as e:
            outcome = f"lost: {type(e).__name__}: {e}"
        else:
            outcome = r.status_code
            if r.status_code == 503:
                with self._lock:
                    self.retry_after.append(r.headers.get("Retry-After"))
        with self._lock:
            self.outcomes.append(outcome)
        return outcome

    def client(self) -> None:
        with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=60,
                          headers={"Connection": "close"}) as c:
            while not self.stop.is_set():
                body = _png(next(self._ids))
                self._record(lambda body=body: c.post(f"{self.url}/classify", content=body,
                                            headers={"Content-Type": "image/png"}))

    def slow_upload(self, seconds: float) -> object:
        """One request whose body takes `seconds` to arrive (chunked): connected now, still sending when the
        listener closes."""
        body = _png(next(self._ids))

        def dribble():
            for i in range(0, len(body), len(body) // 10 + 1):
                yield body[i:i + len(body) // 10 + 1]
                time.sleep(seconds / 10)

        return self._record(lambda: httpx.post(f"{self.url}/classify", content=dribble(), timeout=60,
                                               headers={"Content-Type": "image/png", "Connection": "close"}))


def _watch_readyz(url: str, seen: list[tuple[float, int | str]], load: Load, lag: float) -> None:
    """Poll /readyz as a load balancer does until the listener is gone: (time, status or reason) of each answer,
    then (time, "closed"); `lag` s after the first "draining", the balancer stops sending (`load.stop`)."""
    while True:
        try:
            r = httpx.get(f"{url}/readyz", timeout=5, headers={"Connection": "close"})
            seen.append((time.monotonic(), r.status_code if r.status_code == 200 else r.json()["reason"]))
        except httpx.ConnectError:
            seen.append((time.monotonic(), "closed"))
            return
        except httpx.HTTPError as e:
            seen.append((time.monotonic(), f"lost: {e}"))
            return
        draining = [t for t, state in seen if state == "draining"]
        if draining and time.monotonic() - draining[0] >= lag:
            load.stop.set()
        time.sleep(0.02)


def test_sigterm_under_load_answers_every_accepted_request(tiny_ckpt):
    """Clients keep sending through the first half of the drain (a balancer's lag), and a few slow uploads are
    still sending when the listener closes: every request is answered (none reset), /readyz said "draining"
    before the listener closed, and the process exits 0.

    The balancer stops sending before the listener closes because a connection still in the kernel's accept
    queue when a listener closes is reset by the kernel: no server can answer it, and that is what the drain
    is for."""
    drain, grace = 1.5, 5.0
    env = {"VIT_SERVE_THREADS": "1", "VIT_SERVE_DECODE_WORKERS": "1", "OMP_NUM_THREADS": "1"}
    server = ServerProcess.serve([str(tiny_ckpt), "--max-batch", "2", "--shutdown-drain-s", str(drain),
                                  "--shutdown-grace-s", str(grace)], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
    proc, url = server.proc, server.url  # signalled and waited for here: the exit is what is tested
    # Its log read as it comes: two lines a request fill a pipe's 64 KB within the test, and a server writing to a
    # full pipe blocks its event loop (it stalled until the slow uploads' 60 s client timeout, twice in CI).
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        try:
            server.wait_ready(90)
        except (ServerExitedError, TimeoutError) as e:
            raise AssertionError("".join(lines)) from e
        load, seen = Load(url), []
        with ThreadPoolExecutor(CLIENTS + 4) as pool:
            clients = [pool.submit(load.client) for _ in range(CLIENTS)]
            while len(load.outcomes) < 3 * CLIENTS:  # under load before the signal
                time.sleep(0.02)
            before = len(load.outcomes)
            proc.send_signal(signal.SIGTERM)
            t_signal = time.monotonic()
            watcher = pool.submit(_watch_readyz, url, seen, load, drain / 2)
            while "draining" not in [s for _, s in seen]:
                time.sleep(0.01)
            slow = [pool.submit(load.slow_upload, drain + 0.8) for _ in range(3)]  # spans the listener's close
            for f in [*clients, watcher, *slow]:
                f.result(timeout=drain + grace + 60)
        proc.wait(timeout=drain + graceful_timeout(grace) + 30)
        t_exit = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=30)
    out = "".join(lines)
    assert proc.returncode == 0, out
    assert t_exit - t_signal < drain + graceful_timeout(grace) + 10, out  # bounded, not a timing measurement
    assert [o for o in load.outcomes if not isinstance(o, int)] == [], (load.outcomes, out)  # none lost
    assert set(load.outcomes) <= {200, 503}, load.outcomes
    assert [f.result() for f in slow] == [200] * 3  # connected before the close, answered after it
    assert load.outcomes.count(200) > before  # the server went on answering while it drained
    assert all(a is not None for a in load.retry_after)
    states = [s for _, s in seen]
    assert states[-1] == "closed" and "draining" in states, states  # 503 "draining", then the listener closed
    assert all(s == "draining" for s in states[:-1]), states
    assert "draining for 1.5 s" in out and "Application shutdown complete" in out


def test_requests_still_waiting_after_the_grace_get_503_with_retry_after(tiny_ckpt):
    """The model thread held by a gate: one batch runs (blocked), the rest wait; SIGTERM: gRPC ServerReady turns
    false, and when the grace is over the waiting ones are answered 503 + Retry-After; the running batch, let go,
    answers 200."""
    settings = settings_for(tiny_ckpt, max_batch=1, max_delay_ms=0, shutdown_drain_s=1.0, shutdown_grace_s=0.5,
                            grpc_port=0)
    app = create_app(settings)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = DrainingServer(uvicorn.Config(app, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=graceful_timeout(0.5)), app)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    gate = threading.Event()
    try:
        assert wait_ready(url, thread.is_alive)
        mv = app.state.gateway.model()
        mv.thread.submit(gate.wait)  # the model thread is busy until the gate opens
        n = 6
        with ThreadPoolExecutor(n) as pool:
            answers = [pool.submit(httpx.post, f"{url}/classify", content=_png(i), timeout=60,
                                   headers={"Content-Type": "image/png"}) for i in range(n)]
            deadline = time.monotonic() + 30
            while mv.runner.depth + mv.runner.running < n:  # one batch "running" (behind the gate), five waiting
                assert time.monotonic() < deadline, "the requests did not queue"
                time.sleep(0.01)
            grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{app.state.grpc.port}")
            assert grpc.is_server_ready()
            server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
            deadline = time.monotonic() + 30
            while grpc.is_server_ready():  # gRPC ServerReady turns false with /readyz
                assert time.monotonic() < deadline, "gRPC ServerReady stayed true"
                time.sleep(0.01)
            grpc.close()
            deadline = time.monotonic() + 30
            while sum(f.done() for f in answers) < n - 1:  # the five waiting ones answered
                assert time.monotonic() < deadline, "the waiting requests were not answered"
                time.sleep(0.01)
            gate.set()
            responses = [f.result(timeout=30) for f in answers]
        thread.join(30)
        assert not thread.is_alive()
    finally:
        gate.set()
        server.should_exit = True
        thread.join(15)
        sock.close()
    codes = sorted(r.status_code for r in responses)
    assert codes == [200] + [503] * (n - 1), codes
    for r in responses:
        if r.status_code == 503:
            assert r.headers["Retry-After"] == str(settings.limits.retry_after_s)
            assert "shutting down" in r.json()["detail"], r.text
