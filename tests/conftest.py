"""Shared fixtures. Reference models are built from their own libraries with random weights, never downloaded."""

from __future__ import annotations

import faulthandler
import importlib.util
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from http_stub import HttpStub, Respond

import vit_serve

if TYPE_CHECKING:
    from vit_export import ExportResult

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
# The gateway's load-time runtime choice (vit_serve.runtime.runtime_choice) exports and times every checkpoint it
# loads; tests/runtime/test_torch_forwards.py and tests/serve/test_runtime_choice_gateway.py run it on purpose.
os.environ.setdefault("VIT_SERVE_CHOOSE_RUNTIME", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One intra-op thread per xdist worker: two workers with two threads each on two cores run several
    # times slower than one thread each (subprocesses the tests start inherit this too).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


@pytest.hookimpl(trylast=True)  # after the fixtures' teardown, where ray.shutdown() runs
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """Ray's core worker (an in-process `ray.init`) puts its own handlers on SIGSEGV and the other fatal signals
    and leaves them at SIG_DFL after `ray.shutdown()`: faulthandler is re-armed, so that a later crash in this
    worker still prints its stack instead of ending it silently."""
    if "ray" in sys.modules and faulthandler.is_enabled():
        faulthandler.disable()
        faulthandler.enable(file=sys.__stderr__, all_threads=True)


_POSITIONS = ("pos_embed", "position_embeddings", "pos_embedding")
_CLASS_TOKENS = ("cls_token", "class_token")
_HEADS = ("head.", "heads.head.", "classifier.")


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0, head_std: float = 0.2) -> torch.nn.Module:
    """Non-trivial random weights, for any library's ViT, so that a wrong mapping cannot hide.

    Position embeddings and the [class] token N(0, 1) (they dominate a wrong resampling, and make attention
    far from uniform, exposing a q/k mix-up); weight matrices N(0, 1/fan_in); LayerNorm scales N(1, 0.2);
    biases N(0, 0.1); the head std `head_std` (logits O(1-10): a 1e-5 absolute tolerance stays meaningful;
    about 0.2 at width 192, 0.1 at 768).
    """
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _POSITIONS or leaf in _CLASS_TOKENS:
            p.copy_(torch.randn(p.shape, generator=g))
        elif name.startswith(_HEADS) or name.startswith(tuple(f"vit.{h}" for h in _HEADS)):
            p.copy_(torch.randn(p.shape, generator=g) * head_std)
        elif p.ndim >= 2:
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p[0].numel()))
        elif leaf == "bias":
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="session")
def randomize():
    return randomize_


@torch.no_grad()
def fit_head_(model, x: torch.Tensor, y: torch.Tensor, ridge: float = 1.0) -> None:
    """A least-squares head on the model's frozen features (one-hot targets +-1): a trained model in a second,
    for the checks that need one whose answers mean something (int8 and fast-decode agreement)."""
    f = model.forward_head(model.forward_features(x), pre_logits=True)
    mu, sd = f.mean(0), f.std(0)
    a = torch.cat([(f - mu) / sd, torch.ones(len(f), 1)], 1).double()
    t = torch.nn.functional.one_hot(y, model.head.out_features).double() * 2 - 1
    w = torch.linalg.solve(a.T @ a + ridge * torch.eye(a.shape[1], dtype=torch.double), a.T @ t).float()
    model.head.weight.copy_((w[:-1] / sd[:, None]).T)
    model.head.bias.copy_(w[-1] - (mu / sd) @ w[:-1])


@pytest.fixture(scope="session")
def fit_head():
    return fit_head_


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine (or under pytest -n 2)
    they stall on them: ~10x slower. One thread for the test, restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def save_tiny_(path: Path, res: int | tuple[int, int], seed: int, labels: list[str], contract: bool = True) -> Path:
    """A 2-block Ti/16 at `res` with random non-trivial weights (seed) and `labels`, saved at `path`; `contract`:
    an ImageNet-style preprocessing contract (bicubic, crop 0.875), else the library's default."""
    from vit_serve.preprocess import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, PreprocessConfig

    model = randomize_(vit_serve.create_model("Ti/16", num_classes=len(labels), depth=2, img_size=res), seed=seed)
    model.labels = list(labels)
    if contract:
        model.preprocess_cfg = PreprocessConfig(input_size=res, mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD,
                                                interpolation="bicubic", crop_pct=0.875)
    vit_serve.save(model, path)
    return path


@pytest.fixture(scope="session")
def save_tiny() -> Callable[..., Path]:
    """`save_tiny(path, res, seed, labels, contract=True) -> path` (`save_tiny_`)."""
    return save_tiny_


@pytest.fixture(scope="session")
def export_tiny(randomize) -> Callable[..., tuple[ExportResult, Path]]:
    """`export_tiny(folder, res, seed, labels, contract=False, **options) -> (result, checkpoint)`: a 2-block Ti/16 at
    `res` with random non-trivial weights and `labels` (`save_tiny_`), saved as folder/tiny.safetensors, then
    `vit_export.export(checkpoint, ExportOptions(**options))` on one torch thread."""
    import vit_export

    def export(folder: Path, res: int | tuple[int, int], seed: int, labels: list[str], contract: bool = False,
               **options: Any) -> tuple[ExportResult, Path]:
        ckpt = save_tiny_(folder / "tiny.safetensors", res, seed, labels, contract=contract)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return vit_export.export(ckpt, vit_export.ExportOptions(**options), progress=print), ckpt
        finally:
            torch.set_num_threads(threads)

    return export


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def redis_server(folder: Path, *args: str, password: str | None = None,
                 requirepass: bool = True) -> Iterator[tuple[str, Any]]:
    """Debian's redis-server with `args` on a free local port, and a client, stopped on exit; skips the test when
    there is none. `password`: started with `--requirepass PASSWORD` (the client authenticates; the URL yielded
    carries no password); with `requirepass=False` the server's own `args` (a config file) set it, and only the
    client is given it."""
    exe = shutil.which("redis-server")
    if exe is None:
        print("skipped: redis-server is not on PATH (Debian: apt-get install redis-server)")
        pytest.skip("redis-server is not on PATH (Debian: apt-get install redis-server)")
    redis = pytest.importorskip("redis")
    port = _free_port()
    auth = ("--requirepass", password) if password is not None and requirepass else ()
    proc = subprocess.Popen([exe, *args, *auth, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    client = redis.Redis(port=port, password=password)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server {' '.join(args)} did not start: "
                                       f"{proc.stderr.read().decode()}") from None
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0", client
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory) -> Iterator[str]:
    """A real redis-server on a free port (no persistence), stopped after the module: the shared explain store
    (tests/serve/test_stores.py, tests/deploy/test_ray_serve.py)."""
    with redis_server(tmp_path_factory.mktemp("redis"), "--save", "", "--appendonly", "no") as (url, _):
        yield url


@pytest.fixture(scope="session")
def start_redis() -> Callable[..., Any]:
    """`redis_server` for tests that start one with their own arguments: `with start_redis(folder, *args,
    password=None) as (url, client):`."""
    return redis_server


REDIS_PASSWORD = "redis-test-password-0123456789"  # a test server's, on 127.0.0.1


@pytest.fixture(scope="module")
def redis_with_password(tmp_path_factory) -> Iterator[tuple[str, str, Any]]:
    """A real redis-server started with `--requirepass` (no persistence), stopped after the module: (URL without
    the password, the password, an authenticated redis-py client)."""
    with redis_server(tmp_path_factory.mktemp("redis"), "--save", "", "--appendonly", "no",
                      password=REDIS_PASSWORD) as (url, client):
        yield url, REDIS_PASSWORD, client


@contextmanager
def ready_test_client(settings: Any) -> Iterator[Any]:
    """Starlette's TestClient over the app of `settings`, once every model is warmed up: the lifespan returns
    when the models are loaded, and the warm-up runs on in the background (LOADING, /readyz 503 until then)."""
    from fastapi.testclient import TestClient

    from vit_serve.serve.app import create_app

    with TestClient(create_app(settings)) as client:
        client.portal.call(client.app.state.gateway.wait_ready, 60)
        yield client


@pytest.fixture(scope="session")
def ready_client() -> Callable[..., Any]:
    """`ready_test_client` for tests outside tests/serve: `with ready_client(settings) as client:`."""
    return ready_test_client


@pytest.fixture
def http_stub() -> Iterator[Callable[..., HttpStub]]:
    """Start local HTTP servers in threads (tests/http_stub.py): `http_stub(respond, port=0)` is one, serving
    `respond(request) -> (status, content type, body)`; each is closed after the test."""
    stubs: list[HttpStub] = []

    def start(respond: Respond, port: int = 0) -> HttpStub:
        stubs.append(HttpStub(respond, port))
        return stubs[-1]

    yield start
    for stub in stubs:
        stub.close()


KSERVE_ENV = "VIT_SERVE_KSERVE_PYTHON"


@pytest.fixture(scope="session")
def kserve_python() -> str:
    """A python with KServe's SDK (it pins its own web stack, so .ci/run gives it its own venv, named by
    VIT_SERVE_KSERVE_PYTHON): a set but broken variable fails the test; no SDK anywhere skips it."""
    named = os.environ.get(KSERVE_ENV)
    if named:
        if not Path(named).is_file():
            pytest.fail(f"{KSERVE_ENV}={named} is not a file")
        check = subprocess.run([named, "-c", "import kserve, kubernetes"], capture_output=True, text=True)
        if check.returncode != 0:
            pytest.fail(f"{KSERVE_ENV}={named} cannot import kserve: {check.stderr.strip()[-500:]}")
        return named
    if importlib.util.find_spec("kserve") is not None:
        return sys.executable
    pytest.skip(f"KServe's SDK is not installed: set {KSERVE_ENV} to a python that has it (python3 -m venv V && "
                f"V/bin/pip install kserve numpy pillow; .ci/run does this)")


UPLOAD_CORPUS_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "upload_corpus.py"


@pytest.fixture(scope="session")
def upload_corpus(request, tmp_path_factory) -> Callable[..., dict[str, bytes]]:
    """`build(names=...)` -> {name: bytes} of benchmarks/upload_corpus.py's realistic uploads (all by default). The
    corpus is deterministic, so it is kept in pytest's cache under a key of Pillow's version and the builder's
    source; with the cache plugin off (`-p no:cacheprovider`) it is built in this session's temp folder."""
    import hashlib

    from PIL import Image

    spec = importlib.util.spec_from_file_location("upload_corpus", UPLOAD_CORPUS_SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    key = hashlib.sha256(UPLOAD_CORPUS_SCRIPT.read_bytes() + Image.__version__.encode()).hexdigest()[:12]
    cache = getattr(request.config, "cache", None)
    folder = cache.mkdir(f"upload_corpus_{key}") if cache is not None else tmp_path_factory.mktemp("upload_corpus")

    def build(names: tuple[str, ...] = mod.NAMES) -> dict[str, bytes]:
        return {name: path.read_bytes() for name, path in mod.build(folder, names).items()}

    return build
