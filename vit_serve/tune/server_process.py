"""A gateway in a process of its own: started on a free port, ready once GET /readyz answers 200, stopped.

What `vit-serve tune` (one gateway per trial), the benchmarks and the tests that need a real server share: the
free port (`free_port`), the process (`ServerProcess`: a `vit-serve serve` subprocess, or any process the caller
started, such as tune's forked trial gateways), the wait for readiness (`wait_ready`, which notices a process
that exited rather than waiting out its timeout) and the stop (SIGTERM, then SIGKILL after a grace period).
httpx is imported when readiness is first polled, so that importing this module stays light.
"""

from __future__ import annotations

import multiprocessing.process
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
Process = subprocess.Popen | multiprocessing.process.BaseProcess


class ServerExitedError(RuntimeError):
    """The server process exited before it was ready."""


def free_port(host: str = HOST) -> int:
    """A TCP port nothing listens on now (the OS's choice)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """A gateway process serving on `HOST:port` (`url`), whichever way it was started: `serve(args)` runs
    `python -m vit_serve serve ARGS --port PORT`, `command(argv, port)` any command line, and
    `ServerProcess(proc, port)` wraps a `subprocess.Popen` or `multiprocessing.Process` already started.
    A context manager: the block gets it ready (`wait_ready`) and the process stops when the block ends.
    `ready_path` is what readiness polls: a server other than the gateway (tritonserver) names its own."""

    ready_path = "/readyz"

    def __init__(self, proc: Process, port: int, ready_timeout: float = 300.0) -> None:
        self.proc, self.port, self.ready_timeout = proc, port, ready_timeout
        self.url = f"http://{HOST}:{port}"

    @classmethod
    def command(cls, argv: Sequence[str], port: int, env: Mapping[str, str] | None = None,
                **popen: Any) -> ServerProcess:
        """Start `argv` (a server that listens on `port`), with `env` added to this process's environment."""
        environ = None if env is None else {**os.environ, **env}
        return cls(subprocess.Popen(list(argv), env=environ, **popen), port)

    @classmethod
    def serve(cls, args: Sequence[str], port: int | None = None, env: Mapping[str, str] | None = None,
              **popen: Any) -> ServerProcess:
        """`vit-serve serve ARGS --port PORT` (a free port unless given) in a subprocess of this Python."""
        port = free_port() if port is None else port
        return cls.command([sys.executable, "-m", "vit_serve", "serve", *args, "--port", str(port)], port, env,
                           **popen)

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    @property
    def exitcode(self) -> int | None:
        """None while the process runs, else its exit status."""
        if isinstance(self.proc, subprocess.Popen):
            return self.proc.poll()
        return self.proc.exitcode

    def alive(self) -> bool:
        return self.exitcode is None

    def ready(self) -> dict | None:
        """One probe: the `ready_path` answer when it is 200 ({} when it has no body), else None (any other
        answer, or none)."""
        import httpx

        try:
            r = httpx.get(f"{self.url}{self.ready_path}", timeout=2.0)
        except httpx.TransportError:
            return None
        if r.status_code != 200:
            return None
        return r.json() if r.content else {}

    def wait_ready(self, timeout: float | None = None, poll: float = 0.1,
                   tick: Callable[[], None] = lambda: None) -> dict:
        """Poll /readyz until it answers 200 and return its body; `tick()` before each probe. ServerExitedError
        when the process exits first, TimeoutError after `timeout` seconds (default: `ready_timeout`)."""
        limit = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            tick()
            if not self.alive():
                raise ServerExitedError(f"the server exited with status {self.exitcode} before it was ready")
            if (answer := self.ready()) is not None:
                return answer
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server at {self.url} was not ready after {limit:.0f} s")
            time.sleep(poll)

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within `grace` seconds; its exit status."""
        if isinstance(self.proc, subprocess.Popen):
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        else:
            self.proc.terminate()
            self.proc.join(grace)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
        return self.exitcode

    def cpu_s(self) -> float:
        """CPU time (user + system, s) the process has used so far (Linux; NaN elsewhere)."""
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def memory_mb(self) -> tuple[float, float]:
        """(VmRSS, VmHWM) of the process in MB (Linux; NaN elsewhere)."""
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return float("nan"), float("nan")
        kb = {ln.split(":")[0]: int(ln.split()[1]) for ln in status.splitlines() if ln.startswith(("VmRSS", "VmHWM"))}
        return kb.get("VmRSS", float("nan")) / 1024, kb.get("VmHWM", float("nan")) / 1024

    def __enter__(self) -> ServerProcess:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
