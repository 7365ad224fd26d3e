"""`vit-serve tune`'s runtime candidates: what could serve the model (torch eager, ONNX fp32, ONNX int8, each with
token merging), each exported when it needs to be, and measured offline: its top-1 agreement with the fp32
reference (torch, no merging) on the check images, and its images/s on a batch of them.

An export is `vit-export CKPT --name NAME --precision P --tome R` in a process of its own, so that one that would
overrun the budget can be stopped (its files are then removed); its output is kept in a log.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vit_serve.tune.load import Tick, last_line

OFFLINE_BATCH = 8
CHECK_CHUNK = 16


@dataclass
class Candidate:
    """One way to run the model. backend: torch or onnxruntime; precision: fp32 or int8; tome: r merged per
    layer (0: none); model: the checkpoint or the export (None until exported). agreement: top-1 agreement with
    the reference on the check images (None: not measured); images_per_s: offline, batch OFFLINE_BATCH, every
    core; status: "ok", "rejected" (under the agreement floor), "skipped: ..." or "failed: ..."."""

    backend: str
    precision: str = "fp32"
    tome: int = 0
    model: Path | None = None
    agreement: float | None = None
    images_per_s: float | None = None
    status: str = "ok"
    export_s: float | None = None

    @property
    def name(self) -> str:
        kind = "torch" if self.backend == "torch" else f"onnx {self.precision}"
        return kind + (f" tome{self.tome}" if self.tome else "")

    @property
    def needs_export(self) -> bool:
        return self.backend == "onnxruntime" and self.model is None

    @property
    def usable(self) -> bool:
        return self.status == "ok" and self.model is not None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["model"] = None if self.model is None else str(self.model)
        return d | {"name": self.name}


def tome_values(patches: int, depth: int) -> list[int]:
    """The r worth trying: half and all of patches // depth (ToMe's r=16 on ViT-S/16 at 224 merges 192 of the
    196 patch tokens over its 12 layers), without 0 and repeats."""
    top = patches // max(depth, 1)
    return sorted({r for r in (top // 2, top) if r > 0})


def export_name(stem: str, precision: str, tome: int) -> str:
    return f"{stem}_{precision}" + (f"_tome{tome}" if tome else "")


def export_candidate(ckpt: Path, out: Path, stem: str, cand: Candidate, log: Path, deadline: float,
                     force: bool = False, tick: Tick = lambda: None) -> Candidate:
    """`cand` exported with vit-export into `out` (NAME.onnx, NAME.json, the explain graph): the candidate with
    its model, or with status "failed: ..." (the export's last line) or "skipped: ..." (stopped at `deadline`,
    time.monotonic(); its files removed)."""
    name = export_name(stem, cand.precision, cand.tome)
    argv = [sys.executable, "-m", "vit_export.cli", str(ckpt), "--out", str(out), "--name", name,
            "--precision", cand.precision, *(["--tome", str(cand.tome)] if cand.tome else []),
            *(["--force"] if force else [])]
    t0 = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        while proc.poll() is None:
            tick()
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                for p in out.glob(f"{name}*"):
                    if p.is_file() and p.name.startswith((f"{name}.", f"{name}_explain.")):
                        p.unlink()
                return dataclasses.replace(cand, status="skipped: the budget ran out during its export",
                                           export_s=time.monotonic() - t0)
            time.sleep(0.2)
    took = time.monotonic() - t0
    onnx = out / f"{name}.onnx"
    if proc.returncode != 0 or not onnx.is_file():
        return dataclasses.replace(cand, status=f"failed: {last_line(log) or f'vit-export exited {proc.returncode}'}",
                                   export_s=took)
    return dataclasses.replace(cand, model=onnx, export_s=took)


def _load(cand: Candidate, device: str, threads: int) -> Any:
    from vit_serve.runtime import LoadSpec, load

    assert cand.model is not None
    spec = LoadSpec(path=str(cand.model), backend=cand.backend, device=device, threads=threads,  # type: ignore[arg-type]
                    tome=cand.tome if cand.backend == "torch" and cand.tome else None)
    return load(spec)  # the spec's runtime, no load-time choice (LoadSpec.choose_runtime is off)


def top1(backend: Any, x: np.ndarray) -> np.ndarray:
    """Each image's top-1 class, in chunks."""
    return np.concatenate([backend.classify(x[i:i + CHECK_CHUNK]).argmax(-1) for i in range(0, len(x), CHECK_CHUNK)])


def offline_throughput(backend: Any, x: np.ndarray, seconds: float, tick: Tick = lambda: None) -> float:
    """Images/s of `backend.classify` on a batch of OFFLINE_BATCH images (from x), after one warm-up call: the
    batch over the median call's time, which a moment of contention for the cores (other processes) moves less
    than the mean's."""
    batch = np.ascontiguousarray(np.resize(x, (OFFLINE_BATCH, *x.shape[1:])))
    backend.classify(batch)
    times: list[float] = []
    t0 = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - t0 < seconds:
        t = time.perf_counter()
        backend.classify(batch)
        times.append(time.perf_counter() - t)
        tick()
    return OFFLINE_BATCH / float(np.median(times))


def evaluate(cand: Candidate, x: np.ndarray, reference: np.ndarray | None, min_agreement: float, device: str,
             threads: int, seconds: float, tick: Tick = lambda: None) -> Candidate:
    """`cand` with its agreement with `reference` (top-1 per image; None: not measured) and offline images/s;
    status "rejected" under `min_agreement`, "failed: ..." when it does not load or run."""
    try:
        backend = _load(cand, device, threads)
        try:
            agreement = None if reference is None else float(np.mean(top1(backend, x) == reference))
            tick()
            ips = offline_throughput(backend, x, seconds, tick)
        finally:
            backend.close()
    except (ValueError, RuntimeError, OSError) as e:
        return dataclasses.replace(cand, status=f"failed: {' '.join(str(e).split())[:200]}")
    status = "rejected" if agreement is not None and agreement < min_agreement else "ok"
    return dataclasses.replace(cand, agreement=agreement, images_per_s=ips, status=status)


def reference(ckpt: Path, images: list, device: str, threads: int) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """The fp32 reference on the check images: (the images preprocessed with the checkpoint's contract, their
    top-1 classes, {"patches", "depth"} for the ToMe values; depth 0 when the model cannot merge tokens)."""
    import torch

    from vit_serve.preprocess import preprocess

    ref = _load(Candidate("torch", model=ckpt), device, threads)
    try:
        x = torch.stack([preprocess(im, ref.info.preprocess) for im in images]).numpy()
        model = getattr(ref, "model", None)
        blocks = getattr(model, "blocks", None)
        mergeable = (blocks is not None and hasattr(model, "set_token_merging")
                     and getattr(model.cfg, "resnet_layers", None) is None)
        gh, gw = ref.info.grid
        shape = {"patches": gh * gw, "depth": len(blocks) if mergeable else 0}
        return x, top1(ref, x), shape
    finally:
        ref.close()
