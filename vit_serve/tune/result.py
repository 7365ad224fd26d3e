"""`vit-serve tune`'s terms: what a run is told (`TuneOptions`), what each trial measured (`Trial`) and what
the run found (`TuneResult`); `vit_serve.tune` runs the search, `vit_serve.tune.report` writes it out."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the command line's parser reads the defaults here: nothing heavy at import
    from vit_serve.tune.candidates import Candidate
    from vit_serve.tune.load import Measurement

DEFAULT_P99_MS = 200.0
DEFAULT_MIN_AGREEMENT = 0.99
DEFAULT_BUDGET_S = 300.0
DEFAULT_CONCURRENCY = 16
DEFAULT_TRIAL_S = 5.0
MIN_BUDGET_S = 20.0
STARTUP_GUESS_S = 10.0  # a trial's start and stop, until one has been measured
NO_WINNER_EXIT = 3


class TuneError(ValueError):
    """The tuning cannot run, or could not measure the defaults; the message is one line."""


@dataclass(frozen=True)
class TuneOptions:
    """model: a checkpoint, or an exported NAME.onnx (NAME.json beside it: then only the runner settings are
    tuned); out: the folder of the outputs and exports (must be new or empty unless `force`); images: uploads
    (None: the built-in photos); check_images: the agreement check set (None: views of the built-in photos);
    p99_ms: the latency target; min_agreement: the floor on top-1 agreement with the fp32 reference; budget_s:
    the whole run's bound; concurrency: clients; trial_s: measured seconds of one trial; device: the gateways'
    (auto, cpu, cuda); progress: a progress bar on stderr."""

    model: Path
    out: Path = Path("runs/tune")
    images: Path | None = None
    check_images: Path | None = None
    p99_ms: float = DEFAULT_P99_MS
    min_agreement: float = DEFAULT_MIN_AGREEMENT
    budget_s: float = DEFAULT_BUDGET_S
    concurrency: int = DEFAULT_CONCURRENCY
    trial_s: float = DEFAULT_TRIAL_S
    device: str = "auto"
    force: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("model", "out", "images", "check_images"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, Path(value))
        if not self.p99_ms > 0:
            raise TuneError(f"p99_ms must be > 0, got {self.p99_ms:g}")
        if not self.min_agreement >= 0:
            raise TuneError(f"min_agreement must be >= 0 (a fraction of the check images), got "
                            f"{self.min_agreement:g}")
        if not (isinstance(self.concurrency, int) and self.concurrency >= 1):
            raise TuneError(f"concurrency must be a whole number >= 1, got {self.concurrency}")
        if not self.trial_s > 0:
            raise TuneError(f"trial_s must be > 0, got {self.trial_s:g}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise TuneError(f"device must be auto, cpu or cuda, got {self.device!r}")
        least = max(MIN_BUDGET_S, 2 * self.trial_s + STARTUP_GUESS_S)
        if not self.budget_s >= least:
            raise TuneError(f"a budget of {self.budget_s:g} s is too short to measure even the defaults (a trial "
                            f"is the gateway's start, warm-up and {self.trial_s:g} s of load): give at least "
                            f"{least:g} s")

    @property
    def is_export(self) -> bool:
        return self.model.suffix.lower() == ".onnx"

    def to_dict(self) -> dict[str, Any]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(self).items()}


@dataclass
class Trial:
    """One measured setting. settings: the flat settings served (those a serve.toml holds; what is absent has
    its default); status: "ok" or "failed: ..."."""

    index: int
    step: str
    candidate: str
    settings: dict[str, Any]
    effective: dict[str, Any]
    measurement: Measurement | None = None
    status: str = "ok"
    duration_s: float = 0.0
    trials: tuple[int, ...] = ()  # pooled (`pool`): the trials of these settings; () for one trial

    @property
    def ok(self) -> bool:
        m = self.measurement
        return self.status == "ok" and m is not None and m.requests > 0 and not m.errors

    @property
    def p99_ms(self) -> float:
        return self.measurement.p(99) if self.measurement else float("nan")

    @property
    def throughput(self) -> float:
        return self.measurement.throughput if self.measurement else float("nan")

    def meets(self, p99_ms: float) -> bool:
        return self.ok and self.p99_ms <= p99_ms

    def to_dict(self, p99_ms: float) -> dict[str, Any]:
        return {"index": self.index, "step": self.step, "candidate": self.candidate, "settings": self.settings,
                "effective": self.effective, "status": self.status, "duration_s": self.duration_s,
                "meets_target": self.meets(p99_ms), **({"trials": list(self.trials)} if self.trials else {}),
                **(self.measurement.to_dict() if self.measurement else {})}

    def same_settings(self, other: Trial) -> bool:
        return self.effective == other.effective


def pool(trials: list[Trial]) -> list[Trial]:
    """One trial per setting, in the order first measured: settings measured more than once (the confirm step)
    as their first trial with every measurement pooled (latencies together, measured seconds added; failed if
    any was), so that settings are compared on all their measurements rather than on one lucky trial."""
    groups: list[list[Trial]] = []
    for t in trials:
        group = next((g for g in groups if g[0].same_settings(t)), None)
        if group is None:
            groups.append([t])
        else:
            group.append(t)
    out = []
    for g in groups:
        if len(g) == 1:
            out.append(g[0])
            continue
        from vit_serve.tune.load import Measurement

        ms = [t.measurement for t in g if t.measurement is not None]
        errors: dict[int, int] = {}
        for m in ms:
            for k, v in m.errors.items():
                errors[k] = errors.get(k, 0) + v
        pooled = Measurement([x for m in ms for x in m.latencies_ms], sum(m.wall_s for m in ms), errors,
                             [x for m in ms for x in m.batch_sizes])
        status = next((t.status for t in g if t.status != "ok"), "ok")
        out.append(dataclasses.replace(g[0], measurement=pooled, status=status,
                                       duration_s=sum(t.duration_s for t in g), trials=tuple(t.index for t in g)))
    return out


def pick_winner(pooled: list[Trial], p99_ms: float) -> Trial | None:
    """The most images/s among the (pooled) settings meeting the target; None when none does."""
    meeting = [t for t in pooled if t.meets(p99_ms)]
    return max(meeting, key=lambda t: t.throughput) if meeting else None


@dataclass
class TuneResult:
    """What a run found: its candidates (empty for an export), trials (the defaults' first, in the order run),
    winner (the pooled settings with the most images/s within the target, `pick_winner`; None: none met it),
    notes (what was skipped and why) and files written."""

    options: TuneOptions
    candidates: list[Candidate]
    trials: list[Trial]
    winner: Trial | None
    notes: list[str]
    files: dict[str, Path] = field(default_factory=dict)
    elapsed_s: float = 0.0
    cpus: int = 1

    @property
    def settings(self) -> list[Trial]:
        """One trial per setting, repeated measurements pooled (`pool`)."""
        return pool(self.trials)

    @property
    def defaults(self) -> Trial:
        """The defaults' trial, pooled over its repeats."""
        return self.settings[0]

    def best_p99(self) -> Trial | None:
        """The settings with the lowest p99 (the closest to the target when none met it)."""
        done = [t for t in self.settings if t.ok]
        return min(done, key=lambda t: t.p99_ms) if done else None


def effective(settings: dict[str, Any], cpus: int) -> dict[str, Any]:
    """The settings a trial ran with, its defaults filled in (threads None: the runtime's own)."""
    from vit_serve.runtime.spec import LoadSpec, resolve_backend
    from vit_serve.serve.settings import ServeSettings, default_decode_workers

    fields = ServeSettings.flat_fields()
    out = {k: settings.get(k, fields[k].default) for k in ("backend", "threads", "max_batch", "max_delay_ms",
                                                           "tome", "device")}
    out["backend"] = resolve_backend(LoadSpec(path=str(settings["model"]), backend=out["backend"]))
    workers = settings.get("decode_workers") or default_decode_workers(cpus, out["threads"], out["device"])
    return out | {"decode_workers": workers, "model": str(settings["model"])}


def short_settings(eff: dict[str, Any]) -> str:
    threads = eff["threads"] if eff["threads"] is not None else "auto"
    return (f"threads {threads}, decode {eff['decode_workers']}, batch {eff['max_batch']}, "
            f"delay {eff['max_delay_ms']:g} ms")


