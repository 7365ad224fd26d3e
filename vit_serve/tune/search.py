"""The search of `vit-serve tune MODEL`: the gateway settings with the most images/s whose measured p99 meets a
latency target, found within a time budget, written as a file `vit-serve serve --config FILE` reads.

Every trial is the real gateway (`vit-serve serve --config TRIAL.toml`, a process of its own) under
`concurrency` clients sending unique JPEG uploads to POST /classify over HTTP for `trial_s` seconds
(`vit_serve.tune.load`). The search, in order, until the budget is spent:

    1. defaults   `vit-serve serve MODEL` as it is: the baseline, always measured first
    2. offline    (a checkpoint) the runtime candidates (`vit_serve.tune.candidates`): torch eager, ONNX fp32 and
                  ONNX int8 (exported by vit-export), each with token merging (ToMe) r; each one's top-1
                  agreement with the fp32 reference on the check images, those under `min_agreement` rejected;
                  its images/s offline. At most CANDIDATE_SHARE of the budget.
    3. runtime    the RUNTIME_TRIALS fastest accepted candidates on the gateway
    4. threads    the best runtime's intra-op threads x decode workers
    5. batching   then max_batch, then max_delay_ms
    6. confirm    with the budget left, the best settings, the defaults and the runner-up measured again

The best trial of each step carries on to the next: the one with the most images/s among those meeting the
target, or, while none does, the one with the lowest p99. The winner is the setting with the most images/s whose
p99 is at most `p99_ms`, each setting's measurements pooled (`vit_serve.tune.result.pool`); the defaults are
among them, so that the winner's throughput is never under the defaults' at the target, as measured. With a winner,
`out/serve.toml` holds its settings; with none, no serve.toml is written and `TuneResult.winner` is None (the
command exits 3). Always: `tune.json` (every candidate and trial), `tune.md`
(the tables) and `tune.png` (throughput against p99) (`vit_serve.tune.report`).

A trial is launched only when the time left holds one (the longest of the last trials); exports are stopped when
the offline step's share runs out. The gateways run what their files say: VIT_SERVE_* variables are ignored.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

from vit_serve.tune.candidates import Candidate, evaluate, export_candidate, reference, tome_values
from vit_serve.tune.load import TrialError, TrialServers, Uploads, check_images, measure, upload_bases
from vit_serve.tune.result import (
    DEFAULT_BUDGET_S,
    DEFAULT_CONCURRENCY,
    DEFAULT_MIN_AGREEMENT,
    DEFAULT_P99_MS,
    DEFAULT_TRIAL_S,
    NO_WINNER_EXIT,
    STARTUP_GUESS_S,
    Trial,
    TuneError,
    TuneOptions,
    TuneResult,
    effective,
    pick_winner,
    pool,
    short_settings,
)

__all__ = ["DEFAULT_BUDGET_S", "DEFAULT_CONCURRENCY", "DEFAULT_MIN_AGREEMENT", "DEFAULT_P99_MS", "DEFAULT_TRIAL_S",
           "NO_WINNER_EXIT", "Trial", "TuneError", "TuneOptions", "TuneResult", "tune"]

CANDIDATE_SHARE = 0.5  # of the budget, at most, for exports and offline measurements
OUTPUT_RESERVE_S = 3.0  # kept for writing the outputs
OFFLINE_S = 1.5
RUNTIME_TRIALS = 2
CONFIRM_TOP = 2  # settings (besides the defaults) measured again with the budget left
CONFIRM_ROUNDS = 2
BATCH_SIZES = (8, 4, 32, 1)
DELAYS_MS = (2.0, 10.0, 1.0, 20.0)
TOME_EXPORT_COST = 1.7  # a ToMe graph takes this much longer to export than a plain one (measured on ViT-Ti/16)


class _Progress:
    """The run's time as a progress bar on stderr (tqdm; lines without it)."""

    def __init__(self, total_s: float, enabled: bool) -> None:
        self.t0, self.total, self.enabled, self.last = time.monotonic(), total_s, enabled, 0.0
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=round(total_s), file=sys.stderr, desc="tune", leave=True, dynamic_ncols=True,
                                bar_format="{desc} |{bar}| {n:.0f}/{total:.0f} s")
            except ImportError:
                pass

    def step(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(text[:60], refresh=False)
            self.tick(force=True)
        elif self.enabled:
            print(f"[{time.monotonic() - self.t0:5.0f} s] {text}", file=sys.stderr, flush=True)

    def tick(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.bar is not None and (force or now - self.last >= 1.0):
            self.last = now
            self.bar.n = min(round(now - self.t0), self.bar.total)
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.tick(force=True)
            self.bar.close()


def _require() -> None:
    """The gateway and an HTTP client (OSError naming what is missing, in one line)."""
    missing = [m for m in ("fastapi", "uvicorn", "httpx") if importlib.util.find_spec(m) is None]
    if missing:
        raise OSError(f"vit-serve tune needs {', '.join(missing)} (pip install 'vit-serve[serve]' httpx)")


def _check_model(model: Path) -> None:
    from vit_serve.manifest import manifest_path

    if not model.exists():
        raise FileNotFoundError(f"no such file: {model}")
    if model.suffix.lower() == ".onnx" and not manifest_path(model).is_file():
        raise TuneError(f"{manifest_path(model).name} (the manifest vit-export writes) is missing beside {model}")


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} exists and is not empty; pass --force to write into it")


class _Tuner:
    def __init__(self, opts: TuneOptions) -> None:
        from vit_serve.serve.settings import available_cpus

        self.opts = opts
        self.t0 = time.monotonic()
        self.deadline = self.t0 + opts.budget_s - OUTPUT_RESERVE_S
        self.cpus = available_cpus()
        self.progress = _Progress(opts.budget_s, False)  # the bar starts once the inputs are checked
        self.trials: list[Trial] = []
        self.candidates: list[Candidate] = []
        self.notes: list[str] = []
        self.unmeasured: list[str] = []  # trials the budget could not hold
        self.logs = opts.out.resolve() / "logs"
        self.exports = opts.out.resolve() / "exports"
        self.servers = TrialServers()
        self.uploads: Uploads | None = None

    # -- trials ------------------------------------------------------------------------------------------------

    def estimate(self) -> float:
        """What the next trial will take: the longest of the last three (a guess before any)."""
        done = [t.duration_s for t in self.trials[-3:]]
        return max(done) if done else self.opts.trial_s + STARTUP_GUESS_S

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def trial(self, step: str, name: str, settings: dict[str, Any], again: bool = False) -> Trial | None:
        """The trial of `settings` on the candidate called `name`: measured now, or (unless `again`) the earlier
        trial of the same effective settings; None when the budget cannot hold it."""
        from vit_serve.tune.report import write_toml

        if self.opts.device != "auto":
            settings = {**settings, "device": self.opts.device}
        eff = effective(settings, self.cpus)
        for t in self.trials:
            if t.effective == eff and not again:
                return t
        if self.trials and self.left() < self.estimate():
            if not again:
                self.unmeasured.append(f"{step} {name} {short_settings(eff)}")
            return None
        n = len(self.trials) + 1
        trial = Trial(n, step, name, settings, eff)
        self.progress.step(f"trial {n} ({step}): {name} {short_settings(eff)}")
        config, log = self.logs / f"trial_{n:02d}.toml", self.logs / f"trial_{n:02d}.log"
        write_toml(config, settings, [f"vit-serve tune: trial {n} ({step}), {name}"])
        t0 = time.monotonic()
        try:
            # ready in time for the measurement to end by the deadline
            ready_by = self.deadline - self.opts.trial_s - 1.0
            with self.servers.serve(config, log, ready_by, self.progress.tick) as url:
                assert self.uploads is not None
                trial.measurement = measure(url, self.uploads, self.opts.concurrency, self.opts.trial_s,
                                            tick=self.progress.tick)
            if trial.measurement.errors:
                codes = ", ".join(f"{v} x {k or 'no answer'}" for k, v in trial.measurement.errors.items())
                trial.status = f"failed: {codes}"
        except TrialError as e:
            trial.status = f"failed: {e}"
        trial.duration_s = time.monotonic() - t0
        self.trials.append(trial)
        return trial

    def best(self, trials: list[Trial | None]) -> Trial | None:
        """The most images/s among those meeting the target, else the lowest p99."""
        done = [t for t in trials if t is not None and t.ok]
        if not done:
            return None
        meeting = [t for t in done if t.meets(self.opts.p99_ms)]
        if meeting:
            return max(meeting, key=lambda t: t.throughput)
        return min(done, key=lambda t: t.p99_ms)

    # -- the steps ---------------------------------------------------------------------------------------------

    def offline(self, model: Path) -> None:
        """Step 2: the candidates, exported and measured offline, within CANDIDATE_SHARE of the budget."""
        opts, tick = self.opts, self.progress.tick
        until = min(self.t0 + CANDIDATE_SHARE * opts.budget_s, self.deadline)
        self.progress.step("reference: fp32, no token merging")
        x, ref_top1, shape = reference(model, check_images(opts.check_images), opts.device, self.cpus)

        def measure_offline(cand: Candidate) -> Candidate:
            self.progress.step(f"offline: {cand.name}")
            cand = evaluate(cand, x, ref_top1, opts.min_agreement, opts.device, self.cpus, OFFLINE_S, tick)
            self.candidates.append(cand)
            return cand

        eager = measure_offline(Candidate("torch", model=model))
        merged = [measure_offline(Candidate("torch", tome=r, model=model))
                  for r in (tome_values(shape["patches"], shape["depth"]) if shape["depth"] else [])
                  if time.monotonic() < until]
        # ToMe exports only for the largest r that kept agreement and was faster in torch
        faster = [c for c in merged if c.usable and (c.images_per_s or 0) > (eager.images_per_s or 0)]
        r = max((c.tome for c in faster), default=0)
        # int8 first on a CPU (where onnxruntime's dynamic int8 is fastest), fp32 first on a GPU
        precisions = ("fp32", "int8") if opts.device == "cuda" else ("int8", "fp32")
        plan = [Candidate("onnxruntime", p) for p in precisions]
        if r:
            plan += [Candidate("onnxruntime", p, r) for p in precisions]
        self.exports.mkdir(parents=True, exist_ok=True)
        took: float | None = None
        exporter = all(importlib.util.find_spec(m) is not None for m in ("vit_export", "onnx", "onnxruntime"))
        for cand in plan:
            need = None if took is None else took * (TOME_EXPORT_COST if cand.tome else 1.0)
            if not exporter:
                self.candidates.append(dataclasses.replace(cand, status="skipped: exports need vit-serve[export]"))
                continue
            if time.monotonic() >= until or (need is not None and time.monotonic() + need > until):
                self.candidates.append(dataclasses.replace(cand, status="skipped: no budget left to export it"))
                continue
            self.progress.step(f"export: {cand.name}")
            log = self.logs / f"export_{cand.name.replace(' ', '_')}.log"
            cand = export_candidate(model, self.exports, model.stem, cand, log, until, opts.force, tick)
            if cand.export_s is not None and cand.status == "ok":
                took = cand.export_s / (TOME_EXPORT_COST if cand.tome else 1.0)
            if cand.usable:
                cand = measure_offline(cand)
            else:
                self.candidates.append(cand)

    def runtime(self, defaults: Trial, base: Candidate) -> tuple[Trial, Candidate]:
        """Step 3: the fastest accepted candidates offline, on the gateway with the default runner settings."""
        ranked = sorted((c for c in self.candidates if c.usable and not (c.backend == "torch" and not c.tome)),
                        key=lambda c: -(c.images_per_s or 0))
        tried: list[tuple[Trial | None, Candidate]] = [(defaults, base)]
        for cand in ranked[:RUNTIME_TRIALS]:
            tried.append((self.trial("runtime", cand.name, _runtime_settings(cand)), cand))
        best = self.best([t for t, _ in tried]) or defaults
        return best, next(c for t, c in tried if t is best)

    def threads(self, incumbent: Trial, cand: Candidate) -> Trial:
        """Step 4: intra-op threads x decode workers."""
        threads = sorted({1, max(1, self.cpus // 2), self.cpus})
        workers = sorted({1, 2, min(4, max(2, self.cpus))})
        grid = sorted(((t, w) for t in threads for w in workers), key=lambda tw: (abs(sum(tw) - self.cpus), -tw[0]))
        tried: list[Trial | None] = [incumbent]
        for t, w in grid:
            tried.append(self.trial("threads", cand.name, incumbent.settings | {"threads": t, "decode_workers": w}))
        return self.best(tried) or incumbent

    def batching(self, incumbent: Trial, cand: Candidate) -> Trial:
        """Step 5: max_batch, then max_delay_ms (when batching)."""
        tried: list[Trial | None] = [incumbent]
        for b in BATCH_SIZES:
            tried.append(self.trial("batching", cand.name, incumbent.settings | {"max_batch": b}))
        best = self.best(tried) or incumbent
        if best.effective["max_batch"] > 1:
            tried = [best]
            for d in DELAYS_MS:
                tried.append(self.trial("batching", cand.name, best.settings | {"max_delay_ms": d}))
            best = self.best(tried) or best
        return best

    def confirm(self) -> None:
        """Step 6: while the budget lasts (at most CONFIRM_ROUNDS rounds), the best settings so far, the defaults
        and the runner-up measured again, in turn; the winner is then chosen on every measurement of its settings
        (`pool`)."""
        for _ in range(CONFIRM_ROUNDS):
            pooled = pool(self.trials)
            done = [t for t in pooled if t.ok]
            ranked = sorted((t for t in done if t.meets(self.opts.p99_ms)), key=lambda t: -t.throughput)
            ranked = ranked or sorted(done, key=lambda t: t.p99_ms)
            order: list[Trial] = []
            for t in [*ranked[:1], pooled[0], *ranked[1:CONFIRM_TOP]]:
                if t.ok and not any(t.same_settings(o) for o in order):
                    order.append(t)
            for t in order:
                if self.trial("confirm", t.candidate, t.settings, again=True) is None:
                    return

    def run(self) -> TuneResult:
        from vit_serve.tune.report import write_outputs

        opts = self.opts
        _require()
        _check_model(opts.model)
        _check_out(opts.out, opts.force)
        self.uploads = Uploads(upload_bases(opts.images))
        self.logs.mkdir(parents=True, exist_ok=True)
        self.progress = _Progress(opts.budget_s - (time.monotonic() - self.t0), opts.progress)
        model = opts.model.resolve()
        base = (Candidate("onnxruntime", _export_precision(model), model=model) if opts.is_export
                else Candidate("torch", model=model, agreement=1.0))
        try:
            self.progress.step("starting the gateway's fork server")
            self.servers.warm()
            defaults = self.trial("defaults", base.name, {"model": str(model)})
            assert defaults is not None
            if not defaults.ok:
                raise TuneError(f"the defaults could not be measured ({defaults.status.removeprefix('failed: ')}); "
                                f"the gateway's log: {self.logs / 'trial_01.log'}")
            if opts.is_export:
                self.notes.append("MODEL is an export: its precision and token merging are its own (tune its "
                                  "checkpoint to sweep them); only the runner settings were tuned")
            else:
                self.offline(model)
            best, cand = self.runtime(defaults, base)
            best = self.threads(best, cand)
            self.batching(best, cand)
            self.confirm()
        finally:
            self.progress.close()
        if self.unmeasured:
            more = f" and {len(self.unmeasured) - 1} more" if len(self.unmeasured) > 1 else ""
            self.notes.append(f"the budget ran out before {self.unmeasured[0]}{more} (a larger --budget-s tries "
                              "them)")
        winner = pick_winner(pool(self.trials), opts.p99_ms)
        result = TuneResult(opts, self.candidates, self.trials, winner, self.notes, cpus=self.cpus)
        result.elapsed_s = time.monotonic() - self.t0
        result.files = write_outputs(result)
        return result


def _export_precision(onnx: Path) -> str:
    """The precision an export's manifest records (fp32 when it says none)."""
    from vit_serve.manifest import manifest_path

    try:
        return str(json.loads(manifest_path(onnx).read_text()).get("precision") or "fp32")
    except (OSError, ValueError, AttributeError):
        return "fp32"


def _runtime_settings(cand: Candidate) -> dict[str, Any]:
    settings: dict[str, Any] = {"model": str(cand.model), "backend": cand.backend}
    if cand.backend == "torch" and cand.tome:
        settings["tome"] = str(cand.tome)
    return settings


def tune(options: TuneOptions) -> TuneResult:
    """Run the search (module docstring) and write its outputs; see `TuneResult`. Raises FileNotFoundError (no
    MODEL), FileExistsError (a non-empty `out` without `force`), ValueError (an image folder without images, an
    unreadable checkpoint) and TuneError (the defaults could not be measured)."""
    return _Tuner(options).run()
