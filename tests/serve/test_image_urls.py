"""The image-URL fetcher's SSRF guard and bounds (vit_serve.serve.image_urls), against real HTTP servers on this
machine's loopback (http.server in a thread, counting the requests that reach them): a host allowed by name that
resolves to 127.0.0.1 is refused before any connection; literal loopback, link-local, private and unspecified
addresses are refused even when allowed by name; a redirect is checked as the first URL; with the loopback
network named by the operator the same server is fetched, within the size cap and the timeout."""

from __future__ import annotations

import asyncio
import base64
import http.server
import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from gateway_helpers import serving, settings_for

from vit_serve.serve.errors import TooLargeError
from vit_serve.serve.image_urls import UrlPolicy, UrlRefusedError, fetch
from vit_serve.serve.settings import SecuritySettings

BODY = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 40  # what the server answers at /img.png (10 KiB and a bit)
LOOPBACK = ("127.0.0.0/8",)


class Server:
    """A real HTTP server on `host` (a thread): /img.png, /slow (answers after 2 s), /big (no Content-Length),
    /missing (404), /to?url=U (302 to U), `body` at any other path; `hits` counts the requests that reached it."""

    def __init__(self, host: str = "127.0.0.1", body: bytes = BODY) -> None:
        self.hits: list[str] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def do_GET(self) -> None:
                owner.hits.append(self.path)
                if self.path.startswith("/to?url="):
                    self.send_response(302)
                    self.send_header("Location", self.path[len("/to?url="):])
                    self.end_headers()
                    return
                if self.path == "/missing":
                    self.send_error(404)
                    return
                if self.path == "/slow":
                    time.sleep(2)
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                if self.path != "/big":
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@contextmanager
def server(host: str = "127.0.0.1") -> Iterator[Server]:
    with Server(host) as s:
        yield s


def _policy(hosts=("localhost",), networks=(), **kw) -> UrlPolicy:
    return UrlPolicy.of(SecuritySettings(image_url_hosts=list(hosts), image_url_networks=list(networks), **kw))


def _fetch(url: str, policy: UrlPolicy) -> bytes:
    return asyncio.run(fetch(url, policy, "input[0]"))


def test_off_by_default_and_only_http():
    assert not UrlPolicy.of(SecuritySettings()).on
    with server() as s:
        with pytest.raises(UrlRefusedError, match="fetches no image URLs"):
            _fetch(f"http://localhost:{s.port}/img.png", UrlPolicy.of(SecuritySettings()))
        for url in ("file:///etc/passwd", f"ftp://localhost:{s.port}/img.png", "gopher://localhost/"):
            with pytest.raises(UrlRefusedError, match="only http"):
                _fetch(url, _policy(networks=LOOPBACK))
        with pytest.raises(UrlRefusedError, match="not one this gateway fetches"):
            _fetch(f"http://127.0.0.1:{s.port}/img.png", _policy(networks=LOOPBACK))  # allowed: localhost only
        with pytest.raises(UrlRefusedError, match="without credentials"):
            _fetch(f"http://user:pw@localhost:{s.port}/img.png", _policy(networks=LOOPBACK))
        assert s.hits == []


def test_a_host_allowed_by_name_that_resolves_to_loopback_is_refused_before_connecting():
    with server() as s:
        with pytest.raises(UrlRefusedError, match=r"'localhost' resolves to .*loopback") as e:
            _fetch(f"http://localhost:{s.port}/img.png", _policy())
        assert "input[0]" in str(e.value)
        assert s.hits == []  # refused after DNS resolution, before any connection


@pytest.mark.parametrize(("host", "range_"), [
    ("127.0.0.1", "loopback"), ("127.8.9.10", "loopback"), ("[::1]", "loopback"), ("0.0.0.0", "unspecified"),
    ("169.254.169.254", "link-local"), ("[fe80::1]", "link-local"), ("10.1.2.3", "private"),
    ("172.16.5.4", "private"), ("172.31.255.255", "private"), ("192.168.1.1", "private"), ("[fd00::1]", "private"),
    ("[::ffff:127.0.0.1]", "loopback"), ("100.64.0.1", "carrier-grade"), ("224.0.0.1", "not a public"),
])
def test_non_public_addresses_are_refused_even_when_allowed_by_name(host, range_):
    with pytest.raises(UrlRefusedError, match=range_):
        _fetch(f"http://{host}/img.png", _policy(hosts=(host.strip("[]"),)))


def test_an_allowed_network_is_fetched_within_the_size_cap_and_the_timeout():
    with server() as s:
        assert _fetch(f"http://localhost:{s.port}/img.png", _policy(networks=LOOPBACK)) == BODY
        assert _fetch(f"http://localhost:{s.port}/big", _policy(networks=LOOPBACK)) == BODY
        assert s.hits == ["/img.png", "/big"]
        for path in ("/img.png", "/big"):  # said by Content-Length, or counted as it comes
            with pytest.raises(TooLargeError, match="image_url_max_bytes"):
                _fetch(f"http://localhost:{s.port}{path}", _policy(networks=LOOPBACK, image_url_max_bytes=4096))
        t0 = time.perf_counter()
        with pytest.raises(UrlRefusedError, match=r"within 0\.3 s"):
            _fetch(f"http://localhost:{s.port}/slow", _policy(networks=LOOPBACK, image_url_timeout_s=0.3))
        assert time.perf_counter() - t0 < 1.5
        with pytest.raises(UrlRefusedError, match="answered HTTP 404"):
            _fetch(f"http://localhost:{s.port}/missing", _policy(networks=LOOPBACK))
        # a wildcard allows subdomains, not the bare name
        assert _policy(hosts=("*.example.com",)).allows_host("img.example.com")
        assert not _policy(hosts=("*.example.com",)).allows_host("example.com")
        assert not _policy(hosts=("*.example.com",)).allows_host("badexample.com")


def test_every_redirect_is_checked_as_the_first_url():
    with server() as first, server("127.0.0.2") as second:
        policy = _policy(hosts=("localhost", "127.0.0.2"), networks=("127.0.0.1/32",))
        # allowed by name, but it resolves to an address the operator did not open: refused, never reached
        with pytest.raises(UrlRefusedError, match=r"'127\.0\.0\.2' resolves to .*loopback"):
            _fetch(f"http://localhost:{first.port}/to?url=http://127.0.0.2:{second.port}/img.png", policy)
        with pytest.raises(UrlRefusedError, match=r"'evil\.example' is not one"):
            _fetch(f"http://localhost:{first.port}/to?url=http://evil.example/img.png", policy)
        with pytest.raises(UrlRefusedError, match=r"169\.254\.169\.254"):
            _fetch(f"http://localhost:{first.port}/to?url=http://169.254.169.254/latest/meta-data/",
                   _policy(hosts=("localhost", "169.254.169.254"), networks=("127.0.0.1/32",)))
        assert second.hits == []
        assert _fetch(f"http://localhost:{first.port}/to?url=/img.png", policy) == BODY  # a relative one, allowed
        hop = f"http://localhost:{first.port}/to?url="
        with pytest.raises(UrlRefusedError, match="more than 5 redirects"):
            _fetch(hop * 6 + f"http://localhost:{first.port}/img.png", policy)
        assert _fetch(hop * 5 + f"http://localhost:{first.port}/img.png", policy) == BODY


def test_v1_embeddings_fetches_an_allowed_url_and_refuses_loopback_by_name(tiny_ckpt, photos):
    """POST /v1/embeddings with a Jina-style {"image": URL}: off by default; allowed by name but resolving to
    loopback, refused in OpenAI's error shape before any connection; with the loopback network opened by the
    operator, fetched, and its vector that of the same image sent as a data URI."""
    png = photos["astronaut.png"]
    data_uri = "data:image/png;base64," + base64.b64encode(png).decode()

    async def ask(client, item) -> tuple[int, dict]:
        r = await client.post("/v1/embeddings", json={"model": "tiny", "input": [item], "encoding_format": "float"})
        return r.status_code, r.json()

    async def go(photo: Server) -> None:
        url = {"image": f"http://localhost:{photo.port}/astronaut.png"}
        for kw, status, words in (({}, 400, "image_url_hosts"),
                                  ({"image_url_hosts": ["localhost"]}, 400, "loopback")):
            async with serving(settings_for(tiny_ckpt, **kw)) as (client, _):
                code, body = await ask(client, url)
                assert code == status and words in body["error"]["message"], body
                assert body["error"]["param"] == "input"  # one item: OpenAI names it input
        assert photo.hits == []
        opened = settings_for(tiny_ckpt, image_url_hosts=["localhost"], image_url_networks=["127.0.0.0/8"])
        async with serving(opened) as (client, _):
            code, fetched = await ask(client, url)
            assert code == 200, fetched
            _, sent = await ask(client, data_uri)
        assert photo.hits == ["/astronaut.png"]
        assert fetched["data"][0]["embedding"] == sent["data"][0]["embedding"]

    with Server(body=png) as photo:
        asyncio.run(go(photo))


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no `openssl` on PATH to make a certificate")
def test_https_goes_to_the_checked_address_with_the_hosts_name_and_verifies_its_certificate(tmp_path):
    """https://localhost:PORT: the connection goes to the address checked (127.0.0.1), the TLS name sent is the
    URL's host (SNI "localhost"), and the certificate is verified (a self-signed one is refused, never read)."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True)
    names: list[str | None] = []
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    context.sni_callback = lambda sock, name, ctx: names.append(name)
    with server() as s:
        s.httpd.socket = context.wrap_socket(s.httpd.socket, server_side=True, do_handshake_on_connect=False)
        with pytest.raises(UrlRefusedError, match="the fetch failed"):
            _fetch(f"https://localhost:{s.port}/img.png", _policy(networks=("127.0.0.1/32",)))
        deadline = time.monotonic() + 5
        while not names and time.monotonic() < deadline:
            time.sleep(0.05)
        assert names == ["localhost"] and s.hits == []
