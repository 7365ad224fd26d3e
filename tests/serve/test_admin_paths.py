"""Admin routes (load / unload) and open routes are matched on the path Starlette routes by (`root_path` taken off),
so that a gateway under a proxy prefix (uvicorn's `--root-path /vit`) or mounted inside another app guards them
as it does at `/`; and without admin keys, load / unload are refused unless `--allow-any-key-admin` says any key
may (over HTTP and gRPC). Reference: the same requests to the gateway served at `/`."""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from gateway_helpers import run, serving, settings_for, wait_ready

from vit_serve.tune.server_process import ServerExitedError, ServerProcess

KEY, ADMIN = "k-3f9a1c", "admin-77e2b0"


@pytest.fixture(scope="module")
def repo(tiny_ckpt, tmp_path_factory) -> Path:
    """A folder repository with one model, `tiny` (load / unload need one, with explicit model control)."""
    folder = tmp_path_factory.mktemp("admin-repo")
    shutil.copy(tiny_ckpt, folder / "tiny.safetensors")
    return folder


def _settings(repo: Path, **kw):
    return settings_for(repo, model_control="explicit", load_models=["tiny"], **kw)


@contextmanager
def _uvicorn(settings, root_path: str) -> Iterator[str]:
    """A real uvicorn with `root_path` (as `vit-serve serve --root-path` runs it): the base URL a proxy that strips
    the prefix would call."""
    import uvicorn

    from vit_serve.serve.app import create_app

    app = create_app(settings)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", root_path=root_path))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        assert wait_ready(url, thread.is_alive), "the test server did not become ready"
        yield url
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def _admin_calls(post) -> list[httpx.Response]:
    """unload with a normal key, unload with the admin key, load with the admin key, load with a normal key."""
    return [post("/v2/repository/models/tiny/unload", KEY), post("/v2/repository/models/tiny/unload", ADMIN),
            post("/v2/repository/models/tiny/load", ADMIN), post("/v2/repository/models/tiny/load", KEY)]


def test_under_a_root_path_a_normal_key_cannot_load_or_unload(repo):
    settings = _settings(repo, api_keys=[KEY], admin_api_keys=[ADMIN])
    with _uvicorn(settings, "/vit") as url:
        r = _admin_calls(lambda path, key: httpx.post(url + path, headers={"X-API-Key": key}, timeout=60))
        probes = [httpx.get(f"{url}{p}", timeout=10) for p in ("/healthz", "/readyz", "/v2/health/live")]
        page = httpx.get(f"{url}/", timeout=10)
        listed = httpx.get(f"{url}/models", timeout=10)
    assert [x.status_code for x in r] == [403, 200, 200, 403], [x.text for x in r]
    assert "admin key" in r[0].json()["error"]  # the /v2 error shape, under the prefix too
    assert [x.status_code for x in probes] == [200, 200, 200]  # open probes stay open under the prefix
    assert page.status_code in (200, 404) and listed.status_code == 401


def test_mounted_in_another_app_a_normal_key_cannot_load_or_unload(repo):
    from vit_serve.serve.app import create_app

    inner = create_app(_settings(repo, api_keys=[KEY], admin_api_keys=[ADMIN]))
    outer = FastAPI()
    outer.mount("/vit", inner)

    async def scenario():
        async with inner.router.lifespan_context(inner):  # a mounted app's lifespan is its owner's to run
            await inner.state.gateway.wait_ready(60)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=outer), base_url="http://host",
                                         timeout=60) as client:
                out = []
                for path, key in [("/v2/repository/models/tiny/unload", KEY), ("/v2/repository/models/tiny/unload",
                                  ADMIN), ("/v2/repository/models/tiny/load", ADMIN),
                                  ("/v2/repository/models/tiny/load", KEY)]:
                    out.append(await client.post("/vit" + path, headers={"X-API-Key": key}))
                out.append(await client.get("/vit/healthz"))
                out.append(await client.get("/vit/models"))
                return out

    r = run(scenario())
    assert [x.status_code for x in r] == [403, 200, 200, 403, 200, 401], [x.text for x in r]


def _no_admin(repo: Path, **kw) -> list[httpx.Response]:
    async def scenario():
        async with serving(_settings(repo, **kw)) as (client, _):
            headers = {"X-API-Key": KEY} if kw.get("api_keys") else {}
            return [await client.post("/v2/repository/models/tiny/unload", headers=headers),
                    await client.post("/v2/repository/models/tiny/load", headers=headers),
                    await client.post("/v2/repository/index", headers=headers)]

    return run(scenario())


def test_without_admin_keys_load_and_unload_need_the_allow_any_key_admin_flag(repo, caplog):
    for kw in ({"api_keys": [KEY]}, {}):  # with API keys, and with none at all
        refused = _no_admin(repo, **kw)
        assert [x.status_code for x in refused] == [403, 403, 200], [x.text for x in refused]
        assert "--allow-any-key-admin" in refused[0].json()["error"]
    caplog.set_level(logging.WARNING, logger="vit_serve.serve")
    allowed = _no_admin(repo, api_keys=[KEY], allow_any_key_admin=True)
    assert [x.status_code for x in allowed] == [200, 200, 200], [x.text for x in allowed]
    assert any("--allow-any-key-admin" in r.getMessage() and "load and unload" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING), caplog.text
    ignored = _no_admin(repo, api_keys=[KEY], admin_api_keys=[ADMIN], allow_any_key_admin=True)
    assert [x.status_code for x in ignored] == [403, 403, 200]  # admin keys configured: they decide


def test_without_admin_keys_grpc_load_and_unload_need_the_flag(repo):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from gateway_helpers import live_app
    from tritonclient.utils import InferenceServerException

    def calls(**kw):
        with live_app(_settings(repo, grpc_port=0, **kw)) as (_, app):
            c = grpcclient.InferenceServerClient(app.state.grpc.address)
            out = []
            try:
                for call in (lambda: c.unload_model("tiny"), lambda: c.load_model("tiny")):
                    try:
                        call()
                        out.append("OK")
                    except InferenceServerException as e:
                        out.append(f"{e.status()} {e.message()}")
                out.append(c.is_model_ready("tiny"))
            finally:
                c.close()
            return out

    refused = calls()
    assert [x.split(" ")[0] for x in refused[:2]] == ["StatusCode.PERMISSION_DENIED"] * 2, refused
    assert "--allow-any-key-admin" in refused[0]
    assert calls(allow_any_key_admin=True) == ["OK", "OK", True]


def test_the_cli_serves_under_its_root_path_and_warns_about_any_key_admin(repo, tmp_path):
    """`vit-serve serve --root-path /vit --allow-any-key-admin` as a new user runs it: uvicorn gets the prefix (the
    OpenAPI document names it as the server), the probes stay open under it, and the start-up log warns that any
    key may load and unload."""
    env = {"VIT_SERVE_THREADS": "1", "VIT_SERVE_DECODE_WORKERS": "1", "OMP_NUM_THREADS": "1"}
    log = tmp_path / "output"
    with log.open("wb") as f:
        server = ServerProcess.serve([str(repo), "--root-path", "/vit", "--api-key", KEY, "--allow-any-key-admin",
                                      "--model-control", "explicit", "--load-model", "tiny"], env=env, stdout=f,
                                     stderr=subprocess.STDOUT)
        url = server.url
        try:
            try:
                server.wait_ready(90)
            except (ServerExitedError, TimeoutError) as e:
                raise AssertionError(log.read_text()[-3000:]) from e
            schema = httpx.get(f"{url}/openapi.json", timeout=10).json()
            unload = httpx.post(f"{url}/v2/repository/models/tiny/unload", headers={"X-API-Key": KEY}, timeout=60)
            anonymous = httpx.post(f"{url}/v2/repository/models/tiny/load", timeout=60)
        finally:
            server.stop()
    out = log.read_text()
    assert schema.get("servers") == [{"url": "/vit"}], schema.get("servers")
    assert unload.status_code == 200, unload.text  # any valid key, as the flag says
    assert anonymous.status_code == 401  # ... but a key still
    assert "--allow-any-key-admin: any valid API key may load and unload models" in out, out
