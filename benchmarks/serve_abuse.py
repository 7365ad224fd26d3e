"""Abusive requests beside normal traffic (`serve_load.py --mode abuse`; its flags are serve_load's).

One gateway with its default bounds and API keys on serves a repository of two models: `model` (the export of
`--model`, the normal traffic's) and `clip` (a small open_clip CLIP, random weights, converted with open_clip's
80 ImageNet templates and exported with its text tower). Normal traffic (unique small photos to /classify at
concurrency 16, its own key) runs alone and beside `--abusers` clients (default 4) sending, `--abuse-rate` a
second in all (default 20; 0: back to back), the abusive requests below in turn, and `--stalled` uploads
(default 100) that send their headers and 4 body bytes and then nothing; rounds take turns (`--rounds`, default
2). Each abusive kind has a key of its own, so that its answers are its own (one key's rate limit spent by one
kind does not turn another's 400 into a 429):

* /v2 (the last round's): 3,000 copies of a 1x1 PBM in one 48 KB JSON body, its gzip form (500x smaller), the
  same as a binary tensor, pixel_values of max_batch + 1 rows as a binary tensor, JSON nested 100,000 deep
  (infer and repository index), `Inference-Header-Content-Length: ²`, shapes whose element count overflows int64;
* labels x templates: 64 labels (max_labels) x 80 templates = 5,120 prompts in one /classify?labels=, from a key
  with a rate limit (LABELS_RATE prompts a second, bursts of LABELS_BURST): 200 or 429; 65 labels: 400;
* random-unicode labels: 4 labels of 1-8 code points from anywhere in Unicode, every request new ones
  (320 prompts each, the rate-limited key): 200 or 429;
* duplicate key headers: two X-API-Key (two tenants' keys), `sha256:` of another tenant's key then one's own,
  Authorization and X-API-Key together: 400;
* stalled uploads: 408 when body_timeout_s ends them, 429 beyond max_concurrent_per_key (their one key), or
  still open when the round ends; a stalled client waits a second before it opens its next connection.

Checks: normal images/s beside the abuse >= 0.8x alone (medians); the server's peak RSS (VmHWM) within the
settings' ceiling (`abuse_memory_ceiling`); no 5xx (as the clients saw them, and as the server counted them);
every abusive request answered as its kind expects. Each abusive request is also sent alone first, five times:
its server CPU per request is in the table.

    python benchmarks/serve_load.py --mode abuse --requests 960 --out /tmp/serve_abuse   # about 5 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gzip
import io
import json
import random
import struct
import sys
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Server, memory_ceiling
from load_client import check_unique, level_sizes, load, payloads, photo_jpeg
from text_labels import clip_templates, random_label

ABUSE_RATIO = 0.8  # normal traffic's images/s beside the abusive requests, at least this much of it without them
ABUSE_PBM_COPIES = 3000  # the measured attack: 3,000 copies of a 1x1 PBM in one 48 KB /v2 JSON body
LABELS_RATE = 250  # the labels abusers' key: tokens (prompts) a second
LABELS_BURST = 5120  # ... and its burst: one request of 64 labels x 80 templates from a full bucket
STALLED = 100  # uploads that stall after 4 body bytes, held open at once
HELD = -1  # a stalled upload's "status" when the round ended with it still open (not an answer)
KEYS = {  # name -> (key, key-file fields)
    "normal": ("abuse-bench-normal-traffic", ""),
    "v2": ("abuse-bench-v2-requests", ""),
    "labels": ("abuse-bench-labels", f"rate={LABELS_RATE} burst={LABELS_BURST}"),
    "labels-count": ("abuse-bench-labels-count", ""),
    "stall": ("abuse-bench-stalled-uploads", ""),
}


@dataclass(frozen=True)
class Abuse:
    """One abusive request: POST `path` (or, when `paths` is given, the k-th send POSTs paths[k % len]) with
    `headers` and `body`; `expect`: the statuses a bounded gateway answers it with (never a 5xx). `stalled`: an
    upload that sends its headers and the first bytes of `body`, then nothing (`stall`)."""

    name: str
    path: str
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    expect: frozenset[int]
    paths: tuple[str, ...] = ()
    stalled: bool = False

    def path_for(self, k: int) -> str:
        return self.paths[k % len(self.paths)] if self.paths else self.path


def pbm() -> bytes:
    """A 1x1 black-and-white PBM as Pillow writes it (8 bytes: 12 characters of base64)."""
    buf = io.BytesIO()
    Image.new("1", (1, 1)).save(buf, format="PPM")
    return buf.getvalue()


def _key(name: str | None) -> tuple[tuple[bytes, bytes], ...]:
    return () if name is None else ((b"x-api-key", KEYS[name][0].encode()),)


def abuse_requests(model: str, res: tuple[int, int], limit: int, key: str | None = None) -> list[Abuse]:
    """The last round's abusive /v2 requests to `model` (input res (H, W), `limit` images a request), with the
    key of KEYS[`key`] (None: no key): 3,000 tiny images as JSON, its gzip form, the same as a binary tensor,
    pixel_values of limit + 1 rows as a binary tensor (its header over the limit; the body, if over
    max_body_bytes, is a 413), JSON nested 100,000 deep on the infer and repository routes, an
    Inference-Header-Content-Length of a superscript digit, and shapes whose element count overflows int64."""
    infer = f"/v2/models/{model}/infer"
    as_json = ((b"content-type", b"application/json"), *_key(key))
    image = base64.b64encode(pbm()).decode()
    many = json.dumps({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [ABUSE_PBM_COPIES],
                                   "data": [image] * ABUSE_PBM_COPIES}], "outputs": [{"name": "logits"}]}).encode()
    raw = b"".join(struct.pack("<I", len(pbm())) + pbm() for _ in range(ABUSE_PBM_COPIES))
    head = json.dumps({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [ABUSE_PBM_COPIES],
                                   "parameters": {"binary_data_size": len(raw)}}]}).encode()
    h, w = res
    rows = np.zeros((limit + 1, 3, h, w), np.float32).tobytes()
    pixel_head = json.dumps({"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [limit + 1, 3, h, w],
                                         "parameters": {"binary_data_size": len(rows)}}]}).encode()
    nested = b"[" * 100_000 + b"]" * 100_000

    def binary(header: bytes) -> tuple[tuple[bytes, bytes], ...]:
        return ((b"content-type", b"application/octet-stream"),
                (b"inference-header-content-length", str(len(header)).encode()), *_key(key))

    def shape(dims: list[int]) -> bytes:
        spec = {"name": "pixel_values", "datatype": "FP32", "shape": dims, "data": []}
        return json.dumps({"inputs": [spec]}).encode()

    bad = frozenset({400})
    return [
        Abuse(f"{ABUSE_PBM_COPIES} 1x1 PBMs, JSON ({len(many) // 1024} KB)", infer, as_json, many, bad),
        Abuse(f"the same, gzip ({len(gzip.compress(many))} bytes)", infer,
              (*as_json, (b"content-encoding", b"gzip")), gzip.compress(many), bad),
        Abuse(f"{ABUSE_PBM_COPIES} 1x1 PBMs, binary tensor", infer, binary(head), head + raw, bad),
        Abuse(f"pixel_values [{limit + 1}, 3, {h}, {w}], binary tensor", infer, binary(pixel_head),
              pixel_head + rows, frozenset({400, 413})),
        Abuse("JSON nested 100,000 deep, infer", infer, as_json, nested, bad),
        Abuse("JSON nested 100,000 deep, repository index", "/v2/repository/index", as_json, nested, bad),
        Abuse("Inference-Header-Content-Length: \u00b2", infer,
              (*as_json, (b"inference-header-content-length", "\u00b2".encode("latin-1"))),
              b'{"inputs": []}' + b"\x00" * 8, bad),
        Abuse("shape [2**32, 2**32]", infer, as_json, shape([2**32, 2**32]), bad),
        Abuse("shape [2**70]", infer, as_json, shape([2**70]), bad),
    ]


def label_requests(model: str, max_labels: int, templates: int, photo: bytes, n_random: int = 1024,
                   seed: int = 0) -> list[Abuse]:
    """The text tower's abusive kinds against `model` (served with its text tower and `templates` templates), each
    request with labels no request before it had (so that no label cache answers them): max_labels labels x the
    templates from the rate-limited key (200 or 429), max_labels + 1 labels (400), and 4 random-unicode labels
    (200 or 429); `n_random` different requests of each, in turn."""
    def path(labels: list[str]) -> str:
        return f"/classify?model={model}&labels={urllib.parse.quote(','.join(labels), safe='')}"

    as_jpeg = (b"content-type", b"image/jpeg")
    rnd = random.Random(seed)
    randoms = tuple(path([random_label(rnd) for _ in range(4)]) for _ in range(n_random))
    many = tuple(path([f"label {i} of request {k}" for i in range(max_labels)]) for k in range(n_random))
    too_many = path([f"label {i}" for i in range(max_labels + 1)])
    return [
        Abuse(f"{max_labels} labels x {templates} templates ({max_labels * templates} prompts), new labels each",
              many[0], (as_jpeg, *_key("labels")), photo, frozenset({200, 429}), paths=many),
        Abuse(f"{max_labels + 1} labels (over max_labels)", too_many, (as_jpeg, *_key("labels-count")), photo,
              frozenset({400})),
        Abuse("4 random-unicode labels, new ones each", randoms[0], (as_jpeg, *_key("labels")), photo,
              frozenset({200, 429}), paths=randoms),
    ]


def key_header_requests(photo: bytes) -> list[Abuse]:
    """More than one key header on /classify: 400 each, whichever keys they carry."""
    from vit_serve.serve.keys import key_hash

    normal, other = KEYS["normal"][0].encode(), KEYS["v2"][0].encode()
    as_jpeg = (b"content-type", b"image/jpeg")
    bad = frozenset({400})
    return [
        Abuse("two X-API-Key headers, two tenants' keys", "/classify",
              (as_jpeg, (b"x-api-key", other), (b"x-api-key", normal)), photo, bad),
        Abuse("X-API-Key: sha256: of another tenant's key, then one's own", "/classify",
              (as_jpeg, (b"x-api-key", key_hash(KEYS["normal"][0]).encode()), (b"x-api-key", other)), photo, bad),
        Abuse("Authorization: Bearer and X-API-Key", "/classify",
              (as_jpeg, (b"authorization", b"Bearer " + other), (b"x-api-key", normal)), photo, bad),
    ]


def stalled_upload() -> Abuse:
    """An upload announcing 100 KB that sends 4 bytes and then nothing."""
    return Abuse("stalled upload (headers and 4 of 100,000 body bytes)", "/classify",
                 ((b"content-type", b"image/jpeg"), (b"content-length", b"100000"), *_key("stall")),
                 b"\xff\xd8\xff\xe0", frozenset({408, 429, HELD}), stalled=True)


async def abuse(url: str, requests: list[Abuse], clients: int, rate: float, stop: asyncio.Event,
                seen: dict[str, Counter[int]]) -> None:
    """`clients` concurrent clients sending `requests` round-robin, `rate` requests/s in all (0: back to back), until
    `stop` is set; the statuses answered are counted in `seen` by request name (0: no answer, a transport
    error). A client whose answer comes after its next turn sends at once (it falls behind, never bursts)."""
    requests = [r for r in requests if not r.stalled]
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=300.0) as client:

        async def worker(k: int) -> None:
            turn = time.perf_counter() + (k / rate if rate > 0 else 0.0)
            while not stop.is_set():
                if rate > 0:
                    await asyncio.sleep(max(0.0, turn - time.perf_counter()))
                    turn = max(turn + clients / rate, time.perf_counter())
                req = requests[k % len(requests)]
                try:
                    r = await client.post(req.path_for(k // len(requests)), content=req.body,
                                          headers=list(req.headers))
                    status = r.status_code
                except httpx.TransportError:
                    status = 0
                k += clients
                seen.setdefault(req.name, Counter())[status] += 1

        await asyncio.gather(*(worker(i) for i in range(clients)))


async def stall(url: str, req: Abuse, n: int, stop: asyncio.Event, seen: dict[str, Counter[int]]) -> None:
    """`n` connections at once, each sending `req`'s request line, headers and body bytes and then nothing,
    until `stop`: the status the server answers (0: closed without one) is counted in `seen`, HELD for each
    still open at the stop; a client whose upload was answered opens its next one a second later."""
    host, port = urllib.parse.urlsplit(url).hostname, urllib.parse.urlsplit(url).port
    head = f"POST {req.path} HTTP/1.1\r\nhost: {host}:{port}\r\n".encode() + b"".join(
        k + b": " + v + b"\r\n" for k, v in req.headers) + b"\r\n" + req.body
    stopped = asyncio.ensure_future(stop.wait())

    async def client() -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except OSError:
                seen.setdefault(req.name, Counter())[0] += 1
                await asyncio.sleep(1.0)
                continue
            writer.write(head)
            answer = asyncio.ensure_future(reader.readline())
            await asyncio.wait({answer, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if answer.done() and not answer.exception():
                line = answer.result().split()
                status = int(line[1]) if len(line) > 1 and line[1].isdigit() else 0
            else:
                answer.cancel()
                status = HELD if stop.is_set() else 0
            seen.setdefault(req.name, Counter())[status] += 1
            writer.close()
            if not stop.is_set():
                await asyncio.sleep(1.0)

    await asyncio.gather(*(client() for _ in range(n)))
    stopped.cancel()


def abuse_cost_ms(server: Server, requests: list[Abuse], n: int = 5) -> dict[str, tuple[float, list[int]]]:
    """Each abusive request (not the stalled ones) sent `n` times alone, one after the other: {name: (server CPU
    ms of the first send, the statuses)} (a rate-limited kind's later sends may be 429s that cost nothing)."""
    out = {}
    with httpx.Client(base_url=server.url, timeout=300.0) as client:
        for req in requests:
            if req.stalled:
                continue
            statuses, cpu_ms = [], []
            for k in range(n):
                cpu0 = server.cpu_s()
                statuses.append(client.post(req.path_for(k), content=req.body, headers=list(req.headers)).status_code)
                cpu_ms.append((server.cpu_s() - cpu0) * 1e3)
            out[req.name] = (cpu_ms[0], statuses)
    return out


def _abuse_process(url: str, requests: list[Abuse], clients: int, rate: float, stalled: int, stop: Any,
                   answers: Any) -> None:
    """`abuse` and `stall` in a process of their own until the `stop` event (multiprocessing's) is set; puts what
    they saw in `answers`."""
    seen: dict[str, Counter[int]] = {}

    async def run() -> None:
        done = asyncio.Event()
        tasks = [abuse(url, requests, clients, rate, done, seen)]
        tasks += [stall(url, r, stalled, done, seen) for r in requests if r.stalled and stalled > 0]
        running = asyncio.ensure_future(asyncio.gather(*tasks))
        while not stop.is_set():
            await asyncio.sleep(0.05)
        done.set()
        await running

    asyncio.run(run())
    answers.put({name: dict(counts) for name, counts in seen.items()})


def load_beside_abuse(url: str, bodies: list[bytes], concurrency: int, warmup: int, requests: list[Abuse],
                      clients: int, rate: float, stalled: int, seen: dict[str, Counter[int]],
                      failures: Counter[int], headers: dict[str, str] | None = None) -> Any:
    """`load` of normal traffic while `abuse` and `stall` run beside it in another process (so that the abusers'
    client work does not slow the normal clients' event loop), from its warm-up to its last answer."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    stop, answers = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_abuse_process, args=(url, requests, clients, rate, stalled, stop, answers),
                       daemon=True)
    proc.start()
    try:
        return asyncio.run(load(url, "/classify", bodies, concurrency, warmup, headers=headers, failures=failures))
    finally:
        stop.set()
        for name, counts in answers.get(timeout=300).items():
            seen.setdefault(name, Counter()).update(counts)
        proc.join(60)


def server_5xx(url: str, headers: dict[str, str] | None = None) -> float:
    """The 5xx answers the server has counted so far (vit_serve_requests_total, every endpoint); `headers`: the
    key /metrics needs when keys are on."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{url}/metrics", timeout=30, headers=headers)
    r.raise_for_status()
    return float(sum(s.value for family in text_string_to_metric_families(r.text) for s in family.samples
                     if s.name == "vit_serve_requests_total" and s.labels.get("status", "").startswith("5")))


def abuse_memory_ceiling(idle_mb: float, settings: dict, connections: int, input_hw: tuple[int, int],
                         stalled: int = 0) -> float:
    """`memory_ceiling` for `connections` clients of which any may send /v2 requests: beyond it, per connection,
    one decompressed body (at most max_body_bytes) and one request's decoded images (at most
    max_images_per_request, or max_batch when 0, float32 [3, H, W] each); and per stalled upload one read
    buffer (64 KiB) twice."""
    images = settings["max_images_per_request"] or settings["max_batch"]
    per_request = settings["max_body_bytes"] + images * 4 * 3 * input_hw[0] * input_hw[1]
    return (memory_ceiling(idle_mb, settings, connections, input_hw) + connections * per_request / 2**20
            + stalled * 2 * 65536 / 2**20)


def abuse_checks(normal: list[float], beside: list[float], peak_mb: float, ceiling_mb: float, fives: int,
                 unexpected: int) -> list[tuple[str, str, str, bool]]:
    """The abuse targets: median images/s beside the abuse >= ABUSE_RATIO x without; the server's peak RSS within
    the settings' ceiling; no 5xx anywhere; every abusive request answered as expected."""
    ratio = float(np.median(beside) / np.median(normal))
    return [
        ("normal traffic's median images/s, beside the abuse / without", f"{ratio:.3f}", f">= {ABUSE_RATIO:g}",
         ratio >= ABUSE_RATIO),
        ("server peak RSS (MB, VmHWM)", f"{peak_mb:.0f}", f"<= {ceiling_mb:.0f} (the settings' ceiling)",
         peak_mb <= ceiling_mb),
        ("5xx answers (normal and abusive, client and server counts)", str(fives), "0", fives == 0),
        ("abusive requests answered otherwise than expected", str(unexpected), "0", unexpected == 0),
    ]


def export_clip(folder: Path, name: str = "clip") -> Path:
    """A small open_clip CLIP (64 px, width 64, 2 layers each tower, random weights) converted with open_clip's
    80 ImageNet templates and exported with its text tower into `folder` (NAME.onnx, NAME_text.onnx, ...)."""
    import open_clip
    import torch
    import vit_export

    from vit_serve.checkpoints import convert

    if (folder / f"{name}_text.onnx").is_file():
        return folder
    work = folder.parent / f"{name}-checkpoint"
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = open_clip.create_model("ViT-B-32", pretrained=None, embed_dim=32,
                                   vision_cfg={"image_size": 64, "layers": 2, "width": 64, "patch_size": 32},
                                   text_cfg={"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 8,
                                             "layers": 2})
    torch.save(model.state_dict(), work / f"{name}.pt")
    convert(work / f"{name}.pt", work / f"{name}.safetensors", arch="open_clip:ViT-B-32", zero_shot=["cat", "dog"],
            templates=clip_templates(), overwrite=True)
    result = vit_export.export(work / f"{name}.safetensors",
                               vit_export.ExportOptions(out=folder, name=name, text_tower=True))
    if not result.ok or result.text is None:
        raise SystemExit(f"the export of {name} with its text tower failed its parity checks")
    return folder


def abuse_repository(onnx: Path, folder: Path) -> Path:
    """A repository folder of `model` (the export's graphs and manifests, copied) and `clip` (`export_clip`)."""
    folder.mkdir(parents=True, exist_ok=True)
    for suffix in (".onnx", ".json", "_explain.onnx", "_explain.json"):
        src = onnx.with_name(onnx.stem + suffix)
        if src.exists() and not (folder / f"model{suffix}").exists():
            (folder / f"model{suffix}").write_bytes(src.read_bytes())
    return export_clip(folder)


def key_file(path: Path) -> Path:
    """KEYS as a key file of hashes (what a deployment may hold openly) with their fields."""
    from vit_serve.serve.keys import key_hash

    path.write_text("".join(f"{key_hash(key)} name=abuse-{name} {fields}\n" for name, (key, fields) in KEYS.items()))
    return path


def run_abuse(args: argparse.Namespace, onnx: Path, levels: list[int], out: Path) -> tuple[list[str], list, dict]:
    """Normal traffic (unique small photos to /classify) alone and beside `--abusers` clients sending the abusive
    requests and `--stalled` stalled uploads, taking turns for `--rounds` rounds against one gateway with its
    default bounds and keys on."""
    side = json.loads(onnx.with_suffix(".json").read_text())
    input_hw = tuple(side["preprocess"]["input_size"][-2:])
    repo = abuse_repository(onnx, out / "abuse_repository")
    templates = len(clip_templates())
    bases = [photo_jpeg()]
    c = levels[0]
    normal: list[float] = []
    beside: list[float] = []
    seen: dict[str, Counter[int]] = {}
    failures: Counter[int] = Counter()
    normal_key = {"X-API-Key": KEYS["normal"][0]}
    env = {"VIT_SERVE_DECODE": "fast", "VIT_SERVE_MAX_QUEUE": "256", "VIT_SERVE_DEFAULT_MODEL": "model",
           "VIT_SERVE_API_KEYS_FILE": str(key_file(out / "abuse_keys.txt"))}
    with Server(repo, args.threads, args.device, args.max_batch, args.max_delay_ms, env) as server:
        settings, idle = server.settings, server.memory_mb()[0]
        limit = settings["max_images_per_request"] or settings["max_batch"]
        requests = [*abuse_requests("model", input_hw, limit, key="v2"),
                    *label_requests("clip", settings["max_labels"], templates, bases[0]),
                    *key_header_requests(bases[0]), stalled_upload()]
        cost = abuse_cost_ms(server, requests)
        fives0 = server_5xx(server.url, normal_key)
        peak_alone = float("nan")
        k = 0
        for r in range(args.rounds):
            for with_abuse in ((False, True) if r % 2 == 0 else (True, False)):
                warmup, n = level_sizes(args.requests, c)
                bodies = payloads(bases, k, warmup + n)
                k += warmup + n
                if with_abuse:
                    lv = load_beside_abuse(server.url, bodies, c, warmup, requests, args.abusers, args.abuse_rate,
                                           args.stalled, seen, failures, normal_key)
                    beside.append(lv.throughput)
                else:
                    lv = asyncio.run(load(server.url, "/classify", bodies, c, warmup, headers=normal_key,
                                          failures=failures))
                    normal.append(lv.throughput)
                    if r == 0:
                        peak_alone = server.memory_mb()[1]
                check_unique(lv, 1)
                print(f"  round {r + 1} {'beside the abuse' if with_abuse else 'alone'}: {lv.throughput:.1f} img/s, "
                      f"peak RSS {server.memory_mb()[1]:.0f} MB", file=sys.stderr)
        peak = server.memory_mb()[1]
        fives_server = server_5xx(server.url, normal_key) - fives0
    connections = c + args.abusers
    ceiling = abuse_memory_ceiling(idle, settings, connections, input_hw, args.stalled)
    fives_client = sum(n for status, n in failures.items() if status >= 500) + sum(
        n for counts in seen.values() for status, n in counts.items() if status >= 500 or status == 0)
    unexpected = sum(n for req in requests for status, n in seen.get(req.name, Counter()).items()
                     if status not in req.expect) + sum(status not in req.expect for req in requests
                                                        for status in cost.get(req.name, (0, []))[1])
    rows = ["| traffic | rounds | median images/s | min | max |", "|---|---:|---:|---:|---:|"]
    for name, v in (("normal, alone", normal), ("normal, beside the abuse", beside)):
        rows.append(f"| {name} | {len(v)} | {np.median(v):.1f} | {min(v):.1f} | {max(v):.1f} |")
    rows += ["", "| abusive request | bytes | alone: server CPU ms (first send), answers of 5 | sent beside the "
             "traffic | answers |", "|---|---:|---|---:|---|"]
    for req in requests:
        counts = seen.get(req.name, Counter())
        answers = ", ".join(f"{ {0: 'no answer', HELD: 'open at the end'}.get(status, status)} x {n}"
                            for status, n in sorted(counts.items()))
        ms = (f"{cost[req.name][0]:.0f}; {', '.join(map(str, cost[req.name][1]))}" if req.name in cost else
              "(not sent alone)")
        rows.append(f"| {req.name} | {len(req.body)} | {ms} | {sum(counts.values())} | {answers} |")
    rows += ["", f"Server memory: idle {idle:.0f} MB, peak (VmHWM) {peak_alone:.0f} MB after the first round alone, "
             f"{peak:.0f} MB at the end; the settings' ceiling for {connections} connections and {args.stalled} "
             f"stalled uploads {ceiling:.0f} MB. 5xx: {fives_client} seen by the clients, {fives_server:.0f} counted "
             f"by the server; normal requests not answered 200: {dict(failures) or 'none'}."]
    checks = abuse_checks(normal, beside, peak, ceiling, int(max(fives_client, fives_server)), unexpected)
    head = (f"one gateway, keys on (max_batch {settings['max_batch']}, at most {limit} images a request, "
            f"max_body_bytes {settings['max_body_bytes']}, max_labels {settings['max_labels']}, text_chunk_size "
            f"{settings['text_chunk_size']}, body_timeout_s {settings['body_timeout_s']:g}, max_concurrent_per_key "
            f"{settings['max_concurrent_per_key']}, fast decode); normal traffic: unique small photos to "
            f"/classify at concurrency {c}; abuse: {args.abusers} clients sending the requests below in turn, "
            f"{f'{args.abuse_rate:g} requests/s in all' if args.abuse_rate > 0 else 'back to back'}, and "
            f"{args.stalled} stalled uploads; {args.rounds} rounds taking turns")
    results = {"normal_throughput": normal, "beside_abuse_throughput": beside, "idle_rss_mb": idle,
               "peak_rss_mb": peak, "peak_rss_alone_mb": peak_alone, "ceiling_mb": ceiling,
               "five_xx": {"client": fives_client, "server": fives_server}, "normal_failures": dict(failures),
               "abuse": {req.name: dict(seen.get(req.name, Counter())) for req in requests},
               "abuse_alone": {name: {"cpu_ms_first": ms, "statuses": st}
                               for name, (ms, st) in cost.items()}, "abuse_rate": args.abuse_rate,
               "stalled": args.stalled, "settings": settings}
    return [head, "", *rows], checks, results
