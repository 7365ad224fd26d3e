"""deploy/grafana/vit-serve.json: a dashboard Grafana's own model reads whole (grafana-foundation-sdk, the
Python types generated from Grafana's dashboard schema), whose PromQL asks only for series the gateway exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "vit-serve.json"
IMPORT_ENVELOPE = {"__inputs", "__requires"}  # Grafana's export/import wrapper, not part of the dashboard model
MONITORING = ("vit_serve_drift", "vit_serve_drift_alarm", "vit_serve_drift_p_value", "vit_serve_confidence",
              "vit_serve_ood_score_ratio")
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
            "gauge": ("",), "summary": ("", "_count", "_sum", "_created")}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(d: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def _lost(ours: Any, back: Any, where: str = "") -> list[str]:
    """What of `ours` is not in `back` as it was: dict keys recursively, lists item by item."""
    if isinstance(ours, dict):
        if not isinstance(back, dict):
            return [f"{where}: {back!r}"]
        return [p for k, v in ours.items()
                for p in (_lost(v, back[k], f"{where}/{k}") if k in back else [f"{where}/{k} dropped"])]
    if isinstance(ours, list):
        if not isinstance(back, list) or len(back) != len(ours):
            return [f"{where}: {back!r}"]
        return [p for i, (a, b) in enumerate(zip(ours, back, strict=True)) for p in _lost(a, b, f"{where}[{i}]")]
    return [] if ours == back and type(ours) is type(back) else [f"{where}: {ours!r} -> {back!r}"]


def _exprs(d: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in _panels(d) for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in d["templating"]["list"] if v["type"] == "query"]
    return exprs


def _metric_names(expr: str) -> set[str]:
    """The series an expression selects: identifiers of the gateway's namespace, label names and values aside."""
    no_strings = re.sub(r'"[^"]*"', '""', expr)
    no_matchers = re.sub(r"\{[^}]*\}", "{}", no_strings)
    return set(re.findall(r"\bvit_serve_[a-z0-9_]+\b", no_matchers))


def _exported() -> dict[str, set[str]]:
    """Every series name GatewayMetrics' registry exposes, by the family it belongs to."""
    from vit_serve.serve.metrics import GatewayMetrics

    return {m.name: {m.name + s for s in SUFFIXES[m.type]} for m in GatewayMetrics().registry.collect()}


def _collector(name: str) -> Any:
    from prometheus_client import metrics as pm

    from vit_serve.serve.metrics import GatewayMetrics

    for value in vars(GatewayMetrics()).values():
        if isinstance(value, pm.MetricWrapperBase) and value.describe()[0].name == name:
            return value
    raise LookupError(name)


def test_grafana_model_reads_it_whole(dashboard):
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models import prometheus, stat, timeseries
    from grafana_foundation_sdk.models.dashboard import Dashboard, RowPanel

    register_default_plugins()
    model = Dashboard.from_json(dashboard)
    back = json.loads(json.dumps(model, cls=JSONEncoder))
    # from_json keeps only the fields the schema has (and to_json adds its defaults): a typo, a field of another
    # version or a value of the wrong kind shows as dropped or changed
    assert _lost({k: v for k, v in dashboard.items() if k not in IMPORT_ENVELOPE}, back) == []
    options = {"stat": stat.Options, "timeseries": timeseries.Options}
    for panel in model.panels or []:
        if isinstance(panel, RowPanel):
            continue
        assert isinstance(panel.options, options[panel.type_val]), panel.title
        assert all(isinstance(t, prometheus.Dataquery) for t in panel.targets or []), panel.title
        assert panel.datasource is not None and panel.datasource.uid == "${DS_PROMETHEUS}", panel.title


def test_datasource_input_and_template_variables(dashboard):
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    assert dashboard["__inputs"][0]["pluginId"] == "prometheus"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert set(variables) == {"model", "version"}
    assert "$model" in variables["version"]["query"]["query"]
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids))
    for p in _panels(dashboard):
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${DS_PROMETHEUS}"
            if "version" in _metric_names(t["expr"]) or '{model' in t["expr"]:
                assert 'model=~"$model", version=~"$version"' in t["expr"], p["title"]


def test_it_shows_what_issue_24_asks_for(dashboard):
    used = set().union(*map(_metric_names, _exprs(dashboard)))
    for name in ("vit_serve_drift", "vit_serve_drift_alarm", "vit_serve_drift_p_value",
                 "vit_serve_ood_score_ratio_bucket", "vit_serve_confidence_bucket", "vit_serve_requests_total",
                 "vit_serve_request_duration_seconds_bucket", "vit_serve_queue_depth", "vit_serve_batch_size_bucket",
                 "vit_serve_rejected_total", "vit_serve_cancelled_total"):
        assert name in used, name


def test_every_base_series_is_exported(dashboard):
    exported = set().union(*_exported().values())
    family = {s: f for f, names in _exported().items() for s in names}
    used = set().union(*map(_metric_names, _exprs(dashboard)))
    missing = sorted(n for n in used if n not in exported and not n.startswith(MONITORING))
    assert not missing, f"the dashboard asks for series the gateway does not export: {missing}"
    assert {family[n] for n in used if n in family} >= {"vit_serve_requests", "vit_serve_batch_size"}


def test_every_monitoring_series_is_exported(dashboard):
    """The gateway's monitoring series (issue 24): skipped until the first of them is in the registry, then
    every one the dashboard uses must be."""
    families = _exported()
    if not any(m in families for m in MONITORING):
        pytest.skip("the gateway exports no monitoring series yet")
    exported = set().union(*families.values())
    used = {n for e in _exprs(dashboard) for n in _metric_names(e) if n.startswith(MONITORING)}
    assert sorted(used - exported) == []


def test_ood_share_reads_the_threshold_bucket(dashboard):
    """The OOD share is 1 - the share in the le="1.0" bucket: 1 must be a bucket bound of the ratio histogram."""
    assert any('le="1.0"' in e for e in _exprs(dashboard))
    try:
        ratio = _collector("vit_serve_ood_score_ratio")
    except LookupError:
        pytest.skip("the gateway exports no vit_serve_ood_score_ratio yet")
    ratio.labels(model="m", version="1").observe(0.5)
    bounds = {s.labels["le"] for m in ratio.collect() for s in m.samples if s.name.endswith("_bucket")}
    assert "1.0" in bounds, sorted(bounds)
