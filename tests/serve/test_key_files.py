"""Key files are read again while the gateway runs (issue 38, point 6): when they change (looked at, at most, once a
second) and on SIGHUP, so that a key is revoked without a restart; a file that cannot be read then keeps the keys
read before and logs an error. Against a real gateway on a real socket: uvicorn in a thread (the change), and a
real `vit-serve serve` process sent SIGHUP (a rewrite that keeps the file's size, inode and mtime, so that only
the signal can make it read again)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
from gateway_helpers import live_app, settings_for

from vit_serve.tune.server_process import ServerExitedError, ServerProcess

ALICE, BOB, CAROL = "alice-key-41c9", "bob-key-0d77a", "carol-key-e2f"  # Bob's and Carol's: one length


def _replace(path: Path, text: str) -> None:
    """Write `text` to `path` atomically, as a deployment should (a new file renamed over the old one)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _status(url: str, key: str) -> int:
    return httpx.get(f"{url}/models", headers={"X-API-Key": key}, timeout=30).status_code


def _until(check, timeout: float = 15.0) -> bool:
    """Poll `check()` (each poll is a request: requests look at the files) until true, or False after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


def test_a_changed_key_file_is_read_again_and_a_broken_one_keeps_the_keys(tiny_ckpt, tmp_path, caplog):
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{ALICE} name=alice\n{BOB} name=bob\n")
    caplog.set_level(logging.INFO, logger="vit_serve.serve")
    with live_app(settings_for(tiny_ckpt, api_keys_file=str(keys))) as (url, _):
        assert _status(url, ALICE) == 200 and _status(url, BOB) == 200 and _status(url, CAROL) == 401
        _replace(keys, f"{ALICE} name=alice\n{CAROL} name=carol\n")  # Bob revoked, Carol added
        assert _until(lambda: _status(url, BOB) == 401), "the revoked key was still accepted"
        assert _status(url, ALICE) == 200 and _status(url, CAROL) == 200
        _replace(keys, f"{ALICE} name=alice\n{BOB} rate=fast\n")  # a bad line: nothing of it is used
        assert _until(lambda: _status(url, ALICE) == 200 and "API keys not read again" in caplog.text)
        assert _status(url, CAROL) == 200 and _status(url, BOB) == 401  # the keys read before
        assert f"the key file {keys}, line 2" in caplog.text
        keys.unlink()  # gone: the keys read before stay too
        time.sleep(1.1)
        assert _status(url, ALICE) == 200 and _status(url, CAROL) == 200
        _replace(keys, f"{BOB} name=bob\n")
        assert _until(lambda: _status(url, ALICE) == 401)
        assert _status(url, BOB) == 200
    for key in (ALICE, BOB, CAROL):
        assert key not in caplog.text


def test_sighup_reads_the_key_files_again_in_vit_serve_serve(tiny_ckpt, tmp_path):
    keys, admin = tmp_path / "keys.txt", tmp_path / "admin.txt"
    keys.write_text(f"{ALICE}\n{BOB}\n")
    admin.write_text("admin-key-5f2a\n")
    env = {"VIT_SERVE_THREADS": "1", "VIT_SERVE_DECODE_WORKERS": "1", "OMP_NUM_THREADS": "1"}
    server = ServerProcess.serve([str(tiny_ckpt), "--api-keys-file", str(keys), "--admin-api-keys-file", str(admin)],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(server.proc.stdout), daemon=True)
    reader.start()
    url = server.url
    try:
        try:
            server.wait_ready(90)
        except (ServerExitedError, TimeoutError) as e:
            raise AssertionError("".join(lines)) from e
        assert _status(url, BOB) == 200 and _status(url, CAROL) == 401
        # Bob's line becomes Carol's, in place: same size, same inode, the old mtime put back.
        before = keys.stat()
        with keys.open("r+") as f:
            f.write(f"{ALICE}\n{CAROL}\n")
        os.utime(keys, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert (keys.stat().st_ino, keys.stat().st_size) == (before.st_ino, before.st_size)
        time.sleep(1.5)
        assert _status(url, BOB) == 200  # nothing told the gateway
        os.kill(server.pid, signal.SIGHUP)
        assert _until(lambda: _status(url, BOB) == 401), "".join(lines)
        assert _status(url, CAROL) == 200 and _status(url, ALICE) == 200
        assert server.alive(), "".join(lines)  # SIGHUP read the keys; it did not end the server
        assert any("API keys read again" in line for line in lines)
        assert not any(k in line for line in lines for k in (ALICE, BOB, CAROL))
    finally:
        server.stop()
