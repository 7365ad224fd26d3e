"""A request's answer from its runner: its slice of its batch's outputs, and what it waited and ran."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vit_serve.runtime.task import Outputs


@dataclass(frozen=True)
class Result:
    """A request's slice of its batch's outputs, with its queue wait, the batch's run time and size."""

    outputs: Outputs
    queue_ms: float
    infer_ms: float
    batch_size: int

    @staticmethod
    def joined(parts: list[Result]) -> Result:
        """The answer of a request run as several parts: their outputs concatenated in order, the longest queue
        wait, the model time of all of them, the largest batch."""
        if len(parts) == 1:
            return parts[0]
        outputs = {k: np.concatenate([p.outputs[k] for p in parts]) for k in parts[0].outputs}
        return Result(outputs, max(p.queue_ms for p in parts), sum(p.infer_ms for p in parts),
                      max(p.batch_size for p in parts))

    def timing_ms(self, decode_ms: float, total_ms: float) -> dict[str, float]:
        """The answer's `timing_ms` (schemas.Timing): decode, queue, infer, total and the batch size."""
        return {"decode": decode_ms, "queue": self.queue_ms, "infer": self.infer_ms, "total": total_ms,
                "batch_size": self.batch_size}
