"""Start and stop the `tritonserver` binary shipped in the nvidia-pytriton wheel on a model repository.

That build has the Python backend only (no onnxruntime or TensorRT backend), so by default the server loads
the repository's Python-backend models and the ensembles made of them (`loadable_models`).

    with TritonServer("model_repo") as server:     # free ports on 127.0.0.1, waits for /v2/health/ready
        client = tritonclient.http.InferenceServerClient(server.http_address)

How the Python backend is made to work from a wheel: a private backend folder holds links to
`pytriton/tritonserver/backends/python/*` and a copy of the stub built for this Python
(`python_backend_stubs/<major.minor>/triton_python_backend_stub`); the stub embeds libpython, so the running
interpreter's shared library goes first on LD_LIBRARY_PATH, and this interpreter's `bin` goes first on PATH
(the embedded interpreter finds `python3` there, hence this virtual environment and its site-packages).

Each server gets its own prefix for the Python backend's shared-memory regions (`shm_prefix`, passed as
`--backend-config=python,shm-region-prefix-name=`): Triton requires a distinct one per server on a machine (two
servers on the default prefix abort with boost::interprocess::lock_exception), and the prefix is how `stop`
finds and removes the regions a server leaves in /dev/shm, also after a SIGKILL.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

HOST = "127.0.0.1"
SHM_DIR = Path("/dev/shm")
SHM_PREFIX_ARG = "--backend-config=python,shm-region-prefix-name="


class TritonStartError(RuntimeError):
    """tritonserver exited before it was ready, or was not ready in time: its exit code (negative: the signal that
    ended it; None: still running at the deadline, then stopped) and the tail of its log."""

    def __init__(self, message: str, returncode: int | None, log_tail: str) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.log_tail = log_tail


def exit_text(returncode: int) -> str:
    """"exited with code 1", or "was killed by SIGABRT (exit code -6)" for a signal."""
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-returncode).name} (exit code {returncode})"
        return f"was killed by signal {-returncode} (exit code {returncode})"
    return f"exited with code {returncode}"


def new_shm_prefix() -> str:
    """A Python-backend shared-memory prefix no other server on this machine uses (the backend appends a UUID)."""
    return f"vit_triton_{os.getpid()}_{secrets.token_hex(4)}_"


def shm_regions(prefix: str) -> list[Path]:
    """The shared-memory regions in /dev/shm whose names start with `prefix`."""
    if not prefix or "/" in prefix:
        raise ValueError(f"not a shared-memory prefix: {prefix!r}")
    try:
        return sorted(p for p in SHM_DIR.iterdir() if p.name.startswith(prefix))
    except OSError:  # no /dev/shm here
        return []


def remove_shm(prefix: str) -> list[Path]:
    """Remove the regions of `prefix` (call it once the server and its stubs are gone); returns those removed."""
    removed = []
    for path in shm_regions(prefix):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


def listens_on(pid: int, port: int) -> bool:
    """False when /proc shows the socket listening on 127.0.0.1:`port` held by another process than `pid` (one
    that took the port first, another test worker's server say, would answer our health checks), or no such
    socket; True when `pid` holds it, or when /proc cannot tell."""
    want = f"0100007F:{port:04X}"
    inodes = set()
    try:
        with open("/proc/net/tcp") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[1] == want and fields[3] == "0A":  # local address, LISTEN
                    inodes.add(f"socket:[{fields[9]}]")
    except OSError:
        return True
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except FileNotFoundError:  # the process is gone
        return False
    except OSError:
        return True
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(fd) in inodes:
                return True
    return False


def _prefix_in(args: tuple[str, ...]) -> str | None:
    """The shm prefix that `args` already set (`--backend-config=python,shm-region-prefix-name=X`), if any."""
    found = [a[len(SHM_PREFIX_ARG):] for a in args if a.startswith(SHM_PREFIX_ARG)]
    return found[-1] if found else None


def _pytriton_root() -> Path | None:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _python_tag() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _paths() -> dict[str, Path]:
    root = _pytriton_root()
    if root is None:
        raise RuntimeError("nvidia-pytriton is not installed (pip install nvidia-pytriton)")
    dist = root / "tritonserver"
    return {
        "server": dist / "bin" / "tritonserver",
        "backend": dist / "backends" / "python",
        "stub": dist / "python_backend_stubs" / _python_tag() / "triton_python_backend_stub",
        "libs": root.parent / "nvidia_pytriton.libs",
    }


def _libpython_dir() -> Path | None:
    """The folder of this interpreter's libpython when it is a shared build (the stub links libpython)."""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return None
    libdir = sysconfig.get_config_var("LIBDIR")
    return Path(libdir) if libdir else None


def available() -> str | None:
    """None when the bundled server can run here, else the reason it cannot (one line)."""
    if not sys.platform.startswith("linux"):
        return f"the tritonserver in nvidia-pytriton runs on Linux only (this is {sys.platform})"
    try:
        paths = _paths()
    except RuntimeError as e:
        return str(e)
    for key in ("server", "backend", "stub", "libs"):
        if not paths[key].exists():
            return f"nvidia-pytriton has no {paths[key]} (Python {_python_tag()}, {os.uname().machine})"
    if _libpython_dir() is None:
        import ctypes.util

        if ctypes.util.find_library(f"python{_python_tag()}") is None:
            return f"the Python backend stub needs a shared libpython{_python_tag()}, and this Python is static"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def loadable_models(repo: str | os.PathLike) -> list[str]:
    """Models of `repo` the bundled server can load: Python-backend models and ensembles made only of those."""
    from vit_export.triton_config import parse

    configs = {}
    for cfg_file in sorted(Path(repo).glob("*/config.pbtxt")):
        configs[cfg_file.parent.name] = parse(cfg_file.read_text())
    python = {n for n, c in configs.items() if c.backend == "python"}
    ensembles = {
        n
        for n, c in configs.items()
        if c.platform == "ensemble" and all(s.model_name in python for s in c.ensemble_scheduling.step)
    }
    return sorted(python | ensembles)


class TritonServer:
    """A tritonserver process on `repo` (context manager). Ports are chosen once and kept across restarts.

    models: names to load (explicit model control); None -> `loadable_models(repo)`.
    http_url ("http://127.0.0.1:P"), http_address ("127.0.0.1:P", what tritonclient.http takes), grpc_url
    ("127.0.0.1:P", a gRPC target), metrics_url ("http://127.0.0.1:P/metrics").
    The server and its Python stubs run with OMP_NUM_THREADS=`threads`, in their own process group, which
    `stop` (and interpreter exit) ends. shm_prefix: the Python backend's shared-memory prefix (default: a new one
    per server, `new_shm_prefix`; one given in `extra_args` is taken as is); `stop` removes its regions.
    """

    available = staticmethod(available)

    def __init__(
        self,
        repo: str | os.PathLike,
        models: list[str] | None = None,
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        log_file: str | os.PathLike | None = None,
        threads: int = 1,
        log_verbose: int = 0,
        extra_args: tuple[str, ...] = (),
        shm_prefix: str | None = None,
    ) -> None:
        reason = available()
        if reason:
            raise RuntimeError(f"cannot start tritonserver: {reason}")
        self.repo = Path(repo).resolve()
        if not self.repo.is_dir():
            raise FileNotFoundError(f"no model repository at {self.repo}")
        self.models = list(models) if models is not None else loadable_models(self.repo)
        if not self.models:
            raise ValueError(f"{self.repo} holds no model the bundled server can load (Python backend, ensembles)")
        self.http_port = http_port or _free_port()
        self.grpc_port = grpc_port or _free_port()
        self.metrics_port = metrics_port or _free_port()
        # Free ports chosen here may be taken by another process (another test worker) before the server binds
        # them: the first start then picks new ones; later starts keep them (a restart keeps its addresses).
        self._ports_movable = not (http_port or grpc_port or metrics_port)
        self.threads = threads
        self.log_verbose = log_verbose
        self.extra_args = tuple(extra_args)
        given = _prefix_in(self.extra_args)
        if given is not None and shm_prefix is not None and given != shm_prefix:
            raise ValueError(f"two shared-memory prefixes: shm_prefix={shm_prefix!r} and {SHM_PREFIX_ARG}{given}")
        self.shm_prefix = given or shm_prefix or new_shm_prefix()
        shm_regions(self.shm_prefix)  # a bad prefix is a ValueError now, not a server that cannot start
        self._home = Path(tempfile.mkdtemp(prefix="vit-tritonserver-"))
        self.log_file = Path(log_file) if log_file else self._home / "tritonserver.log"
        self._proc: subprocess.Popen | None = None
        self._log_start = 0
        self._backends = self._make_backend_dir()
        atexit.register(self.close)

    # -- addresses -------------------------------------------------------------------------------------------
    @property
    def http_address(self) -> str:
        return f"{HOST}:{self.http_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.http_address}"

    @property
    def grpc_url(self) -> str:
        return f"{HOST}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{HOST}:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    # -- process ---------------------------------------------------------------------------------------------
    def _make_backend_dir(self) -> Path:
        paths = _paths()
        python = self._home / "backends" / "python"
        python.mkdir(parents=True)
        for item in paths["backend"].iterdir():
            if item.name != "__pycache__":
                (python / item.name).symlink_to(item)
        # A copy, not a link: the backend starts the stub it finds beside libtriton_python.so.
        shutil.copy2(paths["stub"], python / "triton_python_backend_stub")
        return self._home / "backends"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        libs = [str(p) for p in (_libpython_dir(), _paths()["libs"]) if p]
        env["LD_LIBRARY_PATH"] = os.pathsep.join([*libs, *filter(None, [env.get("LD_LIBRARY_PATH")])])
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        # vit_serve must import in the stubs even when it runs from a checkout that is not installed.
        import vit_serve

        src = str(Path(vit_serve.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[var] = str(self.threads)
        return env

    def _command(self) -> list[str]:
        cmd = [
            str(_paths()["server"]),
            f"--model-repository={self.repo}",
            f"--backend-directory={self._backends}",
            "--model-control-mode=explicit",
            *(f"--load-model={m}" for m in self.models),
            f"--http-address={HOST}",
            f"--http-port={self.http_port}",
            f"--grpc-address={HOST}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={HOST}",
            f"--metrics-port={self.metrics_port}",
            "--allow-gpu-metrics=false",
            "--exit-timeout-secs=5",
            f"--log-verbose={self.log_verbose}",
            *(() if _prefix_in(self.extra_args) else (f"{SHM_PREFIX_ARG}{self.shm_prefix}",)),
            *self.extra_args,
        ]
        return cmd

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def ready(self) -> bool:
        """True when /v2/health/ready answers 200."""
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=1) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 40) -> str:
        """The last `lines` lines the server wrote since its last start (its usage text, printed after a bad
        argument, left out: the reason is the line before it)."""
        try:
            with open(self.log_file, "rb") as f:
                f.seek(self._log_start)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        out = text.splitlines()
        usage = next((i for i, line in enumerate(out) if line.startswith("Usage: tritonserver")), None)
        return "\n".join(out[:usage][-lines:])

    def shm_regions(self) -> list[Path]:
        """This server's shared-memory regions in /dev/shm (by its prefix)."""
        return shm_regions(self.shm_prefix)

    def start(self, timeout: float = 120.0) -> TritonServer:
        """Start the server and wait until it is ready; TritonStartError (a RuntimeError) with the exit code and
        the log's tail if it exits first or is not ready in `timeout` seconds. On a first start with ports chosen
        here, a port taken meanwhile is replaced by a new free one (twice at most)."""
        if self.is_running():
            raise RuntimeError(f"tritonserver is already running (pid {self.pid})")
        deadline = time.monotonic() + timeout
        attempts = 3 if self._ports_movable else 1
        for attempt in range(1, attempts + 1):
            try:
                self._start_once(timeout, deadline)
                break
            except TritonStartError as e:
                if attempt == attempts or "already in use" not in e.log_tail:
                    raise
                self.http_port, self.grpc_port, self.metrics_port = _free_port(), _free_port(), _free_port()
        self._ports_movable = False
        return self

    def _start_once(self, timeout: float, deadline: float) -> TritonServer:
        self.stop()  # a server that died (a SIGKILL from outside): its stubs and regions go first
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            self._log_start = log.tell()
            self._proc = subprocess.Popen(
                self._command(),
                env=self._env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: the Python stubs go with it on stop
            )
        while time.monotonic() < deadline:
            if self.ready() and listens_on(self._proc.pid, self.http_port):
                return self
            code = self._proc.poll()
            if code is not None:
                self.stop()  # its stubs, if any outlived it, and its shared-memory regions
                tail = self.log_tail()
                raise TritonStartError(f"tritonserver {exit_text(code)} before it was ready "
                                       f"(log {self.log_file}):\n{tail}", code, tail)
            time.sleep(0.1)
        self.stop()
        tail = self.log_tail()
        raise TritonStartError(f"tritonserver was not ready within {timeout:g}s (log {self.log_file}):\n{tail}",
                               None, tail)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after `timeout` seconds, then remove its shared-memory
        regions (a server that was SIGKILLed, or died, leaves them behind). No-op if it was never started."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError):  # stubs that outlived the server
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        # Nothing makes regions once the group is killed; one a dying stub still maps is freed when it exits.
        remove_shm(self.shm_prefix)

    def restart(self, timeout: float = 120.0) -> TritonServer:
        """Stop, then start again on the same ports."""
        self.stop()
        return self.start(timeout)

    def close(self) -> None:
        """Stop the server and remove the private backend folder (and the default log)."""
        self.stop()
        shutil.rmtree(self._home, ignore_errors=True)
        atexit.unregister(self.close)

    def __enter__(self) -> TritonServer:
        return self.start() if not self.is_running() else self

    def __exit__(self, *exc: object) -> None:
        self.close()
