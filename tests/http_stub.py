"""A local HTTP server in a thread, for tests that need something on the other end of a URL: a page on another
origin, a stub gateway, a receiver of what a client posts, a server squatting on a port. The standard library's
`ThreadingHTTPServer`; `respond(request)` gives each answer, `requests` holds what arrived. The `http_stub`
fixture (tests/conftest.py) starts these and closes them after the test."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable
from dataclasses import dataclass
from email.message import Message

HOST = "127.0.0.1"


@dataclass(frozen=True)
class StubRequest:
    """One request as the stub received it (`headers` looks names up in any case)."""

    method: str
    path: str
    headers: Message
    body: bytes


# (status, Content-Type or "" for none, body)
Respond = Callable[[StubRequest], tuple[int, str, bytes]]


class HttpStub:
    """Serves GET and POST on `HOST:port` (a free one unless given) from a thread until `close()`; `url` is its
    address. A context manager too, for a fixture of a wider scope than a test's."""

    def __init__(self, respond: Respond, port: int = 0) -> None:
        self.requests: list[StubRequest] = []
        lock = threading.Lock()
        seen = self.requests

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                request = StubRequest(self.command, self.path, self.headers,
                                      self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                with lock:
                    seen.append(request)
                status, kind, body = respond(request)
                self.send_response(status)
                if kind:
                    self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._answer()

            def do_POST(self) -> None:
                self._answer()

            def log_message(self, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer((HOST, port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.port = self._server.server_address[1]
        self.url = f"http://{HOST}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> HttpStub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
