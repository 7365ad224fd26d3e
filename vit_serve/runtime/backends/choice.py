"""Which backend serves an exported file when several can (`FILE_RUNTIMES`), chosen by measurement at load
(`choose_backend`), as `runtime.torch_forwards` chooses a checkpoint's forward: each contender loaded, its logits
checked against the reference's (the first runtime of the file's suffix, fp32) on a fixed seeded batch, all timed
at batch 1 and the batch limit within the budget (`runtime.runtime_choice`), the fastest that passes kept and the
others closed. A runtime or precision is one line in `FILE_RUNTIMES`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from vit_serve.runtime.backends.base import Backend, LocalBackend
from vit_serve.runtime.runtime_choice import Row, RuntimeChoice, accuracy, choose, parse_pin, refusal, time_runs
from vit_serve.runtime.spec import LoadSpec

log = logging.getLogger("vit_serve.runtime")

# The runtimes that serve a file, by suffix, as (backend, precision); the first is the fp32 reference. OpenVINO's
# "auto" is the model's precision setting (itself "auto" unless set: the plugin's native, bf16 where the CPU has it).
FILE_RUNTIMES: dict[str, tuple[tuple[str, str], ...]] = {
    ".onnx": (("onnxruntime", "fp32"), ("openvino", "auto")),
}
# The names OpenVINO's precision setting gives what the table calls fp32 and fp16.
_OPENVINO_NAMES = {"fp32": "f32", "fp16": "f16"}
ACCURACY_IMAGES = 8

Build = Callable[[LoadSpec, str, str], Backend]  # (spec, backend, precision) -> the loaded backend


def contenders(spec: LoadSpec) -> list[tuple[str, str]]:
    """The (backend, precision) pairs installed for `spec.path`'s suffix ("auto": `spec.precision`), narrowed to
    `spec.pin_runtime`'s."""
    pairs = [(b, p) for b, p in FILE_RUNTIMES.get(Path(spec.path).suffix.lower(), ())
             if importlib.util.find_spec(b) is not None]
    if spec.pin_runtime is not None:
        runtime, want = parse_pin(spec.pin_runtime)
        fits = [(b, want or p) for b, p in pairs if b == runtime and (want in (None, "auto") or p in ("auto", want))]
        pairs = fits[:1]
    return [(b, spec.precision if p == "auto" else p) for b, p in pairs]


def wanted(spec: LoadSpec) -> bool:
    """Whether a choice is made for `spec`: a pin among several runtimes, or `choose_runtime` with the backend left
    to "auto" and more than one contender; never when the model's `runtime` setting or an explicit backend
    (`--backend onnxruntime`) names its runtime: what a user names is what serves."""
    pairs = FILE_RUNTIMES.get(Path(spec.path).suffix.lower(), ())
    if spec.runtime is not None or spec.backend not in ("auto", *{b for b, _ in pairs}):
        return False
    if spec.pin_runtime is not None:
        return len(pairs) > 1
    return spec.backend == "auto" and spec.choose_runtime and len(contenders(spec)) > 1


def choose_backend(spec: LoadSpec, build: Build) -> Backend:
    """The backend of the fastest contender that passes (or the pinned one), its `info.runtime_choice` the table;
    ValueError when the pin names none of the file's runtimes, or the reference cannot load."""
    t0 = time.perf_counter()
    pairs = contenders(spec)
    if not pairs:
        raise ValueError(f"pin_runtime {spec.pin_runtime!r} names none of {Path(spec.path).name}'s runtimes ("
                         f"{', '.join(':'.join(p) for p in FILE_RUNTIMES[Path(spec.path).suffix.lower()])})")
    loaded: dict[str, LocalBackend] = {}  # by "runtime:precision", the precision it runs in ("auto" resolved)
    failed: list[Row] = []
    for name, precision in pairs:
        try:
            backend = build(spec, name, precision)
        except Exception as e:  # each runtime raises its own types; a contender less, unless it is the reference
            if not loaded:
                raise
            failed.append(Row(name, precision, refused=f"cannot load: {' '.join(str(e).split())[:200]}"))
            continue
        assert isinstance(backend, LocalBackend)
        loaded[f"{name}:{backend.info.precision}"] = backend
    ref = next(iter(loaded.values()))
    images = np.random.default_rng(0).standard_normal((ACCURACY_IMAGES, 3, *ref.info.resolution)).astype(np.float32)
    runs = {k: b.classify for k, b in loaded.items()}
    rates = {} if spec.pin_runtime is not None else time_runs(runs, images[:1], sorted({1, spec.limits.max_batch}),
                                                              spec.choice_budget_s)
    reference = ref.classify(images)
    rows: list[Row] = []
    for key, backend in loaded.items():
        name, precision = key.split(":", 1)
        agree, cos = accuracy(reference, backend.classify(images))
        rows.append(Row(name, precision, rates.get(key, {}), agree, cos, refusal(precision, agree, cos)))
    rows += failed
    chosen = choose(rows, None if spec.pin_runtime is None else parse_pin(spec.pin_runtime)[0])
    for key, backend in loaded.items():
        if key != chosen.key:
            backend.close()
    table = RuntimeChoice(tuple(rows), chosen.key, spec.pin_runtime is not None, spec.threads or 0,
                          time.perf_counter() - t0)
    log.info("%s: runtime %s", Path(spec.path).name, table.describe())
    served = loaded[chosen.key]
    served.info = dataclasses.replace(served.info, runtime_choice=table)
    return served


def openvino_precision(precision: str) -> str:
    """OpenVINO's name of a table's precision (fp32 -> f32, fp16 -> f16; the others as they are)."""
    return _OPENVINO_NAMES.get(precision, precision)
