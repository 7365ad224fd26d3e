"""`vit-serve tune`'s measurements: the images (uploads and agreement checks), one gateway per trial, and
concurrent clients over real HTTP.

Every upload is a different file: a JPEG made unique by a comment segment (`unique_jpeg`: other bytes and
another sha256 each time, the same pixels and decode work), so that no cache and no deduplication can flatter
a trial. A trial's gateway is `vit-serve serve --config TRIAL.toml` as a process of its own (`TrialServers`, on
`server_process.ServerProcess`), forked from a server process that has imported the gateway once, so that a
trial pays for loading its model but not for importing torch again. The clients are `concurrency` closed loops
in this process (httpx, asyncio), each sending the next upload as soon as its answer came (POST /classify, the
image as the body).
"""

from __future__ import annotations

import asyncio
import io
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vit_serve.data import find_images
from vit_serve.tune.server_process import ServerExitedError, ServerProcess, free_port

Tick = Callable[[], None]
# The built-in photos: scikit-image's (when it is installed) and matplotlib's grace_hopper.
SKIMAGE_PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "cat", "hubble_deep_field", "immunohistochemistry",
                  "retina")
JPEG_QUALITY = 90
# Views of each built-in photo in the agreement check set: (left, top, right, bottom) fractions, mirrored.
CHECK_VIEWS: tuple[tuple[tuple[float, float, float, float], bool], ...] = (
    ((0, 0, 1, 1), False), ((0, 0, 1, 1), True), ((0, 0, 0.7, 0.7), False), ((0.3, 0, 1, 0.7), False),
    ((0, 0.3, 0.7, 1), False), ((0.3, 0.3, 1, 1), False), ((0.2, 0.2, 0.8, 0.8), False), ((0.2, 0.2, 0.8, 0.8), True))


# The variable that turns the load-time runtime choice off (vit_serve.runtime.runtime_choice), and its value: a
# trial serves the runtime it names.
NO_RUNTIME_CHOICE = ("VIT_SERVE_CHOOSE_RUNTIME", "false")


class TrialError(RuntimeError):
    """A trial's gateway did not start (its log's last line says why), or the budget ran out first."""


# ---- images --------------------------------------------------------------------------------------------------

def sample_photos() -> dict[str, Image.Image]:
    """The built-in photos (RGB, native sizes 300x451 to 1411x1411): matplotlib's grace_hopper, and scikit-image's
    sample photos when it is installed. OSError when neither library is there."""
    out: dict[str, Image.Image] = {}
    try:
        import skimage.data

        for name in SKIMAGE_PHOTOS:
            out[name] = Image.fromarray(getattr(skimage.data, name)()).convert("RGB")
    except ImportError:
        pass
    try:
        from matplotlib import cbook

        with cbook.get_sample_data("grace_hopper.jpg") as f:
            out["grace_hopper"] = Image.open(f).convert("RGB")
    except ImportError:
        pass
    if not out:
        raise OSError("the built-in images need matplotlib or scikit-image (pip install matplotlib); or pass a "
                      "folder of images")
    return out


def _jpeg(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.convert("RGB").save(buf, "JPEG", quality=JPEG_QUALITY)
    return buf.getvalue()


def upload_bases(folder: str | os.PathLike[str] | None) -> list[bytes]:
    """The JPEGs uploads are made from: the files of `folder` (JPEGs as they are, other formats re-encoded as
    JPEG q90, since `unique_jpeg` needs a JPEG), or the built-in photos as JPEG q90."""
    if folder is None:
        return [_jpeg(img) for img in sample_photos().values()]
    out = []
    for path in find_images(folder):
        data = path.read_bytes()
        if data[:2] != b"\xff\xd8":
            with Image.open(io.BytesIO(data)) as img:
                data = _jpeg(img)
        out.append(data)
    return out


def check_images(folder: str | os.PathLike[str] | None) -> list[Image.Image | Path]:
    """The images agreement is measured on: the files of `folder`, or eight views (the whole, four corners, the
    centre, two mirrored) of each built-in photo."""
    if folder is not None:
        return list(find_images(folder))
    out: list[Image.Image | Path] = []
    for img in sample_photos().values():
        for (x0, y0, x1, y1), mirror in CHECK_VIEWS:
            view = img.crop((round(x0 * img.width), round(y0 * img.height), round(x1 * img.width),
                             round(y1 * img.height)))
            out.append(view.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if mirror else view)
    return out


def unique_jpeg(jpeg: bytes, i: int, tag: str = "vit-serve tune") -> bytes:
    """`jpeg` with a comment segment "<tag> <i>" after its SOI and APPn segments (JFIF / EXIF stay first)."""
    if jpeg[:2] != b"\xff\xd8":
        raise ValueError("not a JPEG (no SOI marker)")
    pos = 2
    while pos + 4 <= len(jpeg) and jpeg[pos] == 0xFF and 0xE0 <= jpeg[pos + 1] <= 0xEF:
        pos += 2 + int.from_bytes(jpeg[pos + 2:pos + 4], "big")
    text = f"{tag} {i}".encode()
    return b"".join((jpeg[:pos], b"\xff\xfe", (len(text) + 2).to_bytes(2, "big"), text, jpeg[pos:]))


# ---- the gateway of a trial ------------------------------------------------------------------------------------

def _serve(config: str, port: int, log: str) -> None:
    """A trial's gateway process: `vit-serve serve --config CONFIG` on 127.0.0.1:PORT (no drain on SIGTERM), its
    output into `log`, the caller's VIT_SERVE_* variables ignored (a trial runs what its file says), and the
    load-time runtime choice off (a trial serves the runtime it names)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    for k in list(os.environ):
        if k.upper().startswith("VIT_SERVE_"):
            del os.environ[k]
    os.environ[NO_RUNTIME_CHOICE[0]] = NO_RUNTIME_CHOICE[1]
    from vit_serve.runtime import LoadSpec, check
    from vit_serve.serve.app import run
    from vit_serve.serve.config_file import serve_settings

    try:
        settings = serve_settings(config, {"host": "127.0.0.1", "port": port, "shutdown_drain_s": 0.0})
        check(LoadSpec.of(settings))
    except (ValueError, OSError) as e:
        print(f"vit-serve serve: error: {' '.join(str(e).split())}", flush=True)
        sys.exit(1)
    run(settings)


class TrialServers:
    """Starts trial gateways (`serve`) from a fork server that imported the gateway and the runtimes once
    (multiprocessing's forkserver; spawn where there is none)."""

    PRELOAD = ("vit_serve.serve.app", "vit_serve.serve.config_file", "vit_serve.runtime.backends.torch",
               "vit_serve.runtime.backends.onnxruntime")

    def __init__(self) -> None:
        methods = multiprocessing.get_all_start_methods()
        self.ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        if self.ctx.get_start_method() == "forkserver":
            self.ctx.set_forkserver_preload(list(self.PRELOAD))

    def warm(self) -> None:
        """Start the fork server now (it imports torch once: seconds), rather than in the first trial."""
        p = self.ctx.Process(target=int, daemon=True)
        p.start()
        p.join()

    @contextmanager
    def serve(self, config: Path, log: Path, deadline: float, tick: Tick = lambda: None) -> Iterator[str]:
        """The gateway of `config` on a free port until the block ends; yields its URL once /readyz answers 200.
        TrialError when it exits first, or is not ready by `deadline` (time.monotonic())."""
        port = free_port()
        proc = self.ctx.Process(target=_serve, args=(str(config), port, str(log)), daemon=True)
        proc.start()
        server = ServerProcess(proc, port)
        try:
            try:
                server.wait_ready(deadline - time.monotonic(), tick=tick)
            except ServerExitedError:
                raise TrialError(f"the gateway exited ({server.exitcode}): {last_line(log)}") from None
            except TimeoutError:
                raise TrialError("the budget ran out while the gateway was starting") from None
            yield server.url
        finally:
            server.stop(15)


def last_line(log: Path) -> str:
    """The last non-empty line of a log (a reason to show), or ''."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


# ---- the clients -----------------------------------------------------------------------------------------------

@dataclass
class Measurement:
    """What one trial measured: answered requests, failures (by HTTP status, 0 for no answer), the measured
    window (s), latencies (ms) and the batch sizes the gateway reports."""

    latencies_ms: list[float]
    wall_s: float
    errors: dict[int, int] = field(default_factory=dict)
    batch_sizes: list[int] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return len(self.latencies_ms)

    @property
    def throughput(self) -> float:
        """Answered images per second."""
        return self.requests / self.wall_s if self.wall_s > 0 else 0.0

    def p(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else float("nan")

    @property
    def mean_batch(self) -> float:
        return float(np.mean(self.batch_sizes)) if self.batch_sizes else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "images_per_s": self.throughput, "p50_ms": self.p(50),
                "p90_ms": self.p(90), "p99_ms": self.p(99), "max_ms": max(self.latencies_ms, default=float("nan")),
                "mean_batch": self.mean_batch, "wall_s": self.wall_s,
                "errors": {str(k): v for k, v in self.errors.items()},
                "latencies_ms": [round(x, 1) for x in self.latencies_ms]}


class Uploads:
    """Unique uploads from `bases`, numbered across every trial of a run."""

    def __init__(self, bases: list[bytes], tag: str = "vit-serve tune") -> None:
        self.bases, self.tag, self.count = bases, tag, 0

    def next(self) -> bytes:
        i, self.count = self.count, self.count + 1
        return unique_jpeg(self.bases[i % len(self.bases)], i, self.tag)


async def _drive(url: str, uploads: Uploads, concurrency: int, warmup: int, seconds: float, tick: Tick
                 ) -> Measurement:
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = {"Content-Type": "image/jpeg"}
    out = Measurement([], 0.0)
    state = {"warm": 0, "start": 0.0, "end": 0.0, "last": 0.0}
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60.0) as client:

        async def one(measured: bool) -> None:
            t0 = time.perf_counter()
            try:
                r = await client.post("/classify", content=uploads.next(), headers=headers)
                status = r.status_code
            except httpx.HTTPError:
                status = 0
            t1 = time.perf_counter()
            if not measured:
                return
            if status != 200:
                out.errors[status] = out.errors.get(status, 0) + 1
                return
            out.latencies_ms.append((t1 - t0) * 1e3)
            out.batch_sizes.append(int(r.json().get("timing_ms", {}).get("batch_size", 0)))
            state["last"] = t1

        async def client_loop() -> None:
            while state["warm"] < warmup:
                state["warm"] += 1
                await one(False)
            while not state["start"]:
                await asyncio.sleep(0.005)
            while time.perf_counter() < state["end"]:
                await one(True)

        async def clock() -> None:
            while state["warm"] < warmup:
                await asyncio.sleep(0.02)
                tick()
            await asyncio.sleep(0.05)  # the warm-up requests still in flight finish
            state["start"] = time.perf_counter()
            state["end"] = state["start"] + seconds
            while time.perf_counter() < state["end"]:
                await asyncio.sleep(0.25)
                tick()

        await asyncio.gather(clock(), *(client_loop() for _ in range(concurrency)))
    out.wall_s = max(state["last"], state["end"]) - state["start"]
    return out


def measure(url: str, uploads: Uploads, concurrency: int, seconds: float, warmup: int | None = None,
            tick: Tick = lambda: None) -> Measurement:
    """`concurrency` clients POSTing unique uploads to `url`/classify: `warmup` requests (default two per
    client) unmeasured, then every request started in the next `seconds` measured."""
    warm = 2 * concurrency if warmup is None else warmup
    return asyncio.run(_drive(url, uploads, concurrency, warm, seconds, tick))
