"""Offline prediction benchmark: `vit-serve predict` against the gateway's `/classify`, and Ray Data against the
local engine, side by side in one run.

(a) A folder of 12 MP phone JPEGs (benchmarks/upload_corpus.py's, each copy made unique with `load_client.unique_jpeg`,
so that every file is a different upload of the same decode work) through `predict` (local engine, its defaults:
fast decode, batch 16, the gateway's decode-thread count) against the same files POSTed to `/classify` of a real
gateway (serve_load's `Server`: uvicorn in a subprocess, server defaults) at concurrency 16. Same model and backend:
ViT-Ti/16 at 224, random weights, exported by vit-export, onnxruntime. Rounds take turns; medians are compared.
Both rates leave out the start, the same way: the gateway's its 16 warm-up requests (the load generator's
warm-up), predict's its first batch of 16 (the pipeline filling); predict's rate with its first batch is shown
beside.
Target: predict >= 1.2x the gateway's images/s (no HTTP, no JSON, batches always full).

(b) The same job through `--engine ray` on a local Ray cluster of 2 CPUs (`ray.init(num_cpus=2)`, started
before the clock) against the local engine (writing Parquet both), each timed end to end as a user waits for it
(model load, and for Ray the actors' and the dataset's start-up, included), on the folder (n files) and on one four
times its size, each `--rounds` times (the median wall time of each). Ray's start-up does not depend on the
folder's size, so the difference gives each engine's images/s with the fixed costs taken out,
3n / (T(4n) - T(n)), and its fixed overhead, T(4n) - 4n / that rate. (Ray's start-up varies by a second or more
from run to run: a difference of n/2 files, one second of work, was lost in it.) Reported: both, end to end too.
Target: Ray's images/s >= 0.7x the local engine's.

    python benchmarks/predict.py --images 64 --rounds 3 --out /tmp/predict_bench       # a few minutes on 2 cores
    python benchmarks/predict.py --images 8 --rounds 1 --res 64 --no-ray --out /tmp/pb   # a smoke run

Exit status: 0 when every check passes, 1 when one fails (the table is printed either way).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))
import upload_corpus
from harness import Server, export_model
from load_client import load, payloads

if TYPE_CHECKING:
    from vit_serve.predict import PredictResult

PREDICT_OVER_GATEWAY = 1.2
RAY_OVER_LOCAL = 0.7
CONCURRENCY = 16


def phone_bases(corpus: Path) -> list[bytes]:
    paths = upload_corpus.build(corpus, upload_corpus.PHONE_NAMES)
    return [paths[name].read_bytes() for name in upload_corpus.PHONE_NAMES]


def make_folder(folder: Path, bases: list[bytes], n: int) -> None:
    """n unique 12 MP phone JPEGs in `folder` (the corpus's phone photos, numbered by a comment segment)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, body in enumerate(payloads(bases, 0, n)):
        path = folder / f"photo_{i:04d}.jpg"
        if not path.exists():
            path.write_bytes(body)


def run_predict(onnx: Path, src: Path, out: Path, engine: str = "local") -> tuple[PredictResult, float]:
    """One `predict` run from scratch: its result and the wall time of the whole call (model load included)."""
    from vit_serve.predict import PredictOptions, predict

    t0 = time.perf_counter()
    result = predict(PredictOptions(model=str(onnx), src=str(src), out=str(out), quiet=True, force=True,
                                    engine=engine))  # type: ignore[arg-type]
    wall = time.perf_counter() - t0
    if result.errors:
        raise SystemExit(f"predict could not read {result.errors[0]}")
    return result, wall


def run_gateway(server: Server, bases: list[bytes], n: int, start: int) -> float:
    """images/s of n POST /classify from 16 concurrent clients, after 16 warm-up requests: the folder's photos
    numbered from `start` (new bytes every round, so the gateway's crop store never answers: each is decoded)."""
    bodies = payloads(bases, start, n + CONCURRENCY)
    return asyncio.run(load(server.url, "/classify", bodies, CONCURRENCY, CONCURRENCY)).throughput


def checks(predict_ips: float, gateway_ips: float, ray_ips: float | None, local_ips: float | None
           ) -> list[tuple[str, str, str, bool]]:
    """(what, measured, target, ok) for the two targets (the Ray one only when it ran)."""
    out = [(f"predict / gateway /classify at c={CONCURRENCY}", f"{predict_ips / gateway_ips:.2f}x",
            f">= {PREDICT_OVER_GATEWAY}x", predict_ips >= PREDICT_OVER_GATEWAY * gateway_ips)]
    if ray_ips is not None and local_ips:
        out.append(("Ray Data engine / local engine (fixed costs out)", f"{ray_ips / local_ips:.2f}x",
                    f">= {RAY_OVER_LOCAL}x", ray_ips >= RAY_OVER_LOCAL * local_ips))
    return out


def table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in
                                                             range(len(header))) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def run(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=64, help="phone photos in the folder (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="turns of predict and the gateway (default 3)")
    p.add_argument("--model", default="Ti/16")
    p.add_argument("--res", type=int, default=224)
    p.add_argument("--out", type=Path, default=Path("/tmp/predict_bench"))
    p.add_argument("--no-ray", action="store_true", help="skip (b)")
    args = p.parse_args(argv)

    onnx = export_model(args.model, args.res, args.out)
    bases = phone_bases(args.out / "corpus")
    make_folder(args.out / "photos", bases, args.images)
    preds, gws, whole = [], [], []
    with Server(onnx, None, "cpu", 16, 5.0) as server:
        for r in range(args.rounds):
            gws.append(run_gateway(server, bases, args.images, (r + 1) * 100_000))
            result = run_predict(onnx, args.out / "photos", args.out / "preds.jsonl")[0]
            preds.append(result.steady_images_per_s)
            whole.append(result.images_per_s)
            print(f"round {r + 1}: gateway {gws[-1]:.1f} images/s, predict {preds[-1]:.1f} "
                  f"({whole[-1]:.1f} with its first batch)", file=sys.stderr)
    predict_ips, gateway_ips = statistics.median(preds), statistics.median(gws)
    rows = [(f"predict (local engine, batch 16) over {args.images} files, after its first batch",
             f"{predict_ips:.1f}", " / ".join(f"{v:.1f}" for v in preds), ""),
            ("the same with its first batch (the pipeline filling)", f"{statistics.median(whole):.1f}",
             " / ".join(f"{v:.1f}" for v in whole), ""),
            (f"gateway POST /classify, c={CONCURRENCY}", f"{gateway_ips:.1f}", " / ".join(f"{v:.1f}" for v in gws), "")]
    ray_ips = local_ips = None
    if not args.no_ray:
        import ray

        big = 4 * args.images
        make_folder(args.out / "photos_4x", bases, big)
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        runs: dict[tuple[str, str], list[float]] = {}
        try:
            for _ in range(args.rounds):  # interleaved, so that a slow spell of the machine hits every cell
                for engine in ("local", "ray"):
                    for size in ("photos", "photos_4x"):
                        runs.setdefault((engine, size), []).append(run_predict(
                            onnx, args.out / size, args.out / f"{engine}.parquet", engine=engine)[1])
        finally:
            ray.shutdown()
        walls = {k: statistics.median(v) for k, v in runs.items()}
        rates = {e: (big - args.images) / (walls[e, "photos_4x"] - walls[e, "photos"]) for e in ("local", "ray")}
        local_ips, ray_ips = rates["local"], rates["ray"]
        for engine, label in (("local", "local engine (Parquet)"), ("ray", "Ray Data engine, 2-CPU local cluster")):
            fixed = walls[engine, "photos_4x"] - big / rates[engine]
            rows.append((f"{label}: fixed costs out / end to end", f"{rates[engine]:.1f}",
                         f"{big / walls[engine, 'photos_4x']:.1f} (median {walls[engine, 'photos_4x']:.1f} s wall "
                         f"for {big}, {walls[engine, 'photos']:.1f} s for {args.images})",
                         f"fixed costs {fixed:.1f} s"))
    print(table(rows, ("run", "images/s", "rounds / end to end", "note")))
    print()
    results = checks(predict_ips, gateway_ips, ray_ips, local_ips)
    print(table([(w, m, t, "met" if ok else "NOT MET") for w, m, t, ok in results],
                ("check", "measured", "target", "")))
    return 0 if all(ok for *_, ok in results) else 1


def main(argv: list[str] | None = None) -> int:
    """`run`, its tables (and checks) saved as benchmarks/results/predict.json."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, a sibling, also when loaded by path
    from results_file import record_printed

    return record_printed("predict", run, argv)


if __name__ == "__main__":
    sys.exit(main())
