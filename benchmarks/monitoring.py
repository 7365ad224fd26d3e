"""Watching what the gateway serves (issue 24): how well OOD scores separate, how fast drift alarms, what it costs.

    python benchmarks/monitoring.py                       # the quickstart's digits model (trained if not given)
    python benchmarks/monitoring.py --model M.safetensors --parts a,b --quick

(a) OOD AUROC, held-out digits against photo crops (scikit-image's astronaut, coffee, chelsea, rocket: random
    square crops), Gaussian noise, the digits inverted and rotated 90 degrees, for max-softmax, energy,
    Mahalanobis on the embedding (`vit_serve.monitor`'s, the method the gateway uses), class-conditional
    Mahalanobis (Lee et al. 2018, shared covariance) and kNN (k=10, cosine; Sun et al. 2022). Target: AUROC >= 0.9
    on photos with monitor's method.
(b) Drift alarm: a `monitor.Window` (500, significance 0.01, min window 100, the gateway's defaults) fed held-out
    digits (drawn with replacement) then photo crops: photo requests until the alarm (target <= 200), false
    alarms over the digit stream and over repeated independent windows. The held-out digits are also the
    reference's calibration set (the trainer calibrates on its validation split, which is the digits test split),
    so the honest version is also shown: calibrated on one half of the held-out digits, streaming the other.
(c) Cost: /classify images/s at concurrency 16 with unique JPEG uploads through two real gateways (`vit-serve
    serve MODEL --no-batch-curve --pin-runtime onnxruntime`, the same with `--no-monitoring`), rounds
    alternated; target ratio >= 0.97. Both serve the runtime `--runtime` names: each gateway otherwise times the
    runtimes at load, and on a shared machine that measurement can pick different ones for the two.

Needs scikit-image (photos) and, for (c), httpx. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import vit_serve
from vit_serve import monitor
from vit_serve.preprocess import PreprocessConfig, preprocess
from vit_serve.tune.server_process import ServerExitedError, ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, a sibling, also when loaded by path
from results_file import print_checks, record_printed

METHODS = ("max-softmax", "energy", "mahalanobis (monitor)", "class-cond. mahalanobis", "knn k=10")
CHOSEN = "mahalanobis (monitor)"
OOD_SETS = ("photos", "noise", "inverted", "rot90")
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")
AUROC_TARGET, ALARM_TARGET, COST_TARGET = 0.9, 200, 0.97
KNN_K = 10


@dataclasses.dataclass
class Outputs:
    """A model's pass over a set: embeddings [N, D], logits [N, K], and labels [N] where known."""

    emb: np.ndarray
    logits: np.ndarray
    labels: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.logits)

    def take(self, idx: np.ndarray) -> Outputs:
        return Outputs(self.emb[idx], self.logits[idx], None if self.labels is None else self.labels[idx])


def auroc(inside: np.ndarray, outside: np.ndarray) -> float:
    """P(an OOD score > an in-distribution score), ties counted half (the Mann-Whitney U over n m)."""
    both = np.concatenate([inside, outside]).astype(np.float64)
    order = both.argsort(kind="stable")
    ranks = np.empty(len(both))
    ranks[order] = np.arange(1, len(both) + 1)
    for v in np.unique(both[np.r_[False, np.diff(both[order]) == 0][np.argsort(order)]]):  # average tied ranks
        ranks[both == v] = ranks[both == v].mean()
    n, m = len(inside), len(outside)
    return float((ranks[n:].sum() - m * (m + 1) / 2) / (n * m))


# ---- data --------------------------------------------------------------------------------------------------


def photo_crops(n: int, seed: int) -> list[Image.Image]:
    """n random square crops (a sixth to a half of the short side) of scikit-image's sample photos."""
    import skimage.data as skd

    rng = np.random.default_rng(seed)
    photos = [getattr(skd, name)() for name in PHOTOS]
    out = []
    for i in range(n):
        p = photos[i % len(photos)]
        if p.ndim == 2:
            p = np.stack([p] * 3, -1)
        h, w = p.shape[:2]
        s = int(rng.integers(min(h, w) // 6, min(h, w) // 2))
        y, x = int(rng.integers(0, h - s)), int(rng.integers(0, w - s))
        out.append(Image.fromarray(np.ascontiguousarray(p[y:y + s, x:x + s, :3])))
    return out


def noise_images(n: int, size: int, seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(np.clip(rng.normal(128, 64, (size, size, 3)), 0, 255).astype(np.uint8))
            for _ in range(n)]


def outputs(model: torch.nn.Module, images: list[Image.Image], cfg: PreprocessConfig, labels: np.ndarray | None = None,
            batch: int = 128) -> Outputs:
    embs, logits = [], []
    with torch.inference_mode():
        for i in range(0, len(images), batch):
            x = torch.stack([preprocess(im, cfg) for im in images[i:i + batch]])
            lo, e = model.forward_embedding(x)
            embs.append(e.float().numpy())
            logits.append(lo.float().numpy())
    return Outputs(np.concatenate(embs), np.concatenate(logits), labels)


def reference(fit: Outputs, calib: Outputs, scores: str) -> monitor.Reference:
    return monitor.build_reference(fit.emb, fit.logits, calib.emb, calib.logits, scores=scores, source="digits")


# ---- (a) OOD AUROC ------------------------------------------------------------------------------------------


def scorers(ref: monitor.Reference, fit: Outputs) -> dict[str, Callable[[Outputs], np.ndarray]]:
    """Each method: outputs -> OOD scores, higher less like the training data (fitted on `fit`)."""
    e = fit.emb.astype(np.float64)
    assert fit.labels is not None
    classes = np.unique(fit.labels)
    means = np.stack([e[fit.labels == k].mean(0) for k in classes])
    centred = e - means[np.searchsorted(classes, fit.labels)]
    cov = centred.T @ centred / len(e)
    prec = np.linalg.pinv(cov + 1e-6 * np.trace(cov) / len(cov) * np.eye(len(cov)))
    bank = e / np.linalg.norm(e, axis=1, keepdims=True)

    def class_maha(o: Outputs) -> np.ndarray:
        d = o.emb.astype(np.float64)[:, None, :] - means[None]
        return np.einsum("nkd,de,nke->nk", d, prec, d).min(1)

    def knn(o: Outputs) -> np.ndarray:
        q = o.emb.astype(np.float64)
        q = q / np.linalg.norm(q, axis=1, keepdims=True)
        sim = np.sort(q @ bank.T, axis=1)
        return 1.0 - sim[:, -min(KNN_K, sim.shape[1])]

    return {"max-softmax": lambda o: -monitor.softmax_confidence(o.logits),
            "energy": lambda o: monitor.energy(o.logits),
            CHOSEN: lambda o: monitor.ood_scores(ref, o.logits, o.emb),
            "class-cond. mahalanobis": class_maha, "knn k=10": knn}


def auroc_table(ref: monitor.Reference, fit: Outputs, held_out: Outputs, ood: dict[str, Outputs]
                ) -> dict[str, dict[str, float]]:
    return {name: {s: auroc(fn(held_out), fn(o)) for s, o in ood.items()} for name, fn in scorers(ref, fit).items()}


# ---- (b) drift alarm ----------------------------------------------------------------------------------------


def features(ref: monitor.Reference, o: Outputs, scores: str) -> tuple[np.ndarray, ...]:
    return (monitor.softmax_confidence(o.logits, scores), monitor.ood_scores(ref, o.logits, o.emb),
            monitor.project(ref, o.emb, o.logits), o.logits.argmax(-1))


@dataclasses.dataclass
class StreamResult:
    checks: int
    false_alarms: int
    photo_requests_to_alarm: int | None
    in_alarm_at_switch: bool = False


def stream(ref: monitor.Reference, digits: tuple[np.ndarray, ...], photos: tuple[np.ndarray, ...], n_digits: int,
           n_photos: int, size: int, significance: float, min_window: int, every: int, seed: int) -> StreamResult:
    """n_digits held-out digits (drawn with replacement) then up to n_photos photo crops into one Window, its
    drift tested every `every` requests."""
    rng = np.random.default_rng(seed)
    window = monitor.Window(ref, size)
    checks = alarms = 0
    for i, j in enumerate(rng.integers(0, len(digits[0]), n_digits), 1):
        window.add(*(a[j:j + 1] for a in digits))
        if i % every == 0 and i >= min_window:
            checks += 1
            alarms += window.report(significance, min_window).alarm
    before = window.report(significance, min_window).alarm
    for i, j in enumerate(rng.integers(0, len(photos[0]), n_photos), 1):
        window.add(*(a[j:j + 1] for a in photos))
        if window.report(significance, min_window).alarm:
            return StreamResult(checks, alarms, i, before)
    return StreamResult(checks, alarms, None, before)


def independent_windows(ref: monitor.Reference, digits: tuple[np.ndarray, ...], repeats: int, size: int,
                        significance: float, min_window: int, seed: int) -> float:
    """The share of `repeats` independent full windows of held-out digits (drawn with replacement) that alarm."""
    rng = np.random.default_rng(seed)
    fired = 0
    for _ in range(repeats):
        j = rng.integers(0, len(digits[0]), size)
        fired += monitor.drift(ref, *(a[j] for a in digits), significance=significance, min_window=min_window).alarm
    return fired / repeats


# ---- (c) cost -----------------------------------------------------------------------------------------------


class Gateway(ServerProcess):
    """`vit-serve serve MODEL` (with `flags`) in a subprocess on a free port, its log kept for when it fails."""

    def __init__(self, model: Path, flags: list[str]) -> None:
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        server = ServerProcess.serve([str(model), "--host", "127.0.0.1", *flags], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        super().__init__(server.proc, server.port)

    def wait_ready(self, timeout: float | None = None, poll: float = 0.2, tick=lambda: None) -> dict:
        try:
            return super().wait_ready(timeout, poll, tick)
        except ServerExitedError:
            self.log.seek(0)
            raise ServerExitedError(f"the gateway exited: {self.log.read().decode(errors='replace')[-2000:]}") \
                from None

    def serving(self) -> str:
        """The runtime that serves and how its batcher runs, from GET /models."""
        import httpx

        v = httpx.get(f"{self.url}/models", timeout=10.0).json()["models"][0]["versions"][0]
        choice, b = v.get("runtime_choice") or {}, v["batching"]
        return f"{choice.get('chosen') or v['backend']}; max batch {b['max_batch']}, wait {b['max_delay_ms']:g} ms"

    def stop(self, grace: float = 30.0) -> int | None:
        code = super().stop(grace)
        self.log.close()
        return code


def digit_jpeg(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.convert("RGB").resize((128, 128), Image.BICUBIC).save(buf, "JPEG", quality=90)
    return buf.getvalue()


async def throughput(url: str, bodies: list[bytes], concurrency: int) -> float:
    """Images/s of POST /classify of each body once, from `concurrency` clients."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=300.0) as client:
        queue = list(reversed(bodies))

        async def worker() -> None:
            while queue:
                r = await client.post("/classify", files={"file": ("d.jpg", queue.pop(), "image/jpeg")})
                r.raise_for_status()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return len(bodies) / (time.perf_counter() - t0)


def cost(model: Path, bases: list[bytes], rounds: int, per_round: int, concurrency: int, warmup: int,
         runtime: str) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Images/s per round of the two gateways serving `runtime`, rounds alternated (on, off, on, off, ...), every
    upload unique; and what each served on and how it batched."""
    from vit_serve.tune.load import unique_jpeg

    # Both batch as configured: each gateway measures its batch curve at start-up, and on a shared machine that
    # measurement's noise (batches of 1 on one, of 16 on the other) would decide the comparison instead.
    same = ["--no-batch-curve", "--pin-runtime", runtime]
    gateways = {"monitoring on": Gateway(model, same), "monitoring off": Gateway(model, [*same, "--no-monitoring"])}
    out: dict[str, list[float]] = {k: [] for k in gateways}
    serving: dict[str, str] = {}
    k = 0

    def bodies(n: int) -> list[bytes]:
        nonlocal k
        k += n
        return [unique_jpeg(bases[i % len(bases)], i) for i in range(k - n, k)]

    try:
        for g in gateways.values():
            g.wait_ready()
            asyncio.run(throughput(g.url, bodies(warmup), concurrency))
        serving = {name: g.serving() for name, g in gateways.items()}
        for _ in range(rounds):
            for name, g in gateways.items():
                out[name].append(asyncio.run(throughput(g.url, bodies(per_round), concurrency)))
    finally:
        for g in gateways.values():
            g.stop()
    return out, serving


# ---- the run ------------------------------------------------------------------------------------------------


def train_quickstart(out: Path) -> Path:
    """The quickstart's fine-tuned digits model (its settings; reused when `out` has it)."""
    from vit_serve import quickstart
    from vit_serve.train.loop import train

    paths = quickstart.QuickstartPaths(out)
    for cfg, ckpt in ((quickstart.pretrain_config(paths), paths.pretrain), (quickstart.finetune_config(paths),
                                                                           paths.finetune)):
        if not (ckpt / "model.safetensors").exists():
            train(cfg)
    return paths.finetune / "model.safetensors"


def table(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                      *("| " + " | ".join(r) + " |" for r in rows)])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, help="a digits model (.safetensors); default: train the quickstart's")
    p.add_argument("--work", type=Path, default=Path("/tmp/vit_serve_monitoring"),
                   help="where the quickstart's model is trained (reused)")
    p.add_argument("--parts", default="a,b,c", help="which parts: a (AUROC), b (alarm), c (cost); default a,b,c")
    p.add_argument("--quick", action="store_true", help="small sizes, for CI: a few seconds per part")
    p.add_argument("--crops", type=int, help="photo crops (default 400; --quick 60)")
    p.add_argument("--stream", type=int, help="held-out digits streamed before the switch (default 2000)")
    p.add_argument("--window", type=int, default=500, help="drift window size (the gateway's default 500)")
    p.add_argument("--significance", type=float, default=monitor.DEFAULT_SIGNIFICANCE)
    p.add_argument("--min-window", type=int, default=monitor.DEFAULT_MIN_WINDOW)
    p.add_argument("--check-every", type=int, default=1, help="drift test every N digit requests (default 1)")
    p.add_argument("--repeats", type=int, help="independent windows for the false-alarm rate (default 200)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, help="(c) rounds per gateway (default 5; --quick 1)")
    p.add_argument("--per-round", type=int, help="(c) requests per round (default 2000; --quick 64)")
    p.add_argument("--runtime", default="onnxruntime",
                   help="(c) the runtime both gateways serve (their --pin-runtime; default onnxruntime)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    q = a.quick
    a.crops = a.crops or (60 if q else 400)
    a.stream = a.stream or (300 if q else 2000)
    a.repeats = a.repeats or (10 if q else 200)
    a.rounds = a.rounds or (1 if q else 5)
    a.per_round = a.per_round or (64 if q else 2000)
    a.parts = {s.strip() for s in a.parts.split(",") if s.strip()}
    if not a.parts <= {"a", "b", "c"}:
        p.error(f"--parts: a, b or c, got {','.join(sorted(a.parts))}")
    return a


def run(argv: list[str] | None = None) -> int:
    from vit_serve.data import digits_images

    args = parse_args(argv)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    model_path = args.model or train_quickstart(args.work)
    model = vit_serve.load(model_path).eval()
    cfg = model.preprocess_cfg or PreprocessConfig(input_size=model.cfg.img_size)
    scores = model.cfg.scores
    ok = True
    checks: list[tuple[str, str, str, bool]] = []
    tr, ytr = digits_images("train")
    te, yte = digits_images("test")
    if args.quick:
        tr, ytr = tr[:400], ytr[:400]
    print(f"model {model_path}: {model.cfg.img_size[0]}x{model.cfg.img_size[1]}, {model.cfg.num_classes} classes; "
          f"fit on {len(tr)} training digits, held out {len(te)} (the reference's calibration set)\n")
    fit, held = outputs(model, tr, cfg, ytr), outputs(model, te, cfg, yte)
    # the model's own reference (what the gateway serves with, from `vit-serve train`), else one built alike
    ref = model.reference if model.reference is not None and not args.quick else reference(fit, held, scores)
    print(f"reference: {'the model' + chr(39) + 's own' if ref is model.reference else 'built here'}: "
          f"{ref.describe()}\n")
    photos = outputs(model, photo_crops(args.crops, args.seed), cfg)
    if "a" in args.parts:
        ood = {"photos": photos, "noise": outputs(model, noise_images(len(photos), 32, args.seed), cfg),
               "inverted": outputs(model, [Image.fromarray(255 - np.asarray(im)) for im in te], cfg),
               "rot90": outputs(model, [im.rotate(90) for im in te], cfg)}
        res = auroc_table(ref, fit, held, ood)
        print(f"(a) OOD AUROC, {len(held)} held-out digits vs each set "
              f"({', '.join(f'{k} {len(v)}' for k, v in ood.items())})\n")
        print(table(["method", *OOD_SETS], [[m + (" *" if m == CHOSEN else ""), *(f"{res[m][s]:.3f}"
                                                                                  for s in OOD_SETS)]
                                            for m in METHODS]))
        hit = res[CHOSEN]["photos"] >= AUROC_TARGET
        ok &= hit
        checks.append(("(a) photos OOD AUROC, the gateway's method", f"{res[CHOSEN]['photos']:.3f}",
                       f">= {AUROC_TARGET}", hit))
        print(f"\n* the gateway's method; photos AUROC {res[CHOSEN]['photos']:.3f} (target >= {AUROC_TARGET}): "
              f"{'ok' if hit else 'MISSED'}\n")
    if "b" in args.parts:
        kw = dict(size=args.window, significance=args.significance, min_window=args.min_window)
        half = np.random.default_rng(args.seed).permutation(len(held))
        a_idx, b_idx = np.sort(half[:len(held) // 2]), np.sort(half[len(held) // 2:])
        honest = reference(fit, held.take(a_idx), scores)
        rows = []
        for name, r, stream_set in (("calibrated on all held-out, streams them", ref, held),
                                    ("calibrated on half, streams the other half", honest, held.take(b_idx))):
            d, p = features(r, stream_set, scores), features(r, photos, scores)
            s = stream(r, d, p, args.stream, 10 * ALARM_TARGET, every=args.check_every, seed=args.seed, **kw)
            rate = independent_windows(r, d, args.repeats, seed=args.seed + 1, **kw)
            rows.append([name, str(len(r.scores)), f"{s.false_alarms} / {s.checks}", f"{rate:.3f}",
                         "already in alarm" if s.in_alarm_at_switch else str(s.photo_requests_to_alarm or "none")])
            if r is ref:
                fired = s.photo_requests_to_alarm
                ok &= fired is not None and fired <= ALARM_TARGET
                checks.append(("(b) photo requests to the drift alarm", str(fired), f"<= {ALARM_TARGET}",
                               fired is not None and fired <= ALARM_TARGET))
        print(f"(b) drift alarm: window {args.window}, significance {args.significance}, min window "
              f"{args.min_window}; {args.stream} held-out digits (with replacement, tested every "
              f"{args.check_every}) then photo crops; {args.repeats} independent windows\n")
        print(table(["reference", "calibration", "false alarms (checks)", f"false-alarm rate ({args.repeats} windows)",
                     "photo requests to alarm"], rows))
        print(f"\ntarget: alarm within {ALARM_TARGET} photo requests; the expected false-alarm rate of independent "
              f"windows is at most {args.significance} (Bonferroni is conservative)\n")
    if "c" in args.parts:
        bases = [digit_jpeg(im) for im in te[:50]]
        res_c, serving = cost(Path(model_path), bases, args.rounds, args.per_round, args.concurrency,
                     warmup=max(32, args.per_round // 10), runtime=args.runtime)
        on, off = (float(np.median(res_c[k])) for k in ("monitoring on", "monitoring off"))
        print(f"(c) /classify images/s, concurrency {args.concurrency}, {args.rounds} rounds x {args.per_round} "
              f"unique uploads per gateway, alternated (median)\n")
        print(table(["gateway", "images/s", "rounds", "runtime; batching"],
                    [[k, f"{float(np.median(v)):.1f}", " ".join(f"{x:.1f}" for x in v), serving[k]]
                     for k, v in res_c.items()]))
        hit = on / off >= COST_TARGET
        ok &= hit
        checks.append(("(c) images/s, monitoring on / off", f"{on / off:.3f}", f">= {COST_TARGET}", hit))
        print(f"\nratio on / off {on / off:.3f} (target >= {COST_TARGET}): {'ok' if hit else 'MISSED'}\n")
    print_checks(checks)
    return 0 if ok or args.quick else 1


def main(argv: list[str] | None = None) -> int:
    """`run`, its tables and checks saved as benchmarks/results/monitoring.json."""
    return record_printed("monitoring", run, argv)


if __name__ == "__main__":
    sys.exit(main())
