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

`--mode backends` (benchmarks/serve_backends.py): the same export served by onnxruntime fp32 and by OpenVINO at
its automatic precision, side by side at c=16. Check: OpenVINO >= 1.6x on a CPU with bf16, >= 0.97x without.

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
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness and the clients, siblings of this script
from harness import (
    Server,
    export_model,
    find_onnx,
    memory_ceiling,
    print_checks,
    routing_repository,
    save_results,
)
from load_client import (
    STAGES,
    Load,
    check_unique,
    level_sizes,
    load,
    num,
    payloads,
    phone_jpegs,
    photo_jpeg,
)

CONCURRENCY = (1, 4, 16, 64)


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


ROUTING_OVERHEAD = 0.02
SECURITY_OVERHEAD = 0.02


def compare(args: argparse.Namespace, targets: dict[str, tuple[Path, str, dict[str, str]]], levels: list[int],
            headers: dict[str, str] | None = None, cpu: dict[tuple[str, int], list[float]] | None = None,
            shown: dict[str, dict] | None = None) -> dict[tuple[str, int], list[float]]:
    """Images/s of each target gateway {name: (MODEL or REPO, request path, VIT_SERVE_* env)}, all up at once,
    taking turns for `--rounds` rounds of unique small photos at each concurrency (the order flips every round,
    so that neither always goes first). `cpu`, when given, collects each round's server CPU ms per image; `shown`
    each gateway's GET /models once it is up."""
    threads = args.threads or max(1, (os.cpu_count() or 2) - (os.cpu_count() or 2) // 2)
    bases = [photo_jpeg()]
    tp: dict[tuple[str, int], list[float]] = {(t, c): [] for t in targets for c in levels}
    with contextlib.ExitStack() as stack:
        servers = {t: stack.enter_context(Server(path, threads, args.device, args.max_batch, args.max_delay_ms,
                                                 {"VIT_SERVE_DECODE": "fast", **env}))
                   for t, (path, _, env) in targets.items()}
        if shown is not None:
            shown.update({t: httpx.get(f"{server.url}/models", timeout=30).json() for t, server in servers.items()})
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
        import serve_lifecycle

        return serve_lifecycle.main(argv)
    if pre.parse_known_args(argv)[0].mode == "faults":  # its own flags (serve_faults.py --help)
        import serve_faults

        return serve_faults.main(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("uploads", "batching", "routing", "security", "abuse", "backends",
                                       "lifecycle", "faults"),
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
                          "abuse": "16", "backends": "16"}[args.mode]
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
    results_file = out / "results.json"
    if results_file.exists():
        raise SystemExit(f"{results_file} exists: choose another --out (results are never overwritten)")

    onnx = find_onnx(args.export) if args.export else export_model(args.model, args.res, out)
    if args.mode == "uploads":
        rows, checks, results = run_uploads(args, onnx, out, levels)
    elif args.mode == "routing":
        rows, checks, results = run_routing(args, onnx, out, levels)
    elif args.mode == "security":
        rows, checks, results = run_security(args, onnx, out, levels)
    elif args.mode == "backends":
        import serve_backends

        rows, checks, results = serve_backends.run_backends(args, onnx, levels)
    elif args.mode == "abuse":
        import serve_abuse

        rows, checks, results = serve_abuse.run_abuse(args, onnx, levels, out)
    else:
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
    name = "serve_abuse" if args.mode == "abuse" else f"serve_{args.mode}"
    return save_results(name, rows, checks, results, args, also=results_file)


if __name__ == "__main__":
    sys.exit(main())
