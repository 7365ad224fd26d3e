"""`vit-serve tune`'s outputs: the tables (markdown), throughput against p99 (PNG), tune.json, and serve.toml, the
winner's settings as `vit-serve serve --config FILE` reads them. Every file is written atomically."""

from __future__ import annotations

import io
import json
import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vit_serve.tune.result import Trial, TuneResult

# The order the winner's settings are written in.
CONFIG_KEYS = ("model", "backend", "device", "tome", "threads", "decode_workers", "max_batch", "max_delay_ms")
STEP_COLORS = {"defaults": "tab:gray", "runtime": "tab:blue", "threads": "tab:orange", "batching": "tab:green",
               "confirm": "tab:purple"}


def atomic_write(path: Path, data: bytes | str) -> Path:
    """`data` into `path` through a temporary file beside it (os.replace): never a half-written file."""
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    return json.dumps(str(v))  # a TOML basic string: JSON's escapes are TOML's


def toml_text(settings: dict[str, Any], comments: Sequence[str] = ()) -> str:
    """Flat settings as TOML (`key = value`; None left out), after `comments` lines."""
    keys = [k for k in CONFIG_KEYS if k in settings] + [k for k in settings if k not in CONFIG_KEYS]
    lines = [f"# {c}" for c in comments] + [f"{k} = {_toml_value(settings[k])}" for k in keys
                                            if settings[k] is not None]
    return "\n".join(lines) + "\n"


def write_toml(path: Path, settings: dict[str, Any], comments: Sequence[str] = ()) -> Path:
    """`toml_text` written atomically to `path`."""
    return atomic_write(path, toml_text(settings, comments))


def _num(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def _mark(t: Trial, result: TuneResult) -> str:
    if not t.ok:
        return t.status
    if result.winner is not None and t.same_settings(result.winner):
        return "**winner**"
    return "meets" if t.meets(result.options.p99_ms) else "misses"


def candidates_table(result: TuneResult) -> str:
    """The runtime candidates: agreement, offline images/s, export time, status."""
    rows = ["| runtime | top-1 agreement | offline images/s | export s | status |", "|---|---:|---:|---:|---|"]
    for c in result.candidates:
        agreement = "-" if c.agreement is None else f"{100 * c.agreement:.1f}%"
        rows.append(f"| {c.name} | {agreement} | {_num(c.images_per_s)} | {_num(c.export_s, '.0f')} | {c.status} |")
    return "\n".join(rows)


def trials_table(result: TuneResult) -> str:
    """Every trial: its settings, images/s, p50 / p99 and mean batch, against the target."""
    rows = ["| # | step | runtime | threads | decode | max batch | delay ms | images/s | p50 ms | p99 ms | batch "
            "| requests | target |", "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for t in result.trials:
        e, m = t.effective, t.measurement
        threads = "auto" if e["threads"] is None else e["threads"]
        nums = ((_num(m.throughput), _num(m.p(50), ".0f"), _num(m.p(99), ".0f"), _num(m.mean_batch),
                 str(m.requests)) if m else ("-",) * 5)
        rows.append(f"| {t.index} | {t.step} | {t.candidate} | {threads} | {e['decode_workers']} | {e['max_batch']} "
                    f"| {e['max_delay_ms']:g} | {' | '.join(nums)} | {_mark(t, result)} |")
    return "\n".join(rows)


def summary(result: TuneResult) -> list[str]:
    """The outcome in a few lines: the winner beside the defaults, or the closest trial when none met the
    target, and what was skipped."""
    o, d, w = result.options, result.defaults, result.winner
    at = f"p99 <= {o.p99_ms:g} ms, {o.concurrency} clients"
    dm = (f"{d.throughput:.1f} images/s at p99 {d.p99_ms:.0f} ms{_over(d)}"
          + ("" if d.meets(o.p99_ms) else " (misses the target: 0 images/s within it)"))
    lines = []
    if w is not None:
        gain = f", {w.throughput / d.throughput:.2f}x the defaults" if d.meets(o.p99_ms) and d.throughput else ""
        lines.append(f"winner: trial {w.index} ({w.candidate}; {_settings_text(w)}): {w.throughput:.1f} images/s "
                     f"at p99 {w.p99_ms:.0f} ms{_over(w)} ({at}){gain}")
    else:
        best = result.best_p99()
        closest = (f"; the lowest p99 was {best.p99_ms:.0f} ms (trial {best.index}, {best.throughput:.1f} images/s)"
                   if best else "")
        lines.append(f"no setting met {at}{closest}: no serve.toml written; try fewer clients (--concurrency) or "
                     f"a higher --p99-ms")
    lines.append(f"defaults: {dm}")
    lines += [f"note: {n}" for n in result.notes]
    lines.append(f"{len(result.trials)} trials in {result.elapsed_s:.0f} s of a {o.budget_s:g} s budget "
                 f"({result.cpus} cores)")
    return lines


def _over(t: Trial) -> str:
    """", trials 6+15 pooled" for settings measured more than once."""
    return f", trials {'+'.join(str(i) for i in t.trials)} pooled" if t.trials else ""


def _settings_text(t: Trial) -> str:
    e = t.effective
    threads = "auto" if e["threads"] is None else e["threads"]
    return (f"threads {threads}, decode_workers {e['decode_workers']}, max_batch {e['max_batch']}, "
            f"max_delay_ms {e['max_delay_ms']:g}")


def report_text(result: TuneResult) -> str:
    """tune.md: the candidates (for a checkpoint), the trials and the summary."""
    parts = []
    if result.candidates:
        parts += ["## Runtime candidates", "", candidates_table(result), ""]
    parts += ["## Trials", "", trials_table(result), "", *summary(result)]
    return "\n".join(parts) + "\n"


def plot_png(result: TuneResult) -> bytes:
    """Throughput against p99 for every measured trial (numbered, coloured by step), the target as a line, the
    winner starred and the defaults squared (each at its trials pooled)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    done = [t for t in result.trials if t.measurement and t.measurement.requests]
    for step, color in STEP_COLORS.items():
        pts = [t for t in done if t.step == step]
        if pts:
            ax.scatter([t.p99_ms for t in pts], [t.throughput for t in pts], color=color, label=step, zorder=3)
    for t in done:
        ax.annotate(str(t.index), (t.p99_ms, t.throughput), textcoords="offset points", xytext=(4, 4), fontsize=8)
    d = result.defaults  # pooled, as the winner
    if d.measurement and d.measurement.requests:
        ax.scatter([d.p99_ms], [d.throughput], marker="s", s=110, facecolors="none", edgecolors="black",
                   label="defaults, pooled", zorder=4)
    if result.winner is not None:
        ax.scatter([result.winner.p99_ms], [result.winner.throughput], marker="*", s=260, color="gold",
                   edgecolors="black", label="winner, pooled", zorder=5)
    ax.axvline(result.options.p99_ms, color="tab:red", linestyle="--", label=f"target {result.options.p99_ms:g} ms")
    ax.set_xlim(0, 1.08 * max([result.options.p99_ms, *(t.p99_ms for t in done)]))
    ax.set_ylim(0, 1.1 * max([1.0, *(t.throughput for t in done)]))
    ax.set_xlabel("p99 latency (ms)")
    ax.set_ylabel("throughput (images/s)")
    ax.set_title(f"vit-serve tune: {result.options.model.name}, {result.options.concurrency} clients")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def config_settings(winner: Trial, out: Path) -> dict[str, Any]:
    """The winner's settings for serve.toml: its model relative to `out` when it lies inside it (the file then
    moves with its exports: `serve --config` takes relative paths from the file's folder)."""
    settings = dict(winner.settings)
    model = Path(settings["model"])
    try:
        settings["model"] = model.resolve().relative_to(out.resolve()).as_posix()
    except ValueError:
        settings["model"] = str(model.resolve())
    settings.setdefault("backend", winner.effective["backend"])
    for k in ("max_batch", "max_delay_ms"):
        settings.setdefault(k, winner.effective[k])
    return settings


def write_outputs(result: TuneResult) -> dict[str, Path]:
    """tune.json, tune.md, tune.png, and (with a winner) serve.toml, checked by reading it back as `vit-serve
    serve --config` does (config_file.settings_from_file, then the runtime's checks)."""
    out = result.options.out
    files = {"json": out / "tune.json", "table": out / "tune.md", "plot": out / "tune.png"}
    if result.winner is not None:
        w, d, target = result.winner, result.defaults, result.options.p99_ms
        comments = [f"vit-serve tune {result.options.model.name}: trial {w.index}, {w.throughput:.1f} images/s at "
                    f"p99 {w.p99_ms:.0f} ms{_over(w)} (target {target:g} ms, {result.options.concurrency} clients, "
                    f"{result.cpus} cores)",
                    f"defaults: {d.throughput:.1f} images/s at p99 {d.p99_ms:.0f} ms{_over(d)}",
                    "serve with: vit-serve serve --config serve.toml (flags and VIT_SERVE_* win over this file)"]
        files["config"] = write_toml(out / "serve.toml", config_settings(w, out), comments)
        _check_config(files["config"])
    else:  # --force over an earlier run: its serve.toml would pass for this run's
        (out / "serve.toml").unlink(missing_ok=True)
    try:
        atomic_write(files["plot"], plot_png(result))
    except ImportError:  # matplotlib is optional here: the tables and numbers are written regardless
        result.notes.append("tune.png not drawn: matplotlib is not installed")
        del files["plot"]
    atomic_write(files["table"], report_text(result))
    doc = {"options": result.options.to_dict(), "cpus": result.cpus, "elapsed_s": result.elapsed_s,
           "p99_target_ms": result.options.p99_ms, "winner": None if result.winner is None else result.winner.index,
           "defaults": result.defaults.index, "notes": result.notes,
           "candidates": [c.to_dict() for c in result.candidates],
           "trials": [t.to_dict(result.options.p99_ms) for t in result.trials],
           "settings": [t.to_dict(result.options.p99_ms) for t in result.settings],
           "files": {k: str(v) for k, v in files.items()}}
    atomic_write(files["json"], json.dumps(_finite(doc), indent=1) + "\n")
    return files


def _finite(v: Any) -> Any:
    """NaN and infinities as null (JSON has neither)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_finite(x) for x in v]
    return v


def _check_config(path: Path) -> None:
    """serve.toml read back as `serve --config` reads it (its values given explicitly, so that this process's
    VIT_SERVE_* variables cannot mask one), and the runtime's checks of the model it names."""
    from vit_serve.runtime import LoadSpec, check
    from vit_serve.serve.config_file import read_settings_file
    from vit_serve.serve.settings import ServeSettings

    check(LoadSpec.of(ServeSettings.of(read_settings_file(path))))
