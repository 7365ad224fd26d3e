"""`vit-serve inspect --drift`: one picture of a model version's drift report (GET /models/NAME/drift).

    report = fetch_drift("http://127.0.0.1:8000", "digits", api_key=None)   # or read_drift("drift.json")
    draw_drift(report, Path("drift.png"))

Left: the window's OOD-score histogram against the reference's calibration scores, both as shares of their own
count, with the OOD threshold as a vertical line; the title gives the statistic, the p-value and the alarm.
Right: the classes whose share of top-1 answers moved most, reference share beside window share. Drawn on an Agg
canvas through `matplotlib.figure.Figure` (never pyplot), written to a temporary file beside the target and
renamed over it, so a reader never sees half a PNG.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
except ImportError as e:  # pragma: no cover - matplotlib is in the [test] extra
    raise ImportError(f"vit_serve.cli.drift_figure needs matplotlib (pip install matplotlib): {e}") from e

__all__ = ["DriftInputError", "check_report", "draw_drift", "fetch_drift", "load_drift", "read_drift"]

DPI = 120
TIMEOUT_S = 10.0
REQUIRED = ("model", "statistic", "p_value", "alarm", "histogram", "classes")
WINDOW_COLOUR, REFERENCE_COLOUR, THRESHOLD_COLOUR = "tab:red", "tab:blue", "black"


class DriftInputError(ValueError):
    """A drift report that cannot be drawn: unreachable gateway, an HTTP error, or JSON not of the endpoint."""


def _number(d: dict[str, Any], key: str, where: str) -> float:
    v = d.get(key)
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise DriftInputError(f"{where}: {key} must be a number, got {v!r}")
    return float(v)


def check_report(report: Any, where: str = "drift report") -> dict[str, Any]:
    """`report` if it has what `draw_drift` reads (DriftInputError naming the first thing wrong)."""
    if not isinstance(report, dict):
        raise DriftInputError(f"{where}: expected a JSON object, got {type(report).__name__}")
    missing = [k for k in REQUIRED if k not in report]
    if missing:
        raise DriftInputError(f"{where}: missing {', '.join(missing)} (is this GET /models/NAME/drift's answer?)")
    _number(report, "statistic", where)
    _number(report, "p_value", where)
    h = report["histogram"]
    if not isinstance(h, dict) or not all(isinstance(h.get(k), list) for k in ("edges", "window", "reference")):
        raise DriftInputError(f"{where}: histogram must be {{'edges': [...], 'window': [...], 'reference': [...]}}")
    if not len(h["window"]) == len(h["reference"]) == max(len(h["edges"]) - 1, 0):
        raise DriftInputError(f"{where}: histogram has {len(h['edges'])} edges for {len(h['window'])} window and "
                              f"{len(h['reference'])} reference bins")
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool)
               for k in ("edges", "window", "reference") for x in h[k]):
        raise DriftInputError(f"{where}: histogram values must be numbers")
    if not isinstance(report["classes"], list):
        raise DriftInputError(f"{where}: classes must be a list")
    for c in report["classes"]:
        if not isinstance(c, dict):
            raise DriftInputError(f"{where}: each class must be an object with reference_share and window_share")
        _number(c, "reference_share", where)
        _number(c, "window_share", where)
    return report


def read_drift(path: str | os.PathLike) -> dict[str, Any]:
    """A saved answer of GET /models/NAME/drift (FileNotFoundError, or DriftInputError for bad JSON)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such file")
    try:
        report = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DriftInputError(f"{p}: not JSON: {e}") from e
    return check_report(report, str(p))


def fetch_drift(url: str, model: str, version: str | None = None, api_key: str | None = None,
                timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """GET `url`/models/`model`/drift[?version=] from a running gateway (DriftInputError: unreachable, HTTP
    error with the gateway's detail, or an answer that is not a drift report)."""
    endpoint = f"{url.rstrip('/')}/models/{urllib.parse.quote(model, safe='')}/drift"
    if version is not None:
        endpoint += "?" + urllib.parse.urlencode({"version": version})
    headers = {"Accept": "application/json", **({"X-API-Key": api_key} if api_key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(endpoint, headers=headers), timeout=timeout) as r:
            body = r.read()
    except urllib.error.HTTPError as e:
        raise DriftInputError(f"GET {endpoint}: HTTP {e.code}: {_detail(e)}") from e
    except (urllib.error.URLError, OSError) as e:
        raise DriftInputError(f"GET {endpoint}: {getattr(e, 'reason', e)}") from e
    try:
        report = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DriftInputError(f"GET {endpoint}: the answer is not JSON") from e
    return check_report(report, f"GET {endpoint}")


def _detail(e: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(e.read() or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return str(e.reason)
    detail = body.get("detail", e.reason) if isinstance(body, dict) else e.reason
    return " ".join(str(detail).split())


def load_drift(source: str, model: str | None = None, version: str | None = None,
               api_key: str | None = None) -> dict[str, Any]:
    """An http(s):// `source` is a gateway (needs `model`), anything else a saved JSON file."""
    if source.startswith(("http://", "https://")):
        if not model:
            raise DriftInputError("a gateway URL needs --model NAME")
        return fetch_drift(source, model, version, api_key)
    return read_drift(source)


def _shares(counts: list[float]) -> list[float]:
    total = float(sum(counts))
    return [c / total if total else 0.0 for c in counts]


def _title(report: dict[str, Any]) -> str:
    what = f"{report.get('model', '?')} v{report.get('version', '?')}"
    alarm = "ALARM" if report.get("alarm") else "no alarm"
    window = report.get("window")
    return (f"{what}: drift {float(report['statistic']):.3f}, p = {float(report['p_value']):.3g}, {alarm}"
            + (f"\nwindow of {window}" if window is not None else "")
            + (f", OOD share {float(report['ood_rate']):.1%}" if isinstance(report.get("ood_rate"), (int, float))
               else "")
            + (f" (expected {float(report['expected_ood_rate']):.0%})"
               if isinstance(report.get("expected_ood_rate"), (int, float)) else ""))


def draw_drift(report: dict[str, Any], out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Draw `report` (the drift endpoint's JSON) to the PNG `out`, atomically; FileExistsError if `out` exists
    and not `overwrite`."""
    report = check_report(report)
    out = Path(out)
    if out.exists() and (out.is_dir() or not overwrite):
        raise FileExistsError(f"{out} exists" + ("" if out.is_dir() else "; pass overwrite=True (CLI: --force)"))
    fig = Figure(figsize=(11, 4.2), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2, width_ratios=[3, 2])
    h = report["histogram"]
    edges = [float(e) for e in h["edges"]]
    if len(edges) >= 2:
        widths = [b - a for a, b in itertools.pairwise(edges)]
        left.bar(edges[:-1], _shares(h["reference"]), widths, align="edge", color=REFERENCE_COLOUR, alpha=0.5,
                 label="reference (calibration)")
        left.bar(edges[:-1], _shares(h["window"]), widths, align="edge", color=WINDOW_COLOUR, alpha=0.5,
                 label="window")
    threshold = report.get("threshold")
    if isinstance(threshold, (int, float)) and not isinstance(threshold, bool):
        left.axvline(float(threshold), color=THRESHOLD_COLOUR, linestyle="--", linewidth=1.5,
                     label=f"OOD threshold {float(threshold):.3g}")
    left.set_xlabel(f"OOD score ({report.get('method', 'score')})")
    left.set_ylabel("share of images")
    left.set_title(_title(report), fontsize=10, color="tab:red" if report.get("alarm") else "black")
    left.legend(fontsize=8)
    classes = report["classes"]
    if classes:
        names = [str(c.get("label") or c.get("index", i)) for i, c in enumerate(classes)]
        y = list(range(len(classes)))
        right.barh([v - 0.2 for v in y], [float(c["reference_share"]) for c in classes], 0.4,
                   color=REFERENCE_COLOUR, label="reference")
        right.barh([v + 0.2 for v in y], [float(c["window_share"]) for c in classes], 0.4, color=WINDOW_COLOUR,
                   label="window")
        right.set_yticks(y, names)
        right.invert_yaxis()
        right.legend(fontsize=8)
    else:
        right.text(0.5, 0.5, "no class moved", ha="center", va="center", transform=right.transAxes)
        right.set_yticks([])
    right.set_xlabel("share of top-1 answers")
    right.set_title("classes that moved most", fontsize=10)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".png", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=DPI, facecolor="white")
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out
