"""The tritonserver launcher (vit_export.tritonserver) against the real server of the nvidia-pytriton wheel.

Two servers run at once on one machine (as two pytest-xdist workers start them), each with its own Python-backend
shared-memory prefix, and /dev/shm keeps nothing of a stopped or SIGKILLed server; a server that dies before it
is ready is an error carrying its exit code (or signal) and the tail of its log. Checked against what the kernel
shows: /proc/PID/cmdline for the flags the server really got, /dev/shm for the regions.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from vit_export.tritonserver import (
    SHM_PREFIX_ARG,
    TritonServer,
    TritonStartError,
    available,
    listens_on,
    shm_regions,
)

from tests.triton_models import ECHO_MODEL


@pytest.fixture(autouse=True)
def _needs_tritonserver() -> None:
    reason = available()
    if reason:
        pytest.skip(f"no tritonserver here: {reason}")


def _repo(folder: Path, model_py: str | None = None) -> Path:
    """A repository with one Python-backend model, `echo` (its model.py replaced by `model_py` if given)."""
    for name, text in ECHO_MODEL.items():
        path = folder / "echo" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(model_py if model_py is not None and name.endswith(".py") else text)
    return folder


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def test_two_servers_at_once_have_their_own_regions_and_leave_none(tmp_path):
    repo = _repo(tmp_path / "repo")
    servers = [TritonServer(repo, threads=1), TritonServer(repo, threads=1)]
    try:
        assert servers[0].shm_prefix != servers[1].shm_prefix
        errors: list[BaseException] = []

        def start(server: TritonServer) -> None:
            try:
                server.start(timeout=120)
            except BaseException as e:  # reported below, with the log tail the error carries
                errors.append(e)

        threads = [threading.Thread(target=start, args=(s,)) for s in servers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for s in servers:
            assert s.ready()
            assert f"{SHM_PREFIX_ARG}{s.shm_prefix}" in _cmdline(s.pid)
            assert s.shm_regions(), f"no region in /dev/shm starts with {s.shm_prefix}"
        prefixes = [s.shm_prefix for s in servers]
        print("prefixes", prefixes, "regions", [[p.name for p in s.shm_regions()] for s in servers])

        servers[0].stop()
        assert shm_regions(prefixes[0]) == [] and servers[1].shm_regions() and servers[1].ready()

        # SIGKILL (the whole process group, as the OOM killer or a CI timeout would): the regions outlive it ...
        pid = servers[1].pid
        os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while servers[1].is_running() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not servers[1].is_running()
        assert shm_regions(prefixes[1]), "a SIGKILLed server's regions are gone by themselves"
        # ... and the launcher removes them by prefix.
        servers[1].stop()
        assert shm_regions(prefixes[1]) == []

        # Only the server SIGKILLed, its stub still alive: a restart cleans up first and comes back ready.
        servers[1].start(timeout=120)
        os.kill(servers[1].pid, signal.SIGKILL)
        servers[1].restart(timeout=120)
        assert servers[1].ready() and len(servers[1].shm_regions()) >= 1
    finally:
        for s in servers:
            s.close()
    assert [shm_regions(p) for p in prefixes] == [[], []]


def test_a_prefix_given_in_the_arguments_is_the_one_used_and_cleaned(tmp_path):
    prefix = f"vit_test_{os.getpid()}_given_"
    server = TritonServer(_repo(tmp_path / "repo"), extra_args=(f"{SHM_PREFIX_ARG}{prefix}",))
    try:
        assert server.shm_prefix == prefix
        server.start(timeout=120)
        assert sum(a.startswith(SHM_PREFIX_ARG) for a in _cmdline(server.pid)) == 1
        assert shm_regions(prefix)
    finally:
        server.close()
    assert shm_regions(prefix) == []
    with pytest.raises(ValueError, match="two shared-memory prefixes"):
        TritonServer(tmp_path / "repo", shm_prefix="other_", extra_args=(f"{SHM_PREFIX_ARG}{prefix}",))
    with pytest.raises(ValueError, match="not a shared-memory prefix"):
        TritonServer(tmp_path / "repo", shm_prefix="../x")


def test_a_server_that_exits_before_ready_reports_its_code_and_log(tmp_path):
    log = tmp_path / "triton.log"
    log.write_text("a line of an earlier run\n")
    server = TritonServer(_repo(tmp_path / "repo"), log_file=log, extra_args=("--no-such-flag=1",))
    try:
        with pytest.raises(TritonStartError) as info:
            server.start(timeout=60)
    finally:
        server.close()
    err = info.value
    print(err)
    assert isinstance(err, RuntimeError) and err.returncode not in (None, 0)
    assert f"tritonserver exited with code {err.returncode} before it was ready" in str(err)
    assert "no-such-flag" in err.log_tail and err.log_tail in str(err) and str(log) in str(err)
    assert "earlier run" not in err.log_tail  # the tail of this start only
    assert shm_regions(server.shm_prefix) == []


def test_a_server_killed_while_loading_names_the_signal_and_leaves_no_region(tmp_path):
    """A model whose initialize never ends; the server is SIGKILLed while it loads (the stub and its region
    exist by then): the error names SIGKILL, and the regions are removed."""
    slow = "import time\n\n\nclass TritonPythonModel:\n    def initialize(self, args):\n        time.sleep(300)\n"
    server = TritonServer(_repo(tmp_path / "repo", slow))
    killed: list[int] = []

    def kill_once_loading() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if server.pid and server.shm_regions():
                killed.append(len(server.shm_regions()))
                os.kill(server.pid, signal.SIGKILL)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_once_loading)
    try:
        killer.start()
        with pytest.raises(TritonStartError) as info:
            server.start(timeout=90)
        killer.join()
    finally:
        server.close()
    print(info.value)
    assert killed, "the server never made its region"
    assert info.value.returncode == -signal.SIGKILL
    assert "tritonserver was killed by SIGKILL (exit code -9) before it was ready" in str(info.value)
    assert shm_regions(server.shm_prefix) == []


def test_a_port_taken_before_the_first_start_is_replaced_and_never_mistaken_for_ours(tmp_path, http_stub):
    """The free port chosen at construction is taken, before the server binds it, by a server that answers
    /v2/health/ready with 200: start() must not take that answer for its own server's, and picks new ports."""
    server = TritonServer(_repo(tmp_path / "repo"))
    # another process's server on the port (another test worker's tritonserver, say): 200 to all
    http_stub(lambda request: (200, "", b""), port=server.http_port)
    taken = server.http_port
    try:
        assert server.ready()  # the impostor answers at the port first chosen
        server.start(timeout=120)
        assert server.http_port != taken and listens_on(server.pid, server.http_port)
        assert not listens_on(server.pid, taken)
        with urllib.request.urlopen(f"{server.http_url}/v2/models/echo", timeout=10) as r:
            assert json.loads(r.read())["name"] == "echo"
        ports = (server.http_port, server.grpc_port, server.metrics_port)
        server.restart(timeout=120)  # a restart keeps its addresses
        assert (server.http_port, server.grpc_port, server.metrics_port) == ports and server.ready()
    finally:
        server.close()
