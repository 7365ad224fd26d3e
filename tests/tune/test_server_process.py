"""vit_serve.tune.server_process against real processes: a small HTTP server whose /readyz answers 200 after a
delay is waited for, answered and stopped (one ready at another path with an empty body, as tritonserver is,
once that path is named); a process that exits is reported with its status rather than waited out; one that
never gets ready times out; SIGTERM is escalated to SIGKILL after the grace period."""

from __future__ import annotations

import socket
import sys
import textwrap

import pytest

from vit_serve.tune.server_process import ServerExitedError, ServerProcess, free_port

READY_AFTER = textwrap.dedent("""
    import http.server, json, signal, sys, time
    ready_at = time.monotonic() + float(sys.argv[2])
    if sys.argv[3] == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            # "triton": ready at tritonserver's path, with its empty body
            path = "/v2/health/ready" if sys.argv[3] == "triton" else "/readyz"
            ok = self.path == path and time.monotonic() >= ready_at
            body = b"" if sys.argv[3] == "triton" else json.dumps({"status": "ready" if ok else "starting"}).encode()
            self.send_response(200 if ok else 503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
""")


def _server(delay: float, mode: str = "plain") -> ServerProcess:
    port = free_port()
    return ServerProcess.command([sys.executable, "-c", READY_AFTER, str(port), str(delay), mode], port)


def test_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_waits_until_ready_then_stops():
    with _server(0.5) as server:
        assert server.alive()
        assert server.ready() == {"status": "ready"}
        assert server.url == f"http://127.0.0.1:{server.port}"
    assert not server.alive()


def test_a_server_with_its_own_ready_path_and_an_empty_answer():
    server = _server(0.5, "triton")
    server.ready_timeout = 1.5
    with pytest.raises(TimeoutError), server:  # /readyz is not its readiness: never ready there
        pass
    server = _server(0.5, "triton")
    server.ready_path = "/v2/health/ready"
    with server:
        assert server.ready() == {}
    assert not server.alive()


def test_a_process_that_exits_is_reported_with_its_status():
    server = ServerProcess.command([sys.executable, "-c", "import sys; sys.exit(3)"], free_port())
    with pytest.raises(ServerExitedError, match="status 3"):
        server.wait_ready(60)


def test_not_ready_in_time_is_a_timeout_and_the_context_stops_it():
    server = _server(3600)
    server.ready_timeout = 0.5
    with pytest.raises(TimeoutError, match="not ready after"), server:
        pass
    assert not server.alive()


def test_stop_kills_a_server_that_ignores_sigterm():
    server = _server(0, "stubborn")
    server.wait_ready(60)
    assert server.stop(grace=0.5) == -9
