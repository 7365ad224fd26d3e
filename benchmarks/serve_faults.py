"""Faults survived, measured (`serve_load.py --mode faults`): normal traffic (unique small photos to /classify at
concurrency `--concurrency`, default 16) against a real `vit-serve serve` process (`vit_serve.serve.app.run`: its
SIGTERM handling, its logging) while one fault at a time is injected:

* `redis`: the explain store's redis-server is SIGKILLed and started again on the same port. Two more clients ask
  GET /explain?id= for the latest classified images. Expected: /explain answers 503 while it is down (a clear
  message), /classify goes on answering 200; recovered at the first /explain 200 after the restart.
* `triton`: the gateway runs `--backend triton` in front of a real tritonserver (nvidia-pytriton's), which is
  SIGKILLed and started again (same ports). Expected: 503 with Retry-After while it is down, served again
  without a gateway restart; recovered at the first 200 after Triton is ready.
* `disk`: the payload sampler writes every request (sample rate 1, parts every second) and the server's file
  size limit (RLIMIT_FSIZE, set on the running process with prlimit: the real OS path of a full disk, EFBIG) is
  cut to 4 KB. Expected: sampling stops with one warning and vit_serve_samples_dropped_total{reason="disk_full"},
  serving goes on (every answer 200).
* `sigterm`: the gateway follows a repository (`--model-control poll`); a version 2 is copied in (a hot reload)
  and SIGTERM is sent while it loads. Each request on a new connection, so that one the server never accepted is
  a refused connection, not a lost request; a connection opened after the signal and reset unanswered is counted
  apart ("reset in the accept queue": Linux resets what waits in a listening socket's queue when it closes, so
  the application never saw it). Expected: every accepted request answered (200, or the shutdown's 503 with
  Retry-After), exit status 0.

Per fault: requests answered 2xx, the expected 503s (all with Retry-After where the fault promises one), 5xx
other than those and requests lost (accepted, no answer) - both must be 0 -, the time to recover, and the
server's RSS (now and peak). It prints a table and writes results/serve_faults.json (and `--out`/results.json).

    python benchmarks/serve_load.py --mode faults --out /tmp/serve_faults
    python benchmarks/serve_load.py --mode faults --faults redis,disk --model Ti/16 --res 32 --out /tmp/f
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (
    ServerExitedError,
    ServerProcess,
    free_port,
    print_checks,
    routing_repository,
)
from load_client import photo_jpeg, unique_jpeg

FAULTS = ("redis", "triton", "disk", "sigterm")
DISK_LIMIT = 4096  # the server's RLIMIT_FSIZE once the disk "fills": every part is bigger

SERVER_CODE = """
import json, sys
from vit_serve.runtime.payload_sampler import PayloadSampler
from vit_serve.serve.app import run
from vit_serve.serve.settings import ServeSettings
PayloadSampler.PART_SECONDS = 1.0  # a part a second, so that the full disk shows within the run
s = ServeSettings()
print('SETTINGS ' + s.model_dump_json(), file=sys.stderr, flush=True)
run(s)
"""


class GatewayProcess(ServerProcess):
    """`vit-serve serve` as deployed (`app.run`: draining on SIGTERM), its log in `log`."""

    def __init__(self, model: str, env: dict[str, str], log: Path, threads: int | None) -> None:
        port = free_port()
        self.log = log
        full = {**os.environ, "VIT_SERVE_MODEL": model, "VIT_SERVE_HOST": "127.0.0.1",
                "VIT_SERVE_PORT": str(port), "VIT_SERVE_DEVICE": "cpu", "VIT_SERVE_DECODE": "fast",
                "VIT_SERVE_MAX_QUEUE": "256", **({"VIT_SERVE_THREADS": str(threads)} if threads else {}), **env}
        # Through a pipe, as a container's log: the server's file size limit (the disk fault) must not cut it.
        self._log_file = open(log, "w")  # noqa: SIM115  (closed by stop)
        super().__init__(subprocess.Popen([sys.executable, "-c", SERVER_CODE], env=full, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True), port)
        self._relay = threading.Thread(target=self._copy_log, daemon=True)
        self._relay.start()
        self.settings: dict = {}

    def _copy_log(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log_file.write(line)
            self._log_file.flush()

    def wait_ready(self, timeout: float | None = None, poll: float = 0.2, tick=lambda: None) -> dict:
        try:
            answer = super().wait_ready(timeout, poll, tick)
        except (ServerExitedError, TimeoutError) as e:
            raise type(e)(f"{e}:\n{self.tail()}") from None
        for line in self.log.read_text().splitlines():
            if line.startswith("SETTINGS "):
                self.settings = json.loads(line.removeprefix("SETTINGS "))
        return answer

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace: float = 30.0) -> int | None:
        code = super().stop(grace)
        self._relay.join(10)
        self._log_file.close()
        return code


class RedisProcess:
    """A redis-server on a free port of 127.0.0.1, no persistence; `kill` (SIGKILL) and `start` again."""

    def __init__(self, folder: Path) -> None:
        self.port, self.folder, self.proc = free_port(), folder, None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.folder)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError):
                if redis.Redis(port=self.port, socket_timeout=1).ping():
                    return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@dataclass
class Seen:
    """What the clients saw, per path: statuses, 503s without Retry-After, requests lost (accepted, no answer),
    and the times of the 2xx answers (for the recovery)."""

    statuses: dict[str, Counter[int]] = field(default_factory=dict)
    no_retry_after: int = 0
    lost: int = 0
    refused: int = 0  # connections the server did not accept (it had closed its listener)
    # Connections opened after SIGTERM and reset with no answer: Linux resets the connections still in a listening
    # socket's accept queue when it closes, so a request the application never accepted can fail this way; TCP
    # gives the server no way to answer those. A request sent before the signal that fails is lost.
    reset_at_close: int = 0
    term_at: float | None = None  # when SIGTERM was sent (monotonic)
    ok_times: dict[str, list[float]] = field(default_factory=dict)
    ids: list[str] = field(default_factory=list)

    def add(self, path: str, r: httpx.Response) -> None:
        self.statuses.setdefault(path, Counter())[r.status_code] += 1
        if r.status_code == 503 and not r.headers.get("retry-after"):
            self.no_retry_after += 1
        if 200 <= r.status_code < 300:
            self.ok_times.setdefault(path, []).append(time.monotonic())


async def traffic(url: str, concurrency: int, stop: asyncio.Event, seen: Seen, explainers: int = 0,
                  keepalive: bool = True) -> None:
    """`concurrency` clients sending unique photos to /classify, and `explainers` asking GET /explain?id= for the
    latest ids, until `stop` is set (or the server refuses connections)."""
    base = photo_jpeg()
    limits = httpx.Limits(max_connections=concurrency + explainers,
                          max_keepalive_connections=concurrency + explainers if keepalive else 0)
    counter = iter(range(10**9))
    closed = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60.0) as client:

        async def send(path: str, **kw: Any) -> httpx.Response | None:
            sent = time.monotonic()
            try:
                return await client.request("POST" if path == "/classify" else "GET", path, **kw)
            except httpx.ConnectError:
                seen.refused += 1
                closed.set()
            except httpx.TransportError:
                if seen.term_at is not None and sent >= seen.term_at and not keepalive:
                    seen.reset_at_close += 1
                else:
                    seen.lost += 1
            return None

        async def classifier() -> None:
            while not stop.is_set() and not closed.is_set():
                body = unique_jpeg(base, next(counter))
                r = await send("/classify", files={"file": ("photo.jpg", body, "image/jpeg")})
                if r is not None:
                    seen.add("/classify", r)
                    if r.status_code == 200:
                        seen.ids.append(r.json()["id"])

        async def explainer() -> None:
            while not stop.is_set() and not closed.is_set():
                if not seen.ids:
                    await asyncio.sleep(0.05)
                    continue
                r = await send("/explain", params={"id": seen.ids[-1]})
                if r is not None:
                    seen.add("/explain", r)

        await asyncio.gather(*(classifier() for _ in range(concurrency)), *(explainer() for _ in range(explainers)))


def run_fault(server: GatewayProcess, concurrency: int, inject: Any, restore: Any, pre_s: float, down_s: float,
              post_s: float, explainers: int = 0, keepalive: bool = True,
              seen: Seen | None = None) -> tuple[Seen, float | None, float]:
    """Traffic for `pre_s`, `inject()`, `down_s`, `restore()`, `post_s` more (the blocking calls in threads);
    returns what was seen (into `seen` when given), the monotonic time `restore` returned (None: no restore) and
    the peak RSS seen."""
    seen = Seen() if seen is None else seen
    peak = [server.memory_mb()[1]]
    restored: list[float] = []

    async def main() -> None:
        stop = asyncio.Event()
        load = asyncio.ensure_future(traffic(server.url, concurrency, stop, seen, explainers, keepalive))
        await asyncio.sleep(pre_s)
        await asyncio.to_thread(inject)
        await asyncio.sleep(down_s)
        if restore is not None:
            await asyncio.to_thread(restore)
            restored.append(time.monotonic())
        await asyncio.sleep(post_s)
        peak.append(server.memory_mb()[1])
        stop.set()
        await load

    asyncio.run(main())
    return seen, restored[0] if restored else None, max((v for v in peak if v == v), default=float("nan"))


def recovery(seen: Seen, path: str, since: float | None) -> float | None:
    """Seconds from `since` to the first 2xx on `path` after it (None: none came, or nothing to recover)."""
    if since is None:
        return None
    later = [t for t in seen.ok_times.get(path, []) if t >= since]
    return min(later) - since if later else None


def five_xx(seen: Seen, expected_503: set[str]) -> tuple[int, int]:
    """(the 503s on the paths where the fault expects them, every other 5xx)."""
    expected = unexpected = 0
    for path, counts in seen.statuses.items():
        for status, n in counts.items():
            if status == 503 and path in expected_503:
                expected += n
            elif status >= 500:
                unexpected += n
    return expected, unexpected


def counter_value(url: str, name: str, **labels: str) -> float:
    """A sample of /metrics (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return float(sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                     if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())))


def export_for_faults(args: argparse.Namespace, out: Path, triton: bool) -> tuple[Path, Path]:
    """A random-weight `--model` at `--res`, exported as ONNX and (`triton`) as a Triton repository: (model.onnx,
    repo)."""
    import torch
    import vit_export

    import vit_serve

    onnx, repo = out / "export" / "model.onnx", out / "triton_repo"
    if onnx.is_file() and (repo.is_dir() or not triton):
        return onnx, repo
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "model.safetensors"
    torch.manual_seed(0)
    vit_serve.save(vit_serve.create_model(args.model, num_classes=1000, img_size=args.res), ckpt)
    result = vit_export.export(ckpt, vit_export.ExportOptions(res=args.res, out=onnx.parent, name="model",
                                                              formats=("onnx", "triton") if triton else ("onnx",),
                                                              repo=repo),
                               progress=lambda msg: print(msg, file=sys.stderr))
    if not result.ok:
        raise SystemExit("the export failed its parity checks")
    return onnx, repo


def row(fault: str, seen: Seen, expected_503: set[str], since: float | None, path: str, server: GatewayProcess,
        peak: float, extra: dict[str, Any]) -> dict[str, Any]:
    expected, unexpected = five_xx(seen, expected_503)
    two = sum(n for counts in seen.statuses.values() for s, n in counts.items() if 200 <= s < 300)
    rss = server.memory_mb()[0] if server.proc.poll() is None else float("nan")
    return {"fault": fault, "answered_2xx": two, "expected_503": expected, "unexpected_5xx": unexpected,
            "lost": seen.lost, "refused_connections": seen.refused, "reset_at_close": seen.reset_at_close,
            "503_without_retry_after": seen.no_retry_after,
            "recovery_s": recovery(seen, path, since), "rss_mb": rss, "peak_rss_mb": peak,
            "statuses": {p: dict(c) for p, c in seen.statuses.items()}, **extra}


def fault_redis(args: argparse.Namespace, onnx: Path, work: Path) -> dict[str, Any]:
    redis = RedisProcess(work)
    redis.start()
    server = GatewayProcess(str(onnx), {"VIT_SERVE_STORE": redis.url}, work / "gateway-redis.log", args.threads)
    try:
        with server:
            seen, since, peak = run_fault(server, args.concurrency, redis.kill, redis.start, args.pre_s, args.down_s,
                                          args.post_s, explainers=2)
            return row("redis killed and restarted", seen, {"/explain"}, since, "/explain", server, peak, {})
    finally:
        redis.kill()


def fault_triton(args: argparse.Namespace, repo: Path, work: Path) -> dict[str, Any]:
    from vit_export.tritonserver import TritonServer, available

    if (reason := available()) is not None:
        return {"fault": "tritonserver killed and restarted", "skipped": f"no tritonserver here: {reason}"}
    triton = TritonServer(repo, models=["model_py", "model_explain_py"], log_file=work / "tritonserver.log")
    triton.start(timeout=120)

    def kill() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(triton.pid, signal.SIGKILL)
        triton.stop()  # reaps it, removes its shared memory

    server = GatewayProcess("model_py", {"VIT_SERVE_BACKEND": "triton", "VIT_SERVE_TRITON_URL": triton.http_url},
                            work / "gateway-triton.log", args.threads)
    try:
        with server:
            seen, since, peak = run_fault(server, args.concurrency, kill, lambda: triton.start(timeout=120),
                                          args.pre_s, args.down_s, args.post_s)
            return row("tritonserver killed and restarted", seen, {"/classify"}, since, "/classify", server, peak, {})
    finally:
        triton.close()


def fault_disk(args: argparse.Namespace, onnx: Path, work: Path) -> dict[str, Any]:
    samples = work / "samples"
    server = GatewayProcess(str(onnx), {"VIT_SERVE_SAMPLE_RATE": "1", "VIT_SERVE_SAMPLE_DIR": str(samples)},
                            work / "gateway-disk.log", args.threads)
    with server:
        def fill() -> None:
            deadline = time.monotonic() + 30  # a part written before the disk fills (sampling worked)
            while not list(samples.glob("part-*.parquet")) and time.monotonic() < deadline:
                time.sleep(0.05)
            hard = resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE)[1]
            resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (DISK_LIMIT, hard))

        before = [p.name for p in samples.glob("part-*.parquet")]
        seen, _, peak = run_fault(server, args.concurrency, fill, None, args.pre_s, args.down_s,
                                  args.post_s)
        dropped = counter_value(server.url, "vit_serve_samples_dropped_total", reason="disk_full")
        parts = len(list(samples.glob("part-*.parquet")))
        warnings = sum("sampling has stopped" in ln for ln in server.log.read_text().splitlines())
        out = row("sample folder's disk full (RLIMIT_FSIZE)", seen, set(), None, "/classify", server, peak,
                  {"samples_dropped_disk_full": dropped, "parts_written": parts, "parts_at_start": len(before),
                   "warnings": warnings})
    return out


def fault_sigterm(args: argparse.Namespace, onnx: Path, work: Path) -> dict[str, Any]:
    repo = work / "repository"
    routing_repository(onnx, repo)  # a, b, c: version 1 each
    server = GatewayProcess(str(repo), {"VIT_SERVE_MODEL_CONTROL": "poll", "VIT_SERVE_REPOSITORY_POLL_S": "0.2",
                                        "VIT_SERVE_DEFAULT_MODEL": "a", "VIT_SERVE_SHUTDOWN_DRAIN_S": "0.5",
                                        "VIT_SERVE_SHUTDOWN_GRACE_S": "10"},
                            work / "gateway-sigterm.log", args.threads)
    seen = Seen()
    with server:
        def reload_then_term() -> None:
            shutil.copytree(repo / "a" / "1", repo / "a" / ".2-incoming")
            os.replace(repo / "a" / ".2-incoming", repo / "a" / "2")  # version 2 appears whole
            deadline = time.monotonic() + 10
            while "version 2" not in server.log.read_text() and "/2" not in server.log.read_text() \
                    and time.monotonic() < deadline:
                time.sleep(0.02)
            seen.term_at = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)

        seen, _, peak = run_fault(server, args.concurrency, reload_then_term, None, args.pre_s, 0.0,
                                  args.post_s + 12, keepalive=False, seen=seen)
        try:
            code = server.proc.wait(60)
        except subprocess.TimeoutExpired:
            code = None
        return row("SIGTERM during a hot reload", seen, {"/classify"}, None, "/classify", server, peak,
                   {"exit_status": code})


def checks_of(rows: list[dict[str, Any]]) -> list[tuple[str, str, str, bool]]:
    checks = []
    for r in rows:
        if "skipped" in r:
            checks.append((f"{r['fault']}: skipped", r["skipped"], "-", True))
            continue
        bad = r["unexpected_5xx"] + r["lost"]
        checks.append((f"{r['fault']}: 5xx other than the expected 503s, and lost requests", str(bad), "0", bad == 0))
        checks.append((f"{r['fault']}: 503s without Retry-After", str(r["503_without_retry_after"]), "0",
                       r["503_without_retry_after"] == 0))
        if r["fault"].startswith(("redis", "triton")):
            ok = r["recovery_s"] is not None
            checks.append((f"{r['fault']}: served again without a gateway restart",
                           "no" if not ok else f"after {r['recovery_s']:.2f} s", "yes", ok))
        if r["fault"].startswith("sample"):
            ok = (r["samples_dropped_disk_full"] > 0 and r["warnings"] == 1 and r["answered_2xx"] > 0
                  and r["parts_written"] > 0)
            checks.append((f"{r['fault']}: one warning, counted, serving went on",
                           f"{r['warnings']} warning(s), {r['samples_dropped_disk_full']:.0f} dropped", "1, > 0", ok))
        if r["fault"].startswith("SIGTERM"):
            checks.append((f"{r['fault']}: exit status", str(r["exit_status"]), "0", r["exit_status"] == 0))
    return checks


def table(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| fault | 2xx | expected 503 | other 5xx | lost | reset in the accept queue | recovery (s) | "
           "RSS now / peak (MB) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['fault']} | skipped: {r['skipped']} |||||||")
            continue
        rec = "-" if r["recovery_s"] is None else f"{r['recovery_s']:.2f}"
        out.append(f"| {r['fault']} | {r['answered_2xx']} | {r['expected_503']} | {r['unexpected_5xx']} | "
                   f"{r['lost']} | {r['reset_at_close']} | {rec} | {r['rss_mb']:.0f} / {r['peak_rss_mb']:.0f} |")
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("faults",), default="faults")
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma list of {', '.join(FAULTS)} (default all)")
    ap.add_argument("--model", default="Ti/16")
    ap.add_argument("--res", type=int, default=224)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--threads", type=int, help="the gateway's intra-op threads (default its own)")
    ap.add_argument("--pre-s", type=float, default=4.0, help="traffic before each fault (s)")
    ap.add_argument("--down-s", type=float, default=3.0, help="time the fault lasts (s)")
    ap.add_argument("--post-s", type=float, default=6.0, help="traffic after the repair (s)")
    ap.add_argument("--out", type=Path, help="work folder (default: a temporary one)")
    ap.add_argument("--results", type=Path, help="results file (default benchmarks/results/serve_faults.json)")
    args = ap.parse_args(argv)
    chosen = [f.strip() for f in args.faults.split(",") if f.strip()]
    if unknown := set(chosen) - set(FAULTS):
        ap.error(f"--faults: unknown {sorted(unknown)}; choose from {', '.join(FAULTS)}")
    out = args.out or Path(tempfile.mkdtemp(prefix="serve_faults-"))
    onnx, repo = export_for_faults(args, out, "triton" in chosen)
    rows = []
    for fault in chosen:
        work = out / fault
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        print(f"fault: {fault}", file=sys.stderr)
        rows.append({"redis": lambda w: fault_redis(args, onnx, w), "triton": lambda w: fault_triton(args, repo, w),
                     "disk": lambda w: fault_disk(args, onnx, w), "sigterm": lambda w: fault_sigterm(args, onnx, w),
                     }[fault](work))
    checks = checks_of(rows)
    print(f"\nFaults under traffic: {args.model} at {args.res}px (random weights), /classify at concurrency "
          f"{args.concurrency}, {os.cpu_count()} cores; {args.pre_s:g} s before each fault, {args.down_s:g} s "
          f"down, {args.post_s:g} s after\n")
    print("\n".join(table(rows)))
    print_checks(checks)
    results = {"mode": "faults", "model": args.model, "res": args.res, "concurrency": args.concurrency,
               "faults": rows}
    from results_file import ResultsFile, tables_in

    run = ResultsFile.of("serve_faults", tables_in(table(rows)), checks, results, args, script="serve_load.py")
    run.save(out / "results.json")
    return run.save(args.results)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
