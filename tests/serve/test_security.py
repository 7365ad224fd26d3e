"""Who may call the gateway (`vit_serve.serve.security`), request ids, CORS and TLS: API keys over headers (httpx
and tritonclient's own HTTP client), admin keys on the repository API, a real browser's CORS preflight
(Debian's chromium through Playwright), and a TLS handshake with a self-signed certificate made by `openssl`."""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
import threading

import httpx
import pytest
from gateway_helpers import live_server, metric, run, serving, settings_for

from vit_serve.tune.server_process import free_port

KEY, ADMIN = "k-3f9a1c", "admin-77e2b0"
JPEG = {"Content-Type": "image/jpeg"}


def _statuses(settings, calls) -> list[httpx.Response]:
    async def scenario():
        async with serving(settings) as (client, _):
            return [await client.request(method, path, **kw) for method, path, kw in calls]

    return run(scenario())


def test_a_key_is_needed_and_probes_stay_open(tiny_ckpt, photos):
    jpeg = photos["coffee.jpg"]
    calls = [("POST", "/classify", {"content": jpeg, "headers": JPEG}),
             ("POST", "/classify", {"content": jpeg, "headers": {**JPEG, "Authorization": f"Bearer {KEY}"}}),
             ("POST", "/classify", {"content": jpeg, "headers": {**JPEG, "X-API-Key": KEY}}),
             ("POST", "/classify", {"content": jpeg, "headers": {**JPEG, "X-API-Key": "wrong"}}),
             ("POST", "/classify", {"content": jpeg, "headers": {**JPEG, "Authorization": f"Basic {KEY}"}}),
             ("GET", "/v2/models/tiny", {}),
             ("GET", "/models", {}),
             ("GET", "/healthz", {}), ("GET", "/readyz", {}), ("GET", "/metrics", {"headers": {"X-API-Key": KEY}}),
             ("GET", "/v2/health/ready", {}), ("GET", "/", {}), ("GET", "/openapi.json", {}),
             ("GET", "/metrics", {})]  # every key's name and traffic: not a probe (metrics_port serves scrapers)
    r = _statuses(settings_for(tiny_ckpt, api_keys=[KEY]), calls)
    assert [x.status_code for x in r] == [401, 200, 200, 401, 401, 401, 401, 200, 200, 200, 200, 200, 200, 401]
    assert r[0].headers["www-authenticate"] == 'Bearer realm="vit-serve"'
    assert "an API key is needed" in r[0].json()["detail"] and "not valid" in r[3].json()["detail"]
    assert "error" in r[5].json()  # /v2 answers its own error shape
    # The refused requests are counted too (before routing: endpoint "unmatched"), the accepted by route.
    assert metric(r[9].text, "vit_serve_requests_total", status="401") == 5
    assert metric(r[9].text, "vit_serve_requests_total", endpoint="/classify", status="200") == 2
    closed = _statuses(settings_for(tiny_ckpt, api_keys=[KEY], open_probes=False),
                       [("GET", p, {}) for p in ("/healthz", "/readyz", "/metrics", "/v2/health/live")])
    assert [x.status_code for x in closed] == [401] * 4


def test_keys_are_kept_as_hashes_read_from_files_and_never_logged(tiny_ckpt, photos, tmp_path, caplog):
    from vit_serve.serve.settings import ServeSettings

    hashed = "sha256:" + hashlib.sha256(KEY.encode()).hexdigest()
    s = ServeSettings(model=str(tiny_ckpt), api_keys=[KEY, "other"])
    assert s.security.api_keys[0] == hashed and KEY not in s.model_dump_json()
    assert ServeSettings(model="m.onnx", api_keys=[hashed]).security.api_keys == [hashed]  # a hash is kept as given
    keys = tmp_path / "keys.txt"
    keys.write_text(f"# the gateway's keys\n\n{hashed}\n")  # the file may hold hashes only
    caplog.set_level(logging.DEBUG)
    r = _statuses(settings_for(tiny_ckpt, api_keys_file=str(keys)),
                  [("POST", "/classify", {"content": photos["coffee.jpg"], "headers": {**JPEG, "X-API-Key": KEY}}),
                   ("POST", "/classify", {"content": photos["coffee.jpg"], "headers": {**JPEG, "X-API-Key": "x"}})])
    assert [x.status_code for x in r] == [200, 401]
    assert KEY not in caplog.text and hashed not in caplog.text


def test_admin_keys_guard_load_and_unload(tiny_ckpt):
    calls = [("POST", "/v2/repository/models/tiny/unload", {"headers": {"X-API-Key": KEY}}),
             ("POST", "/v2/repository/models/tiny/unload", {"headers": {"X-API-Key": ADMIN}}),
             ("POST", "/v2/repository/models/tiny/load", {"headers": {"X-API-Key": ADMIN}}),
             ("POST", "/v2/repository/index", {"headers": {"X-API-Key": KEY}})]
    folder = tiny_ckpt.parent  # a folder repository: load / unload are allowed with explicit model control
    r = _statuses(settings_for(folder, api_keys=[KEY], admin_api_keys=[ADMIN], model_control="explicit",
                               load_models=["tiny"]), calls)
    assert [x.status_code for x in r] == [403, 200, 200, 200], [x.text for x in r]
    assert "admin key" in r[0].json()["error"]


def test_tritonclient_sends_its_key_as_a_header(tiny_ckpt):
    import numpy as np
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    with live_server(settings_for(tiny_ckpt, api_keys=[KEY])) as url:
        client = httpclient.InferenceServerClient(url.removeprefix("http://"))
        x = np.zeros((1, 3, 32, 48), np.float32)
        inp = httpclient.InferInput("pixel_values", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        assert client.infer("tiny", [inp], headers={"Authorization": f"Bearer {KEY}"}).as_numpy("logits").shape \
            == (1, 10)
        with pytest.raises(InferenceServerException, match="API key"):
            client.infer("tiny", [inp])
        assert client.is_server_live()  # probes: no key


def test_request_ids_are_echoed_made_and_logged(tiny_ckpt, caplog):
    caplog.set_level(logging.INFO, logger="vit_serve.serve.access")
    r = _statuses(settings_for(tiny_ckpt), [("GET", "/healthz", {"headers": {"X-Request-ID": "abc-123"}}),
                                            ("GET", "/healthz", {}),
                                            ("GET", "/healthz", {"headers": {"X-Request-ID": "bad id\twith tab"}})])
    assert r[0].headers["x-request-id"] == "abc-123"
    made = r[1].headers["x-request-id"]
    assert len(made) == 32 and int(made, 16) >= 0
    assert r[2].headers["x-request-id"] != "bad id\twith tab"
    assert "abc-123 GET /healthz 200" in caplog.text and f"{made} GET /healthz 200" in caplog.text


def test_cors_preflight_answers_only_the_allowed_origins(tiny_ckpt):
    origin = "http://app.example"
    headers = {"Origin": origin, "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "x-api-key, content-type"}
    r = _statuses(settings_for(tiny_ckpt, cors_origins=[origin]),
                  [("OPTIONS", "/classify", {"headers": headers}),
                   ("OPTIONS", "/classify", {"headers": {**headers, "Origin": "http://evil.example"}})])
    assert r[0].status_code == 200 and r[0].headers["access-control-allow-origin"] == origin
    assert "x-api-key" in r[0].headers["access-control-allow-headers"].lower()
    assert r[1].status_code == 400 and "access-control-allow-origin" not in r[1].headers
    off = _statuses(settings_for(tiny_ckpt), [("OPTIONS", "/classify", {"headers": headers})])
    assert "access-control-allow-origin" not in off[0].headers  # off by default


@pytest.mark.skipif(shutil.which("chromium") is None, reason="no `chromium` on PATH (apt-get install chromium)")
def test_a_browser_on_another_origin_passes_the_preflight(tiny_ckpt, http_stub):
    """Chromium itself sends the preflight (a POST with X-API-Key from another origin): allowed, the answer is
    readable; from an origin not allowed, fetch fails."""
    sync_api = pytest.importorskip("playwright.sync_api")
    script = """async ([url, key]) => {
        try {
            const r = await fetch(url + "/classify", {method: "POST", headers: {"X-API-Key": key,
                "Content-Type": "image/png"}, body: new Uint8Array([1, 2, 3])});
            return {status: r.status, rid: r.headers.get("x-request-id")};
        } catch (e) { return {error: String(e)}; }
    }"""
    elsewhere = ["http://elsewhere.example"]
    html = b"<html><body>other origin</body></html>"
    site = http_stub(lambda request: (200, "text/html", html)).url  # a page on another origin (a second port)
    with live_server(settings_for(tiny_ckpt, api_keys=[KEY], cors_origins=[site])) as allowed, \
            live_server(settings_for(tiny_ckpt, api_keys=[KEY], cors_origins=elsewhere)) as refused, \
            sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"),
                                    args=["--headless", "--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page()
            page.goto(site)
            ok = page.evaluate(script, [allowed, KEY])
            blocked = page.evaluate(script, [refused, KEY])
        finally:
            browser.close()
    assert ok.get("status") == 415 and ok.get("rid"), ok  # through the preflight and the key: a real answer
    assert "error" in blocked and "Failed to fetch" in blocked["error"], blocked


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no `openssl` on PATH to make a certificate")
def test_https_with_a_self_signed_certificate(tiny_ckpt, tmp_path):
    import ssl
    import time

    import uvicorn

    from vit_serve.serve.app import create_app

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    settings = settings_for(tiny_ckpt, ssl_certfile=str(cert), ssl_keyfile=str(key))
    port = free_port()
    tls = settings.security
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning",
                                           ssl_certfile=tls.ssl_certfile, ssl_keyfile=tls.ssl_keyfile))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)
        ctx = ssl.create_default_context(cafile=str(cert))
        r = httpx.get(f"https://127.0.0.1:{port}/healthz", verify=ctx)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        with pytest.raises(httpx.ConnectError):  # an unknown certificate is refused by the client
            httpx.get(f"https://127.0.0.1:{port}/healthz")
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port gets no answer
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
    finally:
        server.should_exit = True
        thread.join(15)


def test_tls_needs_both_files(tiny_ckpt):
    from pydantic import ValidationError

    from vit_serve.serve.settings import ServeSettings

    with pytest.raises(ValidationError, match="ssl_certfile and ssl_keyfile go together"):
        ServeSettings(model=str(tiny_ckpt), ssl_certfile="cert.pem")
