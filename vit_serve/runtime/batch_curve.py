"""What batching buys a backend: its time per image at each batch size (`BatchCurve`), measured when a model
version warms up (`measure`).

On a GPU a batch of 16 costs about what one image does, and waiting a few milliseconds for more requests pays.
On a CPU the work grows with the rows: onnxruntime runs ViT-S/16 as fast at batch 1 as at batch 10 (34.7 vs
33.5 images/s on two AVX-512 cores), so a batcher that waits for a batch to fill only idles the model, and a
large batch is slower per image than a small one. The batcher (`vit_serve.runtime.scheduling.BatchingRunner`) asks the
curve how large a batch may be (`limit`: the smallest batch within `TOLERANCE` of the best time per image) and
whether waiting for one pays (`worth_waiting`: the best batch at least `MIN_GAIN` faster per image than batch 1).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

# A batch size counts as good as the best when its time per image is within 2% of it: the run-to-run noise of a
# few rounds on a shared CPU. The smallest such size is the batch limit (less waiting for rows, same rate).
TOLERANCE = 0.02
# Waiting for a batch to fill pays when the limit's batch is at least 5% faster per image than batch 1; below
# that, the wait (up to max_delay_ms of an idle model) costs more than the batch saves.
MIN_GAIN = 1.05


@dataclass
class BatchCurve:
    """Seconds per image by batch size (`per_image_s`), for batches of up to `max_batch` rows."""

    max_batch: int
    per_image_s: dict[int, float] = field(default_factory=dict)

    def gain(self, rows: int) -> float:
        """Images/s at batch `rows` over images/s at batch 1 (1.0 when either is unknown)."""
        one, b = self.per_image_s.get(1), self.per_image_s.get(rows)
        return one / b if one and b else 1.0

    def batch_s(self, rows: int) -> float | None:
        """Seconds one batch of `rows` images takes: `rows` x the time per image, interpolated linearly between
        the measured sizes (beyond the largest, its time per image); None before anything is measured."""
        if not self.per_image_s or rows < 1:
            return None
        known = sorted(self.per_image_s.items())
        below = [(b, s) for b, s in known if b <= rows] or known[:1]
        above = [(b, s) for b, s in known if b >= rows] or known[-1:]
        (b0, s0), (b1, s1) = below[-1], above[0]
        per_image = s0 if b1 == b0 else s0 + (s1 - s0) * (rows - b0) / (b1 - b0)
        return rows * per_image

    @property
    def limit(self) -> int:
        """The largest batch worth running: the smallest measured size whose time per image is within
        `TOLERANCE` of the best (max_batch before anything is measured)."""
        if not self.per_image_s:
            return self.max_batch
        best = min(self.per_image_s.values())
        return min(b for b, s in self.per_image_s.items() if s <= best * (1 + TOLERANCE))

    @property
    def worth_waiting(self) -> bool:
        """Whether a batch of `limit` rows is at least `MIN_GAIN` faster per image than batch 1 (True before
        anything is measured: batching as configured)."""
        return not self.per_image_s or (self.limit > 1 and self.gain(self.limit) >= MIN_GAIN)

    def describe(self, max_delay_ms: float) -> str:
        """'1: 29.1, 2: 30.0, 4: 29.8 images/s; batches of up to 2, no waiting', or '..., waiting up to 2 ms for
        more' (`max_delay_ms`: the version's batching delay)."""
        rates = ", ".join(f"{b}: {1 / s:.1f}" for b, s in sorted(self.per_image_s.items()))
        wait = f"waiting up to {max_delay_ms:g} ms for more" if self.worth_waiting else \
            f"no waiting (batching gains under {(MIN_GAIN - 1) * 100:.0f}%)"
        return f"{rates} images/s; batches of up to {self.limit}, {wait}"


def sizes(max_batch: int) -> list[int]:
    """The batch sizes measured at warm-up: 1, 2, 4, ... and max_batch itself."""
    out = [1]
    while out[-1] * 2 < max_batch:
        out.append(out[-1] * 2)
    return [*out, max_batch] if max_batch > 1 else out


def measure(run: Callable[[np.ndarray], object], image: np.ndarray, max_batch: int, budget_s: float = 10.0,
            rounds: int = 3) -> BatchCurve:
    """The curve of `run` (a backend's classify) on `image` [1, 3, H, W] repeated to each of `sizes(max_batch)`:
    the median seconds per image over up to `rounds` interleaved rounds (the sizes in turn, so that a slow moment
    of a shared machine touches all of them, and a size's first run, which may allocate, is outvoted), stopping
    when `budget_s` is spent. A size whose single run would
    not fit the budget left is not measured, nor any larger one."""
    batches = {b: np.repeat(image, b, axis=0) for b in sizes(max_batch)}
    times: dict[int, list[float]] = {b: [] for b in batches}
    start = time.perf_counter()
    for _ in range(rounds):
        below = 0.0  # the size below's time: a size not yet run is guessed at twice that
        for b, x in batches.items():
            guess = statistics.median(times[b]) if times[b] else 2 * below
            if time.perf_counter() - start + guess > budget_s:
                break
            t0 = time.perf_counter()
            run(x)
            times[b].append(time.perf_counter() - t0)
            below = statistics.median(times[b])
        if time.perf_counter() - start > budget_s:
            break
    return BatchCurve(max_batch, {b: statistics.median(t) / b for b, t in times.items() if t})
