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
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
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
    `stop` (and interpreter exit) ends.
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
        self.threads = threads
        self.log_verbose = log_verbose
        self.extra_args = tuple(extra_args)
        self._home = Path(tempfile.mkdtemp(prefix="vit-tritonserver-"))
        self.log_file = Path(log_file) if log_file else self._home / "tritonserver.log"
        self._proc: subprocess.Popen | None = None
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
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def start(self, timeout: float = 120.0) -> TritonServer:
        """Start the server and wait until it is ready; RuntimeError with the log's tail if it is not."""
        if self.is_running():
            raise RuntimeError(f"tritonserver is already running (pid {self.pid})")
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            self._proc = subprocess.Popen(
                self._command(),
                env=self._env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: the Python stubs go with it on stop
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready():
                return self
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                raise RuntimeError(f"tritonserver exited with code {code} before it was ready:\n{self.log_tail()}")
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"tritonserver was not ready within {timeout:g}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after `timeout` seconds. No-op if not running."""
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
