"""Serving load benchmark: the FastAPI gateway on the onnxruntime backend under concurrent clients.

What it measures (one real uvicorn server in a subprocess, an asyncio + httpx client in this process):

* POST /classify at concurrency 1, 4, 16 and 64 with dynamic batching on (max_batch 16, max_delay_ms 5) and off
  (max_batch 1): throughput (images/s), p50 / p99 latency, and the mean batch the server ran (timing_ms.batch_size);
* the backend's OFFLINE throughput: `onnxruntime` `session.run` on already-preprocessed batches, with the server's
  thread count, at batch 1 and at the batch size the server reached at concurrency 16;
* explain latency vs classify latency on the same image (POST /explain?format=png vs POST /classify, one client).

It prints one markdown table, then the ratios the serving design promises:

* server throughput at c=16 (batching on) >= 85% of offline throughput at the same batch size;
* batching on is never slower than off: >= 1.00x at every concurrency above 1; at c=1, where there is nothing
  to batch and on and off run the same path, equal within run-to-run noise (>= 0.95x);
* p50 at c=1 with batching on minus off <= max_delay_ms (a lone request waits at most the batching window);
* explain p50 <= 2x classify p50.

The model is a randomly initialised ViT (`--model`, default S/16 at `--res 224`, 1000 ImageNet classes) exported
with `vit-export` (`vit_export.cli.main`) into `--out` (or an existing export reused with `--export`); the image is
a real photo (scikit-image's `chelsea`, when scikit-image is installed).

    # the full benchmark (a quiet machine; every core goes to the server, the client needs about one more):
    python benchmarks/serve_load.py --model S/16 --res 224 --requests 512 --out /tmp/serve_load
    # on a GPU (onnxruntime's CUDA provider):
    python benchmarks/serve_load.py --device cuda --requests 2048 --out /tmp/serve_load_cuda
    # a smoke run (a minute on two cores):
    python benchmarks/serve_load.py --model Ti/16 --res 64 --requests 40 --out /tmp/serve_load_smoke

Exit status: 0 when every check passes, 1 when one fails (the table is printed either way).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

CONCURRENCY = (1, 4, 16, 64)


# ---- the image ---------------------------------------------------------------------------------------------

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


# ---- the model ---------------------------------------------------------------------------------------------

def export_model(arch: str, res: int, out: Path) -> Path:
    """A random-weight `arch` checkpoint at `res`, exported by vit-export into out/export; returns model.onnx."""
    import torch
    from vit_export.cli import main as vit_export

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
    code = vit_export([str(ckpt), "--res", str(res), "--out", str(onnx.parent), "--name", "model"])
    if code:
        raise SystemExit(f"vit-export failed with exit status {code}")
    return onnx


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
    """`vit-serve`'s gateway under uvicorn in a subprocess, configured through its VIT_SERVE_* variables."""

    def __init__(self, onnx: Path, threads: int, device: str, max_batch: int, max_delay_ms: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ,
               "VIT_SERVE_MODEL": str(onnx), "VIT_SERVE_BACKEND": "onnxruntime", "VIT_SERVE_DEVICE": device,
               "VIT_SERVE_THREADS": str(threads), "VIT_SERVE_MAX_BATCH": str(max_batch),
               "VIT_SERVE_MAX_DELAY_MS": str(max_delay_ms), "VIT_SERVE_MAX_QUEUE": "1024",
               "VIT_SERVE_HOST": "127.0.0.1", "VIT_SERVE_PORT": str(self.port)}
        code = ("import uvicorn\n"
                "from vit_serve.serve.app import create_app\n"
                "from vit_serve.serve.settings import ServeSettings\n"
                "s = ServeSettings()\n"
                "uvicorn.run(create_app(s), host=s.host, port=s.port, log_level='warning')\n")
        self.proc = subprocess.Popen([sys.executable, "-c", code], env=env)

    def wait_ready(self, timeout: float = 300.0) -> dict:
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

@dataclass
class Load:
    """One load level: latencies (s), wall time (s), and per request the server's batch size and model time (ms)
    (from its `timing_ms`; empty for PNG answers)."""

    latencies: np.ndarray
    wall_s: float
    batch_sizes: np.ndarray
    infer_ms: np.ndarray

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


async def load(url: str, path: str, image: bytes, concurrency: int, requests: int, warmup: int) -> Load:
    """`requests` POSTs of `image` to `path` from `concurrency` concurrent clients (after `warmup` unmeasured)."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120.0) as client:

        async def one() -> tuple[float, int, float]:
            t0 = time.perf_counter()
            r = await client.post(path, files={"file": ("photo.jpg", image, "image/jpeg")})
            dt = time.perf_counter() - t0
            if r.status_code != 200:
                raise RuntimeError(f"POST {path} answered {r.status_code}: {r.text[:300]}")
            if r.headers.get("content-type", "").startswith("application/json"):
                timing = r.json()["timing_ms"]
                return dt, int(timing["batch_size"]), float(timing["infer"])
            return dt, 0, float("nan")

        async def worker(n: int, out: list[tuple[float, int, float]]) -> None:
            for _ in range(n):
                out.append(await one())

        async def run(total: int) -> tuple[list[tuple[float, int, float]], float]:
            out: list[tuple[float, int, float]] = []
            share = [total // concurrency + (i < total % concurrency) for i in range(concurrency)]
            t0 = time.perf_counter()
            await asyncio.gather(*(worker(n, out) for n in share if n))
            return out, time.perf_counter() - t0

        await run(max(warmup, concurrency))
        results, wall = await run(requests)
    lat = np.array([d for d, _, _ in results])
    sizes = np.array([b for _, b, _ in results if b])
    infer = np.array([t for _, b, t in results if b])
    return Load(lat, wall, sizes, infer)


# ---- offline -----------------------------------------------------------------------------------------------

def offline_throughput(onnx: Path, image: bytes, batch: int, threads: int, device: str, seconds: float) -> float:
    """Images/s of `session.run` on a preprocessed [batch, 3, H, W] batch, `threads` intra-op threads."""
    import onnxruntime as ort

    from vit_serve.preprocess import PreprocessConfig, preprocess

    side = json.loads(onnx.with_suffix(".json").read_text())
    cfg = PreprocessConfig.from_dict(side["preprocess"])
    x = preprocess(image, cfg).numpy()[None].repeat(batch, 0)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
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

# At c=1 there is nothing to batch and a lone request never waits, so on and off run the same path: equal within
# the run-to-run noise of two separate server runs (5%). With concurrent clients batching must not lose.
SAME_PATH_SLACK = 0.95
CONCURRENT_MIN = 1.00


def batching_checks(on: dict[int, float], off: dict[int, float]) -> list[tuple[str, str, str, bool]]:
    """Batching on / off throughput by concurrency -> (check, value, target, passed) rows."""
    checks = []
    if 1 in on:
        r = on[1] / off[1]
        checks.append(("batching on / off throughput at c=1 (nothing to batch: the same path)", f"{r:.2f}",
                       f">= {SAME_PATH_SLACK:.2f} (equal within run-to-run noise)", r >= SAME_PATH_SLACK))
    concurrent = [c for c in on if c > 1]
    if concurrent:
        worst, worst_c = min((on[c] / off[c], c) for c in concurrent)
        checks.append((f"batching on / off throughput, worst of c > 1 (c={worst_c})", f"{worst:.2f}",
                       f">= {CONCURRENT_MIN:.2f} (never slower)", worst >= CONCURRENT_MIN))
    return checks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="S/16", help="architecture (random weights, 1000 classes); default S/16")
    ap.add_argument("--res", type=int, default=224, help="input resolution (default 224)")
    ap.add_argument("--export", type=Path, help="reuse an existing vit-export folder (or its NAME.onnx; sidecar and "
                                                "explain graph beside it) instead of exporting --model")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--requests", type=int, default=512,
                    help="measured requests per load level, at least twice the concurrency (default 512)")
    ap.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)),
                    help="comma list of client concurrencies (default 1,4,16,64)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="intra-op threads of the server's runtime and of the offline session (default: all cores)")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-delay-ms", type=float, default=5.0)
    ap.add_argument("--offline-seconds", type=float, default=5.0, help="time per offline measurement (default 5)")
    ap.add_argument("--out", type=Path, help="folder of the checkpoint, the export and results.json "
                                             "(default: a new temporary folder)")
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    out = args.out or Path(tempfile.mkdtemp(prefix="serve_load-"))
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    if results_path.exists():
        raise SystemExit(f"{results_path} exists: choose another --out (results are never overwritten)")

    onnx = find_onnx(args.export) if args.export else export_model(args.model, args.res, out)
    image = photo_jpeg()
    warmup = max(8, args.requests // 10)
    modes = {"on": (args.max_batch, args.max_delay_ms), "off": (1, args.max_delay_ms)}
    loads: dict[tuple[str, int], Load] = {}
    explain: Load | None = None
    classify_c1: Load | None = None
    for mode, (max_batch, delay) in modes.items():
        with Server(onnx, args.threads, args.device, max_batch, delay) as server:
            ready = server.wait_ready()
            print(f"batching {mode}: {ready.get('model')} on {ready.get('backend')} at {server.url}", file=sys.stderr)
            for c in levels:
                n = max(args.requests, 2 * c)  # every client sends at least twice
                loads[mode, c] = asyncio.run(load(server.url, "/classify", image, c, n, warmup))
                print(f"  c={c}: {loads[mode, c].throughput:.1f} img/s", file=sys.stderr)
            if mode == "on":
                n = max(10, args.requests // 4)
                classify_c1 = asyncio.run(load(server.url, "/classify", image, 1, n, warmup))
                explain = asyncio.run(load(server.url, "/explain?format=png", image, 1, n, warmup))

    c16 = 16 if 16 in levels else max(levels)
    reached = max(1, round(loads["on", c16].mean_batch))
    offline = {b: offline_throughput(onnx, image, b, args.threads, args.device, args.offline_seconds)
               for b in sorted({1, reached})}

    def num(v: float) -> str:
        return "" if np.isnan(v) else f"{v:.2f}"

    rows = ["| run | concurrency | requests | throughput (img/s) | p50 (ms) | p99 (ms) | mean batch | model ms/batch |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for (mode, c), lv in loads.items():
        rows.append(f"| POST /classify, batching {mode} | {c} | {len(lv.latencies)} | {lv.throughput:.1f} | "
                    f"{lv.p(50):.2f} | {lv.p(99):.2f} | {num(lv.mean_batch)} | {num(lv.mean_infer_ms)} |")
    assert explain is not None and classify_c1 is not None
    for name, lv in (("POST /classify (same image)", classify_c1), ("POST /explain?format=png", explain)):
        rows.append(f"| {name}, batching on | 1 | {len(lv.latencies)} | {lv.throughput:.1f} | {lv.p(50):.2f} | "
                    f"{lv.p(99):.2f} | {num(lv.mean_batch)} | {num(lv.mean_infer_ms)} |")
    for b, tp in offline.items():
        rows.append(f"| offline session.run | batch {b} | | {tp:.1f} | {b / tp * 1e3:.2f} | | {b} | "
                    f"{b / tp * 1e3:.2f} |")

    checks = []
    ratio = loads["on", c16].throughput / offline[reached]
    checks.append((f"server throughput at c={c16} / offline at batch {reached}", f"{ratio:.2f}", ">= 0.85",
                   ratio >= 0.85))
    checks += batching_checks({c: loads["on", c].throughput for c in levels},
                              {c: loads["off", c].throughput for c in levels})
    if 1 in levels:
        gap = loads["on", 1].p(50) - loads["off", 1].p(50)
        checks.append(("p50 at c=1, batching on - off (ms)", f"{gap:.2f}", f"<= {args.max_delay_ms:g}",
                       gap <= args.max_delay_ms))
    er = explain.p(50) / classify_c1.p(50)
    checks.append(("explain p50 / classify p50", f"{er:.2f}", "<= 2", er <= 2.0))

    import onnxruntime as ort

    what = str(onnx) if args.export else f"{args.model} at {args.res}px, random weights"
    print(f"\nServing {onnx.name} ({what}) on onnxruntime "
          f"{ort.__version__}, device {args.device}, {args.threads} threads, {os.cpu_count()} cores; batching on: "
          f"max_batch {args.max_batch}, max_delay_ms {args.max_delay_ms:g}\n")
    print("\n".join(rows))
    print("\n| check | value | target | |\n|---|---:|---|---|")
    for name, value, target, ok in checks:
        print(f"| {name} | {value} | {target} | {'pass' if ok else 'FAIL'} |")

    results = {
        "onnx": str(onnx), "model": None if args.export else args.model, "res": None if args.export else args.res,
        "device": args.device, "threads": args.threads,
        "load": [{"batching": m, "concurrency": c, "requests": len(lv.latencies), "throughput": lv.throughput,
                  "p50_ms": lv.p(50), "p99_ms": lv.p(99), "mean_batch": lv.mean_batch,
                  "model_ms_per_batch": lv.mean_infer_ms}
                 for (m, c), lv in loads.items()],
        "classify_c1_p50_ms": classify_c1.p(50), "explain_c1_p50_ms": explain.p(50),
        "offline": {str(b): tp for b, tp in offline.items()},
        "checks": [{"check": n, "value": v, "target": t, "pass": ok} for n, v, t, ok in checks],
    }
    from vit_serve.checkpoints.io import atomic_write

    atomic_write(results_path, json.dumps(results, indent=2).encode())
    print(f"\nresults: {results_path}")
    return 0 if all(ok for *_, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
