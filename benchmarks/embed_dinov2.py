"""Image embeddings of DINOv2-S/14 served: the gateway's `POST /embed` against `vit-serve predict --embeddings`.

The model: timm's `vit_small_patch14_dinov2` at `--res` (default 224), random weights (seed 0), loaded into our
VisionTransformer (benchmarks/families.py's `build_pair`: the same weights, bit-exact), headless as timm's, saved
and exported by vit-export with `outputs=logits,embedding` (benchmarks/harness.py's `export_model`; onnxruntime,
as benchmarks/serve_load.py and benchmarks/predict.py serve it).

Inputs, as benchmarks/predict.py's: `--corpus phone` (default) the 12 MP phone JPEGs of
benchmarks/upload_corpus.py, `--corpus small` a 451x300 photo, each copy made unique with
`load_client.unique_jpeg` (a numbered comment segment: new bytes and sha256, the same pixels and decode work).

* the gateway (the harness's `Server`: uvicorn in a subprocess, server defaults, dynamic batching up to 16):
  `--images` unique uploads to `POST /embed` from 16 concurrent clients, after 16 warm-up requests, new bytes
  every round so that the crop store never answers;
* offline: `predict` (local engine, its defaults: fast decode, batch 16) with `embeddings=True` on a folder of
  the same number of unique files, its rate after its first batch (the pipeline filling; as the load test leaves
  out its warm-up), and with it.

Rounds take turns; medians are compared: the ratio /embed / predict (no target in issue 21: reported). A sanity
line: the /embed vector of one file against predict's row for it (max |diff|, onnxruntime both: 0 expected).

    python benchmarks/embed_dinov2.py --images 64 --rounds 3 --out /tmp/embed_dinov2     # ~5 min on 2 cores
    python benchmarks/embed_dinov2.py --tiny --corpus small --images 8 --rounds 1 --out /tmp/ed  # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import families  # siblings: the family table, the load generator and server, predict's folder and table
import predict as predict_bench
from harness import Server, export_model
from load_client import load, payloads, photo_jpeg

CONCURRENCY = 16
DINOV2 = next(f for f in families.FAMILIES if f.key == "dinov2")


def bases_for(corpus: str, folder: Path) -> list[bytes]:
    """The upload bodies' originals: the corpus's 12 MP phone JPEGs, or one small real photo."""
    return predict_bench.phone_bases(folder) if corpus == "phone" else [photo_jpeg()]


def gateway_round(url: str, bases: list[bytes], n: int, start: int) -> float:
    """images/s of n POST /embed (unique bodies numbered from `start`) from 16 clients, after 16 warm-up ones."""
    bodies = payloads(bases, start, n + CONCURRENCY)
    return asyncio.run(load(url, "/embed", bodies, CONCURRENCY, CONCURRENCY)).throughput


def predict_round(onnx: Path, src: Path, out: Path) -> tuple[float, float]:
    """One `predict --embeddings` run: (images/s after its first batch, images/s with it)."""
    from vit_serve.predict import PredictOptions, predict

    result = predict(PredictOptions(model=str(onnx), src=str(src), out=str(out), embeddings=True, quiet=True,
                                    force=True))
    if result.errors:
        raise SystemExit(f"predict could not read {result.errors[0]}")
    # one batch only (a smoke run): no rate after the first batch; the whole run's rate stands in
    return result.steady_images_per_s or result.images_per_s, result.images_per_s


def embedding_diff(url: str, photo: Path, preds: Path) -> tuple[int, float]:
    """(dim, max |diff|) between /embed of `photo` and predict's embedding row for it."""
    import httpx
    import numpy as np

    r = httpx.post(f"{url}/embed", files={"file": (photo.name, photo.read_bytes(), "image/jpeg")}, timeout=300)
    r.raise_for_status()
    served = np.asarray(r.json()["embedding"], dtype=np.float64)
    rows = [json.loads(line) for line in preds.read_text().splitlines() if line.strip()]
    row = next(row for row in rows if Path(row["path"]).name == photo.name)
    return len(served), float(np.abs(served - np.asarray(row["embedding"], dtype=np.float64)).max())


def report(gws: list[float], steady: list[float], whole: list[float], n: int, corpus: str,
           dim: int, diff: float) -> str:
    """The markdown table and the ratio line."""
    gw, pr = statistics.median(gws), statistics.median(steady)
    rows = [(f"gateway POST /embed, c={CONCURRENCY}, {n} unique {corpus} uploads", f"{gw:.1f}",
             " / ".join(f"{v:.1f}" for v in gws)),
            (f"predict --embeddings over {n} files, after its first batch", f"{pr:.1f}",
             " / ".join(f"{v:.1f}" for v in steady)),
            ("the same with its first batch (the pipeline filling)", f"{statistics.median(whole):.1f}",
             " / ".join(f"{v:.1f}" for v in whole)),
            ("ratio /embed / predict (medians)", f"{gw / pr:.2f}x", "")]
    return (predict_bench.table(rows, ("run", "images/s", "rounds")) +
            f"\n\nsanity: /embed and predict agree on one file: dim {dim}, max |diff| {diff:.1e}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=64, help="unique uploads per round and files in the folder")
    p.add_argument("--rounds", type=int, default=3, help="turns of the gateway and predict (default 3)")
    p.add_argument("--res", type=int, default=224)
    p.add_argument("--corpus", choices=("phone", "small"), default="phone")
    p.add_argument("--out", type=Path, default=Path("/tmp/embed_dinov2"))
    p.add_argument("--tiny", action="store_true", help="smoke run: a 2-layer, 32-wide DINOv2 (res 28)")
    args = p.parse_args(argv)
    res = 28 if args.tiny else args.res

    onnx = export_model(lambda: families.build_pair(DINOV2, res, args.tiny)[1], res, args.out,
                        outputs="logits,embedding")
    bases = bases_for(args.corpus, args.out / "corpus")
    folder = args.out / f"photos_{args.corpus}"
    predict_bench.make_folder(folder, bases, args.images)
    preds = args.out / "embeddings.jsonl"
    gws, steady, whole = [], [], []
    with Server(onnx, None, "cpu", 16, 5.0) as server:
        for r in range(args.rounds):
            gws.append(gateway_round(server.url, bases, args.images, (r + 1) * 100_000))
            s, w = predict_round(onnx, folder, preds)
            steady.append(s)
            whole.append(w)
            print(f"round {r + 1}: /embed {gws[-1]:.1f} images/s, predict --embeddings {s:.1f} ({w:.1f} with its "
                  f"first batch)", file=sys.stderr)
        dim, diff = embedding_diff(server.url, sorted(folder.glob("*.jpg"))[0], preds)
    print(f"\nDINOv2-S/14 at {res}, random weights, onnxruntime CPU; median of {args.rounds} rounds\n")
    print(report(gws, steady, whole, args.images, args.corpus, dim, diff))
    return 0


if __name__ == "__main__":
    sys.exit(main())
