"""Which runtime serves a model, chosen by measurement at load: the contenders' images/s at batch 1 and at the
batch limit (`time_runs`, within a budget, like the batch curve's), their accuracy against the fp32 reference
(`accuracy`, `refusal`), and the choice (`choose`: the fastest that meets its precision's bounds, or the pinned
one). `RuntimeChoice` is the table the gateway logs and /models shows.

Pure but for `time_runs`, whose clock is injected (tests drive it with a fake one). The contenders themselves (what
a checkpoint's forward or an export's file can run on) are `runtime.torch_forwards` and `runtime.backends.choice`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from vit_serve import accuracy_bounds

# (top-1 agreement, logits' cosine) with the fp32 reference that a precision must reach to serve: the reduced
# precisions' are the exporter's and the accuracy gate's (`vit_serve.accuracy_bounds`); a full-precision runtime
# differs from the reference by reassociation only, so far less.
BOUNDS: dict[str, tuple[float, float]] = {"fp32": (0.995, 0.9999), **accuracy_bounds.BOUNDS}
ROUNDS = 3
BUDGET_S = 10.0


@dataclass(frozen=True)
class Row:
    """One contender: `runtime` (e.g. "eager", "onnxruntime") at `precision`; its images/s by batch size
    (`images_per_s`, empty: not measured); its top-1 agreement and logits' cosine with the reference (None: not
    compared); `refused`: why it may not serve (its load failed, it missed its bounds), else None."""

    runtime: str
    precision: str = "fp32"
    images_per_s: dict[int, float] = field(default_factory=dict)
    agreement: float | None = None
    cosine: float | None = None
    refused: str | None = None

    @property
    def key(self) -> str:
        """"runtime:precision", the form a pin takes."""
        return f"{self.runtime}:{self.precision}"

    @property
    def score(self) -> float:
        """The geometric mean of its images/s over the measured batch sizes (0.0: none measured): batch 1 stands
        for latency, the batch limit for throughput, neither outweighs the other."""
        rates = [r for r in self.images_per_s.values() if r > 0]
        return math.exp(sum(map(math.log, rates)) / len(rates)) if rates else 0.0


@dataclass(frozen=True)
class RuntimeChoice:
    """The table of a choice: its `rows` (the first is the reference), the `chosen` row's key, whether it was
    `pinned` (nothing measured then), the `threads` the contenders ran on (0: each runtime's default) and the
    `seconds` the choice took."""

    rows: tuple[Row, ...]
    chosen: str
    pinned: bool = False
    threads: int = 0
    seconds: float = 0.0

    def describe(self) -> str:
        """One line: 'eager:fp32 30.1/28.0 images/s (batch 1/8), onnxruntime:fp32 41.2/40.3, agreement 1.000,
        cosine 1.000000 <- chosen; ...'."""
        parts = []
        for r in self.rows:
            rates = "/".join(f"{v:.1f}" for _, v in sorted(r.images_per_s.items()))
            sizes = "/".join(str(b) for b in sorted(r.images_per_s))
            speed = f"{rates} images/s (batch {sizes})" if rates else "not measured"
            acc = "" if r.agreement is None or r.cosine is None else \
                f", agreement {r.agreement:.3f}, cosine {r.cosine:.6f}"
            tail = " <- chosen" if r.key == self.chosen else (f" (refused: {r.refused})" if r.refused else "")
            parts.append(f"{r.key} {speed}{acc}{tail}")
        threads = f"{self.threads} threads" if self.threads else "each runtime's own threads"
        how = "pinned" if self.pinned else f"measured in {self.seconds:.1f} s on {threads}"
        return f"{'; '.join(parts)} ({how})"


def parse_pin(pin: str) -> tuple[str, str | None]:
    """"runtime" or "runtime:precision" -> (runtime, precision or None)."""
    runtime, _, precision = pin.strip().partition(":")
    return runtime, precision or None


def accuracy(reference: np.ndarray, logits: np.ndarray) -> tuple[float, float]:
    """(top-1 agreement, mean cosine of the rows) of `logits` [N, K] with `reference` [N, K]; a row with a NaN or
    an infinity disagrees (cosine 0), a zero row has cosine 1 with an equal one, else 0."""
    ref, got = reference.astype(np.float64), logits.astype(np.float64)
    finite = np.isfinite(got).all(-1)
    got = np.where(finite[:, None], got, 0.0)
    agree = float(np.mean(finite & (ref.argmax(-1) == got.argmax(-1))))
    norms = np.linalg.norm(ref, axis=-1) * np.linalg.norm(got, axis=-1)
    same = (ref == got).all(-1)  # e.g. both zero (an untrained head): equal, whatever the cosine cannot say
    cos = np.where(norms > 0, (ref * got).sum(-1) / np.where(norms > 0, norms, 1), same.astype(np.float64))
    return agree, float(np.where(finite, cos, 0.0).mean())


def refusal(precision: str, agreement: float, cosine: float) -> str | None:
    """Why a contender at `precision` with these numbers may not serve (under its `BOUNDS`), else None."""
    min_agree, min_cos = BOUNDS.get(precision, BOUNDS["fp32"])
    if agreement >= min_agree and cosine >= min_cos:
        return None
    return (f"top-1 agreement {agreement:.3f} (bound {min_agree}), cosine {cosine:.6f} (bound {min_cos}) with the "
            f"fp32 reference")


def choose(rows: Sequence[Row], pin: str | None = None) -> Row:
    """The row that serves: the pinned one (`pin`: "runtime" or "runtime:precision"), else the highest `score`
    among those not refused (a tie: the earlier, the reference first). ValueError when the pin names none of
    `rows`, or when every row is refused."""
    if pin is not None:
        runtime, precision = parse_pin(pin)
        for r in rows:
            if r.runtime == runtime and precision in (None, r.precision):
                return r
        raise ValueError(f"pin_runtime {pin!r} names none of this model's runtimes ("
                         f"{', '.join(r.key for r in rows)})")
    allowed = [r for r in rows if r.refused is None]
    if not allowed:
        raise ValueError("no runtime meets its accuracy bounds: " + "; ".join(f"{r.key}: {r.refused}" for r in rows))
    return max(allowed, key=lambda r: (r.score, -allowed.index(r)))


def time_runs(runs: Mapping[str, Callable[[np.ndarray], object]], image: np.ndarray, batches: Sequence[int],
              budget_s: float = BUDGET_S, rounds: int = ROUNDS, clock: Callable[[], float] = time.perf_counter
              ) -> dict[str, dict[int, float]]:
    """Images/s of each of `runs` (key -> a classify on x [B, 3, H, W]) on `image` [1, 3, H, W] repeated to each of
    `batches`: the median over up to `rounds` interleaved rounds (every run at every size in turn, so that a slow
    moment of a shared machine touches all alike), after one untimed warm-up call each at batch 1. The rounds stop
    once `budget_s` is spent (the first always completes: every contender gets a number); within a later round, a
    call whose last time would overrun the budget is skipped."""
    xs = {b: np.repeat(image, b, axis=0) for b in sorted(set(batches))}
    times: dict[str, dict[int, list[float]]] = {k: {b: [] for b in xs} for k in runs}
    start = clock()
    for run in runs.values():
        run(xs[min(xs)])
    for i in range(rounds):
        for key, run in runs.items():
            for b, x in xs.items():
                if i and clock() - start + times[key][b][-1] > budget_s:
                    continue
                t0 = clock()
                run(x)
                times[key][b].append(max(clock() - t0, 1e-9))
        if clock() - start > budget_s:
            break
    return {k: {b: b / statistics.median(t) for b, t in by.items() if t} for k, by in times.items()}
