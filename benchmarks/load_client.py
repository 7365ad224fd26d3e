"""The benchmarks' clients: the uploads they send and concurrent closed-loop clients over real HTTP.

Every request carries a different image unless asked otherwise: a JPEG made unique by a numbered comment segment
(`unique_jpeg`, as `vit-serve tune`'s uploads: other bytes and another sha256, the same pixels and decode work),
built before a level's clock starts (`payloads`). `load` sends them from `concurrency` clients and returns the
level (`Load`: latencies, batch sizes, the server's stage split from `Server-Timing`, its CPU per request).
"""

from __future__ import annotations

import asyncio
import io
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

# ---- the images ---------------------------------------------------------------------------------------------

def photo_jpeg() -> bytes:
    """A real photo as JPEG bytes (scikit-image's chelsea, 451x300), or a smooth synthetic image without it."""
    try:
        from skimage import data

        arr = data.chelsea()
    except ImportError:
        yy, xx = np.mgrid[0:300, 0:451]
        arr = np.stack([xx * 255 // 451, yy * 255 // 300, (xx + yy) * 255 // 751], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def phone_jpegs(folder: Path) -> list[bytes]:
    """The corpus's 12 MP phone JPEGs (benchmarks/upload_corpus.py, built into `folder` or reused from it)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import upload_corpus

    paths = upload_corpus.build(folder, upload_corpus.PHONE_NAMES)
    return [paths[n].read_bytes() for n in upload_corpus.PHONE_NAMES]


def unique_jpeg(jpeg: bytes, i: int) -> bytes:
    """`jpeg` with a comment segment "serve_load <i>" after its SOI and APPn segments (JFIF / EXIF stay first):
    other bytes and another sha256 for every i, the same pixels and the same decode work (`vit-serve tune`'s
    uploads, `vit_serve.tune.load.unique_jpeg`)."""
    from vit_serve.tune.load import unique_jpeg as tagged

    return tagged(jpeg, i, "serve_load")


def payloads(bases: list[bytes], start: int, n: int, repeats: int = 1) -> list[bytes]:
    """Request bodies start .. start + n - 1: image k = index // repeats, made unique by k and cycling through
    `bases`, so each image is sent `repeats` times in a row (1: every request a different image)."""
    return [unique_jpeg(bases[k % len(bases)], k) for k in ((start + j) // repeats for j in range(n))]



# ---- the client --------------------------------------------------------------------------------------------

STAGES = ("read", "decode_wait", "decode", "queue", "infer", "response")


def server_timing(header: str) -> dict[str, float]:
    """A `Server-Timing` header ("read;dur=1.2, decode;dur=30.5, ...") -> {name: ms}."""
    out = {}
    for metric in header.split(","):
        name, *params = (p.strip() for p in metric.split(";"))
        for p in params:
            if p.startswith("dur="):
                out[name] = float(p[4:])
    return out


def stage_split(latency_ms: float, timing: dict[str, float]) -> dict[str, float]:
    """One request's latency (client side, ms) -> ms per stage (STAGES): the server's read, decode wait, decode +
    preprocess, queue and inference, and "response", the rest (HTTP both ways, JSON, the event loop), so that
    the stages sum to the latency."""
    split = {k: timing.get(k, 0.0) for k in STAGES[:-1]}
    split["response"] = latency_ms - sum(split.values())
    return split


@dataclass
class Load:
    """One load level: latencies (s), wall time (s), and per request the server's batch size, model time (ms) and
    stage split (ms, `stage_split`; empty for PNG answers), and the images' ids (sha256); `cpu_ms`: the server's
    CPU time per measured request (all its threads; NaN when not measured)."""

    latencies: np.ndarray
    wall_s: float
    batch_sizes: np.ndarray
    infer_ms: np.ndarray
    stages: dict[str, np.ndarray]
    ids: list[str]
    cpu_ms: float = float("nan")

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.wall_s

    def p(self, q: float) -> float:
        return float(np.percentile(self.latencies, q) * 1e3)

    @property
    def mean_batch(self) -> float:
        return float(self.batch_sizes.mean()) if len(self.batch_sizes) else float("nan")

    @property
    def mean_infer_ms(self) -> float:
        return float(self.infer_ms.mean()) if len(self.infer_ms) else float("nan")

    def stage_ms(self, stage: str) -> float:
        v = self.stages.get(stage, np.array([]))
        return float(v.mean()) if len(v) else float("nan")


async def load(url: str, path: str, bodies: list[bytes], concurrency: int, warmup: int,
               server_cpu_s: Callable[[], float] | None = None, headers: dict[str, str] | None = None,
               failures: Counter[int] | None = None) -> Load:
    """POSTs of `bodies` (in order, each once) to `path` from `concurrency` concurrent clients; the first `warmup`
    are sent before the clock starts and not measured. `server_cpu_s`: the server's CPU clock (`Server.cpu_s`),
    read around the measured requests. An answer other than 200 raises, or with `failures` is counted there by
    status (and left out of the Load's answers)."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=300.0, headers=headers) as client:

        async def one(body: bytes) -> tuple[float, dict | None] | None:
            t0 = time.perf_counter()
            r = await client.post(path, files={"file": ("photo.jpg", body, "image/jpeg")})
            dt = time.perf_counter() - t0
            if r.status_code != 200 and failures is not None:
                failures[r.status_code] += 1
                return None
            if r.status_code != 200:
                raise RuntimeError(f"POST {path} answered {r.status_code}: {r.text[:300]}")
            if r.headers.get("content-type", "").startswith("application/json"):
                answer = r.json()
                answer["server_timing"] = server_timing(r.headers.get("server-timing", ""))
                return dt, answer
            return dt, None

        async def run(batch: list[bytes]) -> tuple[list[tuple[float, dict | None]], float]:
            out: list[tuple[float, dict | None]] = []
            it = iter(batch)

            async def worker() -> None:
                for body in it:  # one shared iterator: every client takes the next body when it is free
                    if (answer := await one(body)) is not None:
                        out.append(answer)

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(min(concurrency, len(batch)))))
            return out, time.perf_counter() - t0

        await run(bodies[:warmup])
        cpu0 = server_cpu_s() if server_cpu_s else float("nan")
        results, wall = await run(bodies[warmup:])
        cpu_s = (server_cpu_s() if server_cpu_s else float("nan")) - cpu0
    lat = np.array([d for d, _ in results])
    answers = [(d, a) for d, a in results if a is not None]
    sizes = np.array([a["timing_ms"]["batch_size"] for _, a in answers])
    infer = np.array([a["timing_ms"]["infer"] for _, a in answers])
    splits = [stage_split(d * 1e3, a["server_timing"]) for d, a in answers if a["server_timing"]]
    stages = {k: np.array([sp[k] for sp in splits]) for k in STAGES} if splits else {}
    return Load(lat, wall, sizes, infer, stages, [a["id"] for _, a in answers], cpu_s * 1e3 / len(lat))


def level_sizes(requests: int, c: int) -> tuple[int, int]:
    """(warm-up, measured) requests of one load level: every client sends at least twice, and warms up once."""
    return max(c, requests // 10), max(requests, 2 * c)


def check_unique(lv: Load, repeats: int) -> None:
    if repeats == 1 and len(set(lv.ids)) != len(lv.ids):
        raise RuntimeError(f"{len(lv.ids) - len(set(lv.ids))} of {len(lv.ids)} answers repeat an image id")


def num(v: float) -> str:
    return "" if np.isnan(v) else f"{v:.2f}"
