"""Serving load benchmark: the FastAPI gateway on the onnxruntime backend under concurrent clients.

One real uvicorn server per configuration in a subprocess, an asyncio + httpx client in this process. Every
request carries a different image (distinct bytes, so distinct sha256: the gateway's crop store, which keys by
it, never answers for the decoder), unless `--repeats K` sends each image K times to measure the store.

`--mode uploads` (the default): real uploads, the decode paths side by side in one run.

* Two servers, `--decode fast` and `--decode exact`; against each, `--corpus phone` (12 MP JPEGs of
  benchmarks/upload_corpus.py) and `--corpus small` (a 451x300 photo), each at concurrency 1, 16 and 64;
* per load level images/s, p50 / p99 latency, and the time per request split into read (receiving and hashing
  the body), decode wait (for a decode thread), decode + preprocess, queue (for the batch), inference and
  response (the rest of the client's latency: HTTP, JSON, the event loop), from the server's `Server-Timing`;
* the server's memory peak (VmHWM of /proc/PID/status) after each level, against the ceiling its settings put
  on it (`memory_ceiling`).

Checks (at concurrency 16): phone fast / exact >= 2.5x; phone fast >= 0.75x small fast; small fast / exact
>= 0.95 (no slower than the exact path, within run-to-run noise); the memory peak of 64 concurrent 12 MP uploads
below the settings' ceiling, on both paths.

`--mode routing`: the single-model gateway (MODEL: the export) against a gateway serving a repository of three
copies of it, each request routed with `?model=b`, both with the same intra-op threads, taking turns for
`--rounds` rounds (default 5) of unique small photos at concurrency 16. Check: the repository's median images/s
>= 0.98x the single model's (routing by model costs at most 2%).

`--mode security`: the same export served with API keys and request ids off, and with both on (each request
sends its key and an X-Request-ID, which the server echoes and logs), taking turns as above. Checks: on >= 0.98x
off in images/s and <= 1.02x in server CPU per image, and the two middleware measured alone (the real ApiKeys
and RequestId classes around an app that answers at once, the access line formatted as the server logs it) cost
<= 2% of the server's CPU per image.

`--mode batching` (benchmarks/serve_batching.py): dynamic batching on (max_batch 16, max_delay_ms 5, the batch
curve measured at warm-up) and off (max_batch 1), both servers alive and taking turns for `--rounds` rounds
(default 3) at concurrency 1, 4, 16 and 64 with unique small photos, against the backend's offline throughput
(`onnxruntime` `session.run` on preprocessed batches at batch 1 and at the batch the server reached at c=16), the
gateway's CPU per image by thread at c=16, and explain vs classify latency (one client). Checks: throughput at
c=16 >= 0.90x offline; batching on / off >= 0.98x at every concurrency; p50 at c=1 on - off <= max_delay_ms;
explain p50 <= 2x classify p50.

`--mode abuse` (benchmarks/serve_abuse.py): normal traffic alone and beside abusive requests (the /v2 bombs of
the last round, labels x templates, random-unicode labels, duplicate key headers) and stalled uploads, against
one gateway with its default bounds and keys on. Checks: normal images/s beside the abuse >= 0.8x alone; peak
RSS within the settings' ceiling; no 5xx; every abusive request answered as its kind expects.

`--mode faults` (benchmarks/serve_faults.py, its own flags): normal traffic at c=16 while redis-server and
tritonserver are killed and restarted, the sample folder's disk fills and SIGTERM comes during a hot reload; per
fault 2xx, expected 503s, other 5xx (0), lost requests (0), recovery time and RSS.

`--mode lifecycle` (benchmarks/serve_lifecycle.py, its own flags and defaults: ViT-S/16 at 224 on the torch
backend, max batch 8): every request accounted for, against today's gateway (commit 60e39d4) in the same run: 48
clients hanging up 0.3 s after their upload (images the model still ran for them, vit_serve_cancelled_total by
stage), a retry storm at 4x capacity (clients with a 1 s timeout sending X-Request-Timeout-Ms, retrying at once:
goodput / capacity), two API keys at priorities 1 and 2 (the urgent key's p99 beside the other at 2x capacity /
alone) and a shadow version at 100% (primary p50 with headroom, images/s and shadow copies dropped at overload).

Unique images cost nothing in the measured window: a JPEG is made unique by a numbered comment segment (COM)
inserted after its APPn segments (`unique_jpeg`), which leaves its pixels and its decode cost as they are; each
level's payloads are built before its clock starts and freed after it (at most requests + warm-up of them, e.g.
192 x 1.5 MB for 64 clients of phone photos).

The model is a randomly initialised ViT (`--model`, default Ti/16 at `--res 224`, 1000 ImageNet classes) exported
with `vit_export.export` into `--out` (or an existing export reused with `--export`).

    # the uploads targets (ViT-Ti/16 at 224, onnxruntime, a 2-core CPU; about 6 minutes):
    python benchmarks/serve_load.py --mode uploads --model Ti/16 --res 224 --requests 96 --out /tmp/serve_uploads
    # routing by model against the single-model gateway (about 3 minutes):
    python benchmarks/serve_load.py --mode routing --requests 96 --out /tmp/serve_routing
    # API keys and request ids on against off (about 3 minutes):
    python benchmarks/serve_load.py --mode security --requests 96 --out /tmp/serve_security
    # abusive requests beside normal traffic (about 2 minutes):
    python benchmarks/serve_load.py --mode abuse --out /tmp/serve_abuse
    # dynamic batching (the README's batching table):
    python benchmarks/serve_load.py --mode batching --model S/16 --res 224 --requests 256 --out /tmp/serve_load
    # the crop store: each image sent 8 times
    python benchmarks/serve_load.py --mode uploads --corpus phone --repeats 8 --out /tmp/serve_repeats
    # on a GPU (onnxruntime's CUDA provider):
    python benchmarks/serve_load.py --mode batching --device cuda --requests 2048 --out /tmp/serve_load_cuda
    # hang-ups, retry storm, priorities per key, shadow traffic, against commit 60e39d4 (about 15 minutes):
    python benchmarks/serve_load.py --mode lifecycle --out /tmp/serve_lifecycle
    # a smoke run (a minute on two cores):
    python benchmarks/serve_load.py --model Ti/16 --res 64 --requests 40 --concurrency 1,16 --out /tmp/smoke

Exit status: 0 when every check passes, 1 when one fails (the table is printed either way).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

CONCURRENCY = (1, 4, 16, 64)


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


# ---- the model ---------------------------------------------------------------------------------------------

def export_model(arch: str, res: int, out: Path) -> Path:
    """A random-weight `arch` checkpoint at `res`, exported by vit-export into out/export; returns model.onnx."""
    import torch
    import vit_export

    import vit_serve

    onnx = out / "export" / "model.onnx"
    if onnx.is_file():
        print(f"reusing {onnx}", file=sys.stderr)
        return onnx
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "model.safetensors"
    if not ckpt.is_file():
        torch.manual_seed(0)
        vit_serve.save(vit_serve.create_model(arch, num_classes=1000, img_size=res), ckpt)
    result = vit_export.export(ckpt, vit_export.ExportOptions(res=res, out=onnx.parent, name="model"),
                               progress=lambda msg: print(msg, file=sys.stderr))
    if not result.ok:
        raise SystemExit(f"the export of {ckpt} failed its parity checks (tables above)")
    return result.onnx


def find_onnx(path: Path) -> Path:
    """An export folder's one logits graph (NAME.onnx beside NAME_explain.onnx), or the .onnx file given."""
    if path.is_file():
        return path
    graphs = sorted(p for p in path.glob("*.onnx") if not p.stem.endswith("_explain"))
    if len(graphs) != 1:
        raise SystemExit(f"--export {path}: expected one NAME.onnx there, found {[g.name for g in graphs] or 'none'}")
    return graphs[0]


# ---- the server --------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`vit-serve`'s gateway under uvicorn in a subprocess, configured through its VIT_SERVE_* variables (`env`:
    more of them, e.g. {"VIT_SERVE_DECODE": "fast"})."""

    def __init__(self, onnx: Path, threads: int | None, device: str, max_batch: int, max_delay_ms: float,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ,
               "VIT_SERVE_MODEL": str(onnx), "VIT_SERVE_BACKEND": "onnxruntime", "VIT_SERVE_DEVICE": device,
               "VIT_SERVE_MAX_BATCH": str(max_batch), "VIT_SERVE_MAX_DELAY_MS": str(max_delay_ms),
               "VIT_SERVE_MAX_QUEUE": "1024", "VIT_SERVE_HOST": "127.0.0.1", "VIT_SERVE_PORT": str(self.port),
               **({"VIT_SERVE_THREADS": str(threads)} if threads else {}), **(env or {})}
        # uvicorn as `vit-serve serve` configures it (server_config: header timeout, connection cap, half-close)
        code = ("import json, sys, uvicorn\n"
                "from vit_serve.serve.app import create_app, server_config\n"
                "from vit_serve.serve.settings import ServeSettings\n"
                "s = ServeSettings()\n"
                "print('SETTINGS ' + s.model_dump_json(), file=sys.stderr, flush=True)\n"
                "config = server_config(create_app(s), s, host=s.host, port=s.port, log_level='warning')\n"
                "uvicorn.Server(config).run()\n")
        self.proc = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
        self.settings: dict = {}

    def wait_ready(self, timeout: float = 300.0) -> dict:
        if not self.settings:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:  # the settings line, after whatever the runtimes warn at import
                if line.startswith("SETTINGS "):
                    dump = json.loads(line.removeprefix("SETTINGS "))
                    # the groups' fields (limits, security, ...) by their flat names too, as VIT_SERVE_* names them
                    self.settings = {**dump, **{k: v for group in dump.values() if isinstance(group, dict)
                                                for k, v in group.items()}}
                    break
                sys.stderr.write(line)
            else:
                raise RuntimeError(f"the server exited with status {self.proc.wait()} before it started")
            # the rest of its stderr goes to ours, so that it never blocks on a full pipe
            self._relay = threading.Thread(target=lambda: [sys.stderr.write(ln) for ln in self.proc.stderr],
                                           daemon=True)
            self._relay.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode}")
            try:
                r = httpx.get(f"{self.url}/readyz", timeout=2.0)
                if r.status_code == 200:
                    return r.json()
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server at {self.url} was not ready after {timeout:.0f} s")

    def cpu_s(self) -> float:
        """CPU time (user + system, s) the server process has used so far (Linux; NaN elsewhere)."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def memory_mb(self) -> tuple[float, float]:
        """(VmRSS, VmHWM) of the server process in MB (Linux; NaN elsewhere)."""
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return float("nan"), float("nan")
        kb = {ln.split(":")[0]: int(ln.split()[1]) for ln in status.splitlines() if ln.startswith(("VmRSS", "VmHWM"))}
        return kb.get("VmRSS", float("nan")) / 1024, kb.get("VmHWM", float("nan")) / 1024

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Server:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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


# ---- offline -----------------------------------------------------------------------------------------------

def offline_throughput(onnx: Path, image: bytes, batch: int, threads: int, device: str, seconds: float,
                       spinning: bool = False) -> float:
    """Images/s of `session.run` on a preprocessed [batch, 3, H, W] batch, with the gateway's own session options
    (`session_options`: `threads` intra-op threads, intra-op spinning as `spinning`)."""
    import onnxruntime as ort

    from vit_serve.preprocess import PreprocessConfig, preprocess
    from vit_serve.runtime.backends.onnxruntime import session_options

    side = json.loads(onnx.with_suffix(".json").read_text())
    cfg = PreprocessConfig.from_dict(side["preprocess"])
    x = preprocess(image, cfg).numpy()[None].repeat(batch, 0)
    opts = session_options(threads, spinning)
    cuda = device != "cpu" and "CUDAExecutionProvider" in ort.get_available_providers()
    if device == "cuda" and not cuda:
        raise SystemExit("--device cuda: this onnxruntime has no CUDAExecutionProvider")
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if cuda else ["CPUExecutionProvider"]
    sess = ort.InferenceSession(str(onnx), opts, providers=providers)
    for _ in range(3):
        sess.run(["logits"], {"pixel_values": x})
    n, t0 = 0, time.perf_counter()
    while n < 5 or time.perf_counter() - t0 < seconds:
        sess.run(["logits"], {"pixel_values": x})
        n += 1
    return n * batch / (time.perf_counter() - t0)


# ---- the report --------------------------------------------------------------------------------------------

# Two paths that should cost the same: equal within the run-to-run noise of two separate server runs (5%).
SAME_PATH_SLACK = 0.95

# The uploads targets (issue: real uploads), all at concurrency 16.
PHONE_FAST_OVER_EXACT = 2.5
PHONE_OVER_SMALL = 0.75
UPLOADS_C = 16


def upload_checks(tp: dict[tuple[str, str, int], float], c: int = UPLOADS_C) -> list[tuple[str, str, str, bool]]:
    """Images/s by (decode, corpus, concurrency) -> (check, value, target, passed) rows of the uploads targets."""
    checks = []
    if ("fast", "phone", c) in tp and ("exact", "phone", c) in tp:
        r = tp["fast", "phone", c] / tp["exact", "phone", c]
        checks.append((f"12 MP uploads, fast / exact decode (c={c})", f"{r:.2f}", f">= {PHONE_FAST_OVER_EXACT:g}",
                       r >= PHONE_FAST_OVER_EXACT))
    if ("fast", "phone", c) in tp and ("fast", "small", c) in tp:
        r = tp["fast", "phone", c] / tp["fast", "small", c]
        checks.append((f"fast decode, 12 MP uploads / small photos (c={c})", f"{r:.2f}", f">= {PHONE_OVER_SMALL:g}",
                       r >= PHONE_OVER_SMALL))
    if ("fast", "small", c) in tp and ("exact", "small", c) in tp:
        r = tp["fast", "small", c] / tp["exact", "small", c]
        checks.append((f"small photos, fast / exact decode (c={c})", f"{r:.2f}",
                       f">= {SAME_PATH_SLACK:.2f} (no slower, within run-to-run noise)", r >= SAME_PATH_SLACK))
    return checks


def memory_ceiling(idle_mb: float, settings: dict, concurrency: int, input_hw: tuple[int, int]) -> float:
    """The most memory (MB) the server's settings let `concurrency` uploads take above its idle RSS.

    * bodies being read: each at most max_body_bytes, twice (the parser's buffers and the joined bytes), one per
      connection (how many connections is the client's, or uvicorn's --limit-concurrency, not a gateway setting);
    * decodes: decode_workers threads, each one full-size decode of at most max_pixels, RGB, plus one
      intermediate of that size (the fast path's are much smaller: the JPEG is decoded at 1/2 to 1/8 scale);
    * model inputs waiting: max_queue float32 [3, H, W] tensors, and the store: store_size RGB H x W crops
      (`input_hw`, the model's input).
    """
    pixels = input_hw[0] * input_hw[1]
    body = 2 * settings["max_body_bytes"] * concurrency
    decode = settings["decode_workers"] * 2 * 3 * settings["max_pixels"]
    queue = settings["max_queue"] * 4 * 3 * pixels
    store = settings["store_size"] * 3 * pixels
    return idle_mb + (body + decode + queue + store) / 2**20


def num(v: float) -> str:
    return "" if np.isnan(v) else f"{v:.2f}"


def print_checks(checks: list[tuple[str, str, str, bool]]) -> None:
    print("\n| check | value | target | |\n|---|---:|---|---|")
    for name, value, target, ok in checks:
        print(f"| {name} | {value} | {target} | {'pass' if ok else 'FAIL'} |")


def level_sizes(requests: int, c: int) -> tuple[int, int]:
    """(warm-up, measured) requests of one load level: every client sends at least twice, and warms up once."""
    return max(c, requests // 10), max(requests, 2 * c)


def check_unique(lv: Load, repeats: int) -> None:
    if repeats == 1 and len(set(lv.ids)) != len(lv.ids):
        raise RuntimeError(f"{len(lv.ids) - len(set(lv.ids))} of {len(lv.ids)} answers repeat an image id")


def run_uploads(args: argparse.Namespace, onnx: Path, out: Path, levels: list[int]) -> tuple[list[str], list, dict]:
    corpora = [c for c in ("phone", "small") if args.corpus in (c, "both")]
    bases = {"small": [photo_jpeg()]}
    if "phone" in corpora:
        bases["phone"] = phone_jpegs(out / "corpus")
    loads: dict[tuple[str, str, int], Load] = {}
    memory: dict[tuple[str, str, int], float] = {}
    idle: dict[str, float] = {}
    settings: dict[str, dict] = {}
    decodes = args.decode.split(",")
    with contextlib.ExitStack() as stack:
        # Every server up at once and the paths interleaved level by level, so that a machine whose load drifts
        # (other work on it) tilts no comparison.
        servers = {d: stack.enter_context(Server(onnx, args.threads, args.device, args.max_batch, args.max_delay_ms,
                                                 {"VIT_SERVE_DECODE": d, "VIT_SERVE_MAX_QUEUE": "256"}))
                   for d in decodes}
        for decode, server in servers.items():
            ready = server.wait_ready()
            settings[decode], idle[decode] = server.settings, server.memory_mb()[0]
            print(f"decode {decode}: {ready.get('model')} on {ready.get('backend')}, decode_workers "
                  f"{server.settings['decode_workers']}, threads {server.settings['threads']}", file=sys.stderr)
        k = 0  # requests sent to each server so far: the next image index, so that no image comes back
        for corpus in corpora:
            for c in levels:
                warmup, n = level_sizes(args.requests, c)
                bodies = payloads(bases[corpus], k, warmup + n, args.repeats)
                k += warmup + n
                for decode, server in servers.items():
                    lv = loads[decode, corpus, c] = asyncio.run(
                        load(server.url, "/classify", bodies, c, warmup, server.cpu_s))
                    check_unique(lv, args.repeats)
                    memory[decode, corpus, c] = server.memory_mb()[1]
                    print(f"  {decode} {corpus} c={c}: {lv.throughput:.1f} img/s, peak RSS "
                          f"{memory[decode, corpus, c]:.0f} MB", file=sys.stderr)
                del bodies
    loads = {(d, co, c): loads[d, co, c] for d in decodes for co in corpora for c in levels}  # table order

    rows = ["| decode | corpus | concurrency | requests | images/s | p50 ms | p99 ms | mean batch | read | "
            "decode wait | decode + preprocess | queue | inference | response | server CPU ms / image | peak RSS MB |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (decode, corpus, c), lv in loads.items():
        rows.append(f"| {decode} | {corpus} | {c} | {len(lv.latencies)} | {lv.throughput:.1f} | {lv.p(50):.1f} | "
                    f"{lv.p(99):.1f} | {num(lv.mean_batch)} | "
                    + " | ".join(f"{lv.stage_ms(st):.1f}" for st in STAGES)
                    + f" | {lv.cpu_ms:.1f} | {memory[decode, corpus, c]:.0f} |")
    checks = upload_checks({key: lv.throughput for key, lv in loads.items()})
    if ("fast", "phone", UPLOADS_C) in loads and ("fast", "small", UPLOADS_C) in loads:
        # With every core busy, images/s is cores / CPU per image: this ratio bounds the 12 MP / small one.
        phone, small = loads["fast", "phone", UPLOADS_C].cpu_ms, loads["fast", "small", UPLOADS_C].cpu_ms
        rows += ["", f"Server CPU per image at c={UPLOADS_C}, fast decode: {phone:.1f} ms for a 12 MP upload, "
                 f"{small:.1f} ms for a small photo; when the CPU is the limit, 12 MP / small images/s is at most "
                 f"their ratio, {small / phone:.2f}."]
    input_hw = tuple(json.loads(onnx.with_suffix(".json").read_text())["preprocess"]["input_size"][-2:])
    cmax = max(levels)
    for decode in settings:
        if (decode, "phone", cmax) in memory:
            peak, ceiling = memory[decode, "phone", cmax], memory_ceiling(idle[decode], settings[decode], cmax,
                                                                           input_hw)
            checks.append((f"server peak RSS (MB) after {cmax} concurrent 12 MP uploads, {decode} decode "
                           f"(idle {idle[decode]:.0f} MB)", f"{peak:.0f}", f"<= {ceiling:.0f} (the settings' "
                           f"ceiling, memory_ceiling)", peak <= ceiling))
    s0 = next(iter(settings.values()))
    head = (f"decode_workers {s0['decode_workers']}, threads {s0['threads'] or 'the runtime default'}, max_batch "
            f"{args.max_batch}, max_delay_ms {args.max_delay_ms:g}; stage columns: mean ms per request; "
            f"{'every request a different image' if args.repeats == 1 else f'each image sent {args.repeats} times'}")
    results = {
        "load": [{"decode": d, "corpus": co, "concurrency": c, "requests": len(lv.latencies),
                  "throughput": lv.throughput, "p50_ms": lv.p(50), "p99_ms": lv.p(99), "mean_batch": lv.mean_batch,
                  "stages_ms": {st: lv.stage_ms(st) for st in STAGES}, "server_cpu_ms": lv.cpu_ms,
                  "peak_rss_mb": memory[d, co, c]}
                 for (d, co, c), lv in loads.items()],
        "idle_rss_mb": idle, "settings": settings,
    }
    return [head, "", *rows], checks, results


ROUTING_MODELS = ("a", "b", "c")
ROUTING_OVERHEAD = 0.02
SECURITY_OVERHEAD = 0.02


def routing_repository(onnx: Path, folder: Path) -> Path:
    """A repository of three models, each a copy of the export (`NAME/1/model.onnx`, its manifest and explain
    graph): what a gateway serving several models holds."""
    for name in ROUTING_MODELS:
        version = folder / name / "1"
        version.mkdir(parents=True, exist_ok=True)
        for suffix in (".onnx", ".json", "_explain.onnx", "_explain.json"):
            src = onnx.with_name(onnx.stem + suffix)
            if src.exists():
                (version / f"model{suffix}").write_bytes(src.read_bytes())
    return folder


def compare(args: argparse.Namespace, targets: dict[str, tuple[Path, str, dict[str, str]]], levels: list[int],
            headers: dict[str, str] | None = None, cpu: dict[tuple[str, int], list[float]] | None = None
            ) -> dict[tuple[str, int], list[float]]:
    """Images/s of each target gateway {name: (MODEL or REPO, request path, VIT_SERVE_* env)}, all up at once,
    taking turns for `--rounds` rounds of unique small photos at each concurrency (the order flips every round,
    so that neither always goes first). `cpu`, when given, collects each round's server CPU ms per image."""
    threads = args.threads or max(1, (os.cpu_count() or 2) - (os.cpu_count() or 2) // 2)
    bases = [photo_jpeg()]
    tp: dict[tuple[str, int], list[float]] = {(t, c): [] for t in targets for c in levels}
    with contextlib.ExitStack() as stack:
        servers = {t: stack.enter_context(Server(path, threads, args.device, args.max_batch, args.max_delay_ms,
                                                 {"VIT_SERVE_DECODE": "fast", **env}))
                   for t, (path, _, env) in targets.items()}
        k = 0
        for r in range(args.rounds):
            for c in levels:
                warmup, n = level_sizes(args.requests, c)
                for t in (list(targets) if r % 2 == 0 else list(reversed(targets))):
                    bodies = payloads(bases, k, warmup + n)
                    k += warmup + n
                    cpu0 = servers[t].cpu_s()
                    lv = asyncio.run(load(servers[t].url, targets[t][1], bodies, c, warmup, headers=headers))
                    check_unique(lv, 1)
                    tp[t, c].append(lv.throughput)
                    if cpu is not None:  # warm-up requests included: the same count for every target
                        cpu.setdefault((t, c), []).append((servers[t].cpu_s() - cpu0) * 1e3 / (warmup + n))
                    print(f"  round {r + 1} {t} c={c}: {lv.throughput:.1f} img/s", file=sys.stderr)
    return tp


def compare_table(tp: dict[tuple[str, int], list[float]], levels: list[int], what: str,
                  bound: float) -> tuple[list[str], list]:
    """The rows of `compare`'s medians, and the check: the second target's median images/s >= `bound` x the
    first's at every concurrency."""
    rows = ["| gateway | concurrency | rounds | median images/s | min | max |", "|---|---:|---:|---:|---:|---:|"]
    for (t, c), v in tp.items():
        rows.append(f"| {t} | {c} | {len(v)} | {np.median(v):.1f} | {min(v):.1f} | {max(v):.1f} |")
    base, other = dict.fromkeys(t for t, _ in tp)
    checks = []
    for c in levels:
        ratio = float(np.median(tp[other, c]) / np.median(tp[base, c]))
        checks.append((f"{what}, median images/s (c={c})", f"{ratio:.3f}", f">= {bound:.2f}", ratio >= bound))
    return rows, checks


def run_routing(args: argparse.Namespace, onnx: Path, out: Path, levels: list[int]) -> tuple[list[str], list, dict]:
    """The single-model gateway (MODEL: the export) against a gateway serving a three-model repository, every
    request routed with ?model=b. The check: the repository's median images/s is within 2%."""
    repo = routing_repository(onnx, out / "repository")
    tp = compare(args, {"single model": (onnx, "/classify", {}),
                        "repository of 3, ?model=b": (repo, "/classify?model=b", {})}, levels)
    rows, checks = compare_table(tp, levels, "repository routed by ?model= / single-model gateway",
                                 1 - ROUTING_OVERHEAD)
    head = (f"the same intra-op threads in both; max_batch {args.max_batch}, max_delay_ms {args.max_delay_ms:g}; "
            f"unique small photos, fast decode; "
            f"{args.rounds} rounds taking turns")
    return [head, "", *rows], checks, {"throughput": {f"{t} c={c}": v for (t, c), v in tp.items()}}


def middleware_cost_us(key: str, n: int = 20000) -> float:
    """CPU µs per request that the API-key check and the request-id middleware (with its access line, formatted
    as `vit-serve serve` logs it) add: the real middleware around an app that answers at once, against that app
    alone, on one thread."""
    import io
    import logging

    from vit_serve.serve.middleware import RequestId, RequestIdFilter
    from vit_serve.serve.security import ApiKeys, KeyRing, key_hash

    handler = logging.StreamHandler(io.StringIO())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"))
    handler.addFilter(RequestIdFilter())
    access = logging.getLogger("vit_serve.serve.access")
    saved = access.level, access.propagate
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False

    async def answer(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    async def send(message: dict) -> None:
        pass

    scope = {"type": "http", "method": "POST", "path": "/classify", "headers": [
        (b"content-type", b"image/jpeg"), (b"authorization", f"Bearer {key}".encode()),
        (b"x-request-id", b"bench-0001"), (b"user-agent", b"python-httpx/0.28"), (b"accept", b"*/*")]}
    stack = RequestId(ApiKeys(answer, KeyRing((key_hash(key),))))

    async def time_per_call(app) -> float:
        t0 = time.process_time()
        for _ in range(n):
            await app(scope, receive, send)
        return (time.process_time() - t0) / n

    async def both() -> float:
        await time_per_call(stack)  # warm up
        return min([await time_per_call(stack) - await time_per_call(answer) for _ in range(3)])

    try:
        return asyncio.run(both()) * 1e6
    finally:
        access.removeHandler(handler)
        access.setLevel(saved[0])
        access.propagate = saved[1]


def run_security(args: argparse.Namespace, onnx: Path, out: Path, levels: list[int]) -> tuple[list[str], list, dict]:
    """The gateway with API keys and request ids off against both on (every request sends its key and an
    X-Request-ID, answered and logged). Checks: on costs at most 2% of images/s, of the server's CPU per image,
    and, measured alone, the two middleware cost at most 2% of the server's CPU per image."""
    key = "bench-key-0001"
    off, on = "keys and request ids off", "keys and request ids on"
    cpu: dict[tuple[str, int], list[float]] = {}
    tp = compare(args, {off: (onnx, "/classify", {"VIT_SERVE_REQUEST_IDS": "false"}),
                        on: (onnx, "/classify", {"VIT_SERVE_API_KEYS": key})},
                 levels, headers={"Authorization": f"Bearer {key}", "X-Request-ID": "bench"}, cpu=cpu)
    rows, checks = compare_table(tp, levels, "keys and request ids on / off", 1 - SECURITY_OVERHEAD)
    mw_us = middleware_cost_us(key)
    rows += ["", "| gateway | concurrency | median server CPU ms / image |", "|---|---:|---:|"]
    for (t, c), v in cpu.items():
        rows.append(f"| {t} | {c} | {np.median(v):.2f} |")
    for c in levels:
        ratio = float(np.median(cpu[on, c]) / np.median(cpu[off, c]))
        checks.append((f"server CPU per image, on / off (c={c})", f"{ratio:.3f}", f"<= {1 + SECURITY_OVERHEAD:.2f}",
                       ratio <= 1 + SECURITY_OVERHEAD))
        share = mw_us / 1e3 / float(np.median(cpu[off, c]))
        checks.append((f"the two middleware alone ({mw_us:.1f} µs/request) / server CPU per image (c={c})",
                       f"{share:.4f}", f"<= {SECURITY_OVERHEAD:.2f}", share <= SECURITY_OVERHEAD))
    head = (f"the same intra-op threads in both; max_batch {args.max_batch}, max_delay_ms {args.max_delay_ms:g}; "
            f"unique small photos, fast decode; "
            f"{args.rounds} rounds taking turns")
    return [head, "", *rows], checks, {"throughput": {f"{t} c={c}": v for (t, c), v in tp.items()},
                                       "cpu_ms_per_image": {f"{t} c={c}": v for (t, c), v in cpu.items()},
                                       "middleware_us_per_request": mw_us}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--mode")
    if pre.parse_known_args(argv)[0].mode == "lifecycle":  # its own flags (serve_lifecycle.py --help)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import serve_lifecycle

        return serve_lifecycle.main(argv)
    if pre.parse_known_args(argv)[0].mode == "faults":  # its own flags (serve_faults.py --help)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import serve_faults

        return serve_faults.main(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("uploads", "batching", "routing", "security", "abuse", "lifecycle",
                                       "faults"),
                    default="uploads",
                    help="uploads: the decode paths on 12 MP and small photos (default); batching: on vs off; "
                         "routing: a three-model repository against the single-model gateway; security: API "
                         "keys and request ids on against off; abuse: normal traffic beside abusive requests "
                         "against alone; lifecycle: hang-ups, a retry storm, priorities per key and shadow "
                         "traffic against today's gateway (benchmarks/serve_lifecycle.py, its own flags); faults: "
                         "redis, tritonserver, a full disk and SIGTERM during a reload under traffic "
                         "(benchmarks/serve_faults.py, its own flags)")
    ap.add_argument("--rounds", type=int,
                    help="routing, security, abuse, batching: rounds of turns (default 5; abuse 2, batching 3)")
    ap.add_argument("--abusers", type=int, default=4,
                    help="abuse: concurrent clients sending the abusive requests (default 4)")
    ap.add_argument("--stalled", type=int, default=100,
                    help="abuse: uploads that stall after 4 body bytes, held open at once (default 100)")
    ap.add_argument("--abuse-rate", type=float, default=20.0,
                    help="abuse: abusive requests per second, all clients together (default 20; 0: back to back)")
    ap.add_argument("--model", default="Ti/16", help="architecture (random weights, 1000 classes); default Ti/16")
    ap.add_argument("--res", type=int, default=224, help="input resolution (default 224)")
    ap.add_argument("--export", type=Path, help="reuse an existing vit-export folder (or its NAME.onnx; sidecar and "
                                                "explain graph beside it) instead of exporting --model")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--requests", type=int, default=96,
                    help="measured requests per load level (at least twice the concurrency; default 96)")
    ap.add_argument("--concurrency", help="comma list of client concurrencies (default 1,16,64 for uploads, "
                                          "1,4,16,64 for batching)")
    ap.add_argument("--corpus", choices=("phone", "small", "both"), default="both",
                    help="uploads: 12 MP phone JPEGs, small photos (451x300), or both (default; the targets)")
    ap.add_argument("--decode", default="fast,exact",
                    help="uploads: the servers' decode paths, a comma list of fast / exact (default fast,exact)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="times each image is sent (default 1: every request a different image; more: the crop "
                         "store answers the repeats)")
    ap.add_argument("--threads", type=int,
                    help="intra-op threads of the server's runtime (default: the server's own for uploads, all cores "
                         "for batching, where the offline session uses the same)")
    ap.add_argument("--spinning", action="store_true",
                    help="batching: the servers (and the offline session) with onnxruntime's intra-op spinning on "
                         "(--intra-op-spinning; default off, as the gateway)")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-delay-ms", type=float, default=5.0)
    ap.add_argument("--offline-seconds", type=float, default=4.0, help="batching: time per offline measurement")
    ap.add_argument("--out", type=Path, help="folder of the checkpoint, the export, the corpus and results.json "
                                             "(default: a new temporary folder)")
    args = ap.parse_args(argv)
    try:
        default_levels = {"uploads": "1,16,64", "batching": "1,4,16,64", "routing": "16", "security": "16",
                          "abuse": "16"}[args.mode]
        levels = [int(c) for c in (args.concurrency or default_levels).split(",")]
    except ValueError:
        ap.error(f"--concurrency {args.concurrency!r}: expected a comma list of integers")
    if args.rounds is None:
        args.rounds = {"abuse": 2, "batching": 3}.get(args.mode, 5)
    if min(levels) < 1 or args.repeats < 1 or args.requests < 1 or args.rounds < 1 or args.abusers < 1:
        ap.error("--concurrency, --requests, --repeats, --rounds and --abusers must be at least 1")
    if set(args.decode.split(",")) - {"fast", "exact"}:
        ap.error(f"--decode {args.decode!r}: expected a comma list of fast / exact")
    out = args.out or Path(tempfile.mkdtemp(prefix="serve_load-"))
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    if results_path.exists():
        raise SystemExit(f"{results_path} exists: choose another --out (results are never overwritten)")

    onnx = find_onnx(args.export) if args.export else export_model(args.model, args.res, out)
    if args.mode == "uploads":
        rows, checks, results = run_uploads(args, onnx, out, levels)
    elif args.mode == "routing":
        rows, checks, results = run_routing(args, onnx, out, levels)
    elif args.mode == "security":
        rows, checks, results = run_security(args, onnx, out, levels)
    elif args.mode == "abuse":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import serve_abuse

        rows, checks, results = serve_abuse.run_abuse(args, onnx, levels, out)
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import serve_batching

        rows, checks, results = serve_batching.run_batching(args, onnx, levels)

    import onnxruntime as ort

    what = str(onnx) if args.export else f"{args.model} at {args.res}px, random weights"
    print(f"\nServing {onnx.name} ({what}) on onnxruntime {ort.__version__}, device {args.device}, "
          f"{os.cpu_count()} cores; {rows[0]}\n")
    print("\n".join(rows[2:]))
    print_checks(checks)
    results = {"mode": args.mode, "onnx": str(onnx), "model": None if args.export else args.model,
               "res": None if args.export else args.res, "device": args.device, "repeats": args.repeats, **results}
    if args.mode == "abuse":  # the docs' table is rendered from the copy in benchmarks/results/
        save_results(Path(__file__).resolve().parent / "results" / "serve_abuse.json", results, checks, True)
    return save_results(results_path, results, checks)


def save_results(path: Path, results: dict, checks: list[tuple[str, str, str, bool]], overwrite: bool = False) -> int:
    """Write `results` with the checks to `path` (atomically; an existing file only with `overwrite`) and say
    where; the exit code: 0 when every check passed, else 1."""
    from vit_serve.checkpoints.io import atomic_write

    results = {**results, "checks": [{"check": n, "value": v, "target": t, "pass": ok} for n, v, t, ok in checks]}
    atomic_write(path, json.dumps(results, indent=2).encode(), overwrite=overwrite)
    print(f"\nresults: {path}")
    return 0 if all(ok for *_, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
