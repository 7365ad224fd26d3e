"""PyTorch eager vs onnxruntime on this CPU, measured when the torch backend loads a checkpoint (`probe`), and
what to say when onnxruntime is clearly faster (`advice`).

The torch backend probes when it serves a checkpoint on the CPU in eager mode (no --compile), in fp32, with
onnxruntime installed, unless VIT_SERVE_TORCH_PROBE is "0" (`wanted`). `measure` exports the model in memory
with the TorchScript exporter (`torch.onnx.export(dynamo=False)`: ~2 s for a ViT-S/16 on 2 cores; the dynamo
exporter takes longer) into a session with the gateway's own options
(`runtime.backends.onnxruntime.session_options`) and times both at batch 1, at the model's resolution, on the
same intra-op threads, in interleaved rounds whose medians it compares, within a time budget. A ratio
onnxruntime / eager of `THRESHOLD` or more makes `advice` a WARNING naming the one-line alternative: serve the
export.
"""

from __future__ import annotations

import importlib.util
import io
import logging
import os
import shlex
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vit_serve.tome import TomeR

log = logging.getLogger("vit_serve.runtime")

ENV = "VIT_SERVE_TORCH_PROBE"
THRESHOLD = 1.2  # onnxruntime / eager at or above which start-up says so
BUDGET_S = 1.0  # the timed rounds' share of the probe (the export and the warm-up calls come on top)
ROUNDS = 5
MAX_CALLS = 5  # per contender and round: a tiny model's probe stays a fraction of a second


@dataclass(frozen=True)
class ProbeResult:
    """Images/s of PyTorch eager and onnxruntime at batch 1 (medians over `rounds` interleaved rounds) on
    `threads` intra-op threads, and the probe's wall time in seconds (export included)."""

    eager_ips: float
    ort_ips: float
    threads: int
    rounds: int
    seconds: float

    @property
    def ratio(self) -> float:
        """onnxruntime's images/s over eager's (> 1: onnxruntime is faster)."""
        return self.ort_ips / self.eager_ips


def wanted(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the torch backend probes a model on `device` in `dtype`: the CPU, fp32, onnxruntime installed, and
    VIT_SERVE_TORCH_PROBE not "0"."""
    return (device.type == "cpu" and dtype == torch.float32 and os.environ.get(ENV, "1").strip() != "0"
            and importlib.util.find_spec("onnxruntime") is not None)


def _session(model: torch.nn.Module, x: torch.Tensor) -> object:
    import onnxruntime as ort

    from vit_serve.runtime.backends.onnxruntime import session_options

    buf = io.BytesIO()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer warnings
        torch.onnx.export(model, (x,), buf, dynamo=False, opset_version=17, input_names=["pixel_values"],
                          output_names=["logits"])
    return ort.InferenceSession(buf.getvalue(), session_options(torch.get_num_threads()),
                                providers=["CPUExecutionProvider"])


def _seconds(fn: Callable[[], object], calls: int = 1) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - t0


def measure(model: torch.nn.Module, x: torch.Tensor, budget_s: float = BUDGET_S, rounds: int = ROUNDS
            ) -> ProbeResult:
    """`model` (eval mode, CPU, x [1, 3, H, W] -> logits) in eager mode vs its in-memory ONNX export on
    onnxruntime: a warm-up call each, then up to `rounds` interleaved rounds of the same number of calls each
    (as many as fit `budget_s` over all rounds, at least one, at most `MAX_CALLS`), stopping early once
    `budget_s` is spent. Raises whatever the export or onnxruntime raises."""
    t0 = time.perf_counter()
    session = _session(model, x)
    feed = {"pixel_values": x.numpy()}
    with torch.inference_mode():
        def eager() -> object:
            return model(x)

        def ort() -> object:
            return session.run(None, feed)  # type: ignore[attr-defined]

        _seconds(eager)  # lazy initialisation on both sides
        _seconds(ort)
        per_round = _seconds(eager) + _seconds(ort)
        calls = max(1, min(MAX_CALLS, int(budget_s / (rounds * max(per_round, 1e-6)))))
        deadline = time.perf_counter() + budget_s
        eager_ips, ort_ips = [], []
        for _ in range(rounds):  # interleaved: a busy neighbour slows both alike
            eager_ips.append(calls / _seconds(eager, calls))
            ort_ips.append(calls / _seconds(ort, calls))
            if time.perf_counter() > deadline:
                break
    return ProbeResult(statistics.median(eager_ips), statistics.median(ort_ips), torch.get_num_threads(),
                       len(eager_ips), time.perf_counter() - t0)


def probe(model: torch.nn.Module, x: torch.Tensor, name: str) -> ProbeResult | None:
    """`measure`, or None (with a debug line) when the export or onnxruntime fails."""
    try:
        result = measure(model, x)
    except Exception as e:  # the exporter and onnxruntime raise many types; the probe is advice only
        log.debug("torch probe of %s skipped: %s: %s", name, type(e).__name__, " ".join(str(e).split())[:300])
        return None
    log.debug("torch probe of %s: eager %.1f images/s, onnxruntime %.1f (%.2fx), %d threads, %.2f s", name,
              result.eager_ips, result.ort_ips, result.ratio, result.threads, result.seconds)
    return result


def tome_arg(tome: TomeR) -> str:
    """The --tome argument that gives `tome` (`vit_serve.tome.parse_tome`'s forms)."""
    if isinstance(tome, tuple):
        return f"{tome[0]}:{tome[1]:g}"
    if isinstance(tome, list):
        return ",".join(map(str, tome))
    return str(tome)


def advice(result: ProbeResult, name: str, source: str, tome: TomeR | None = None,
           threshold: float = THRESHOLD) -> str | None:
    """The start-up warning when onnxruntime is at least `threshold` times as fast as eager (else None): the
    measured rates and ratio, and the commands that export `source` and serve the export instead."""
    if not result.ratio >= threshold:
        return None
    tome_flag = "" if tome is None else f" --tome {tome_arg(tome)}"
    export = f"vit-export {shlex.quote(source)} --out exports --name {shlex.quote(name)}{tome_flag}"
    return (f"torch eager runs {name} at {result.eager_ips:.1f} images/s, onnxruntime at {result.ort_ips:.1f} "
            f"({result.ratio:.2f}x) on this CPU (batch 1, {result.threads} threads): serve the export instead: "
            f"{export} && vit-serve serve {shlex.quote(f'exports/{name}.onnx')} (or try --compile; "
            f"{ENV}=0 skips this check)")
