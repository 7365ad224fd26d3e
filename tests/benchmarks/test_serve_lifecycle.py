"""benchmarks/serve_lifecycle.py's pure pieces: it reads the counters the gateway exposes (a real GatewayMetrics
page), its keys file is what the gateway's key-file reader accepts, and its clients send the deadline header."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_lifecycle.py"


def _script():
    spec = importlib.util.spec_from_file_location("serve_lifecycle", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_counts_read_a_real_metrics_page_and_subtract():
    from prometheus_client import Counter

    from vit_serve.serve.metrics import GatewayMetrics

    m = _script()
    metrics = GatewayMetrics()
    v1, v2 = metrics.for_model("vit", "1"), metrics.for_model("vit", "2")
    v1.batch_size("classify").observe(8)
    v2.batch_size("classify").observe(3)
    before = m.counts_of(metrics.render().decode())
    v1.batch_size("classify").observe(5)
    v1.batch_size("embed").observe(2)
    v1.cancelled("queue").inc(3)
    v1.cancelled("infer").inc()
    v1.rejected("deadline").inc(4)
    dropped = Counter("vit_serve_shadow_dropped", "copies dropped", ["model", "version", "reason"],
                      registry=metrics.registry)
    dropped.labels("vit", "2", "busy").inc(6)
    after = m.counts_of(metrics.render().decode())
    assert after.images == {"1": 15, "2": 3} and after.has_cancelled
    d = after - before
    assert d.images == {"1": 7} and d.images_run == 7
    assert d.cancelled == {"queue": 3, "infer": 1}
    assert d.rejected == {"deadline": 4} and d.dropped == {"busy": 6}
    assert not m.counts_of("# HELP vit_serve_batch_size images\n").has_cancelled  # today's gateway: no counter


def test_keys_file_is_read_by_the_gateway_with_its_levels(tmp_path):
    from vit_serve.serve.keys import key_hash, read_key_file

    m = _script()
    entries = read_key_file(str(m.keys_file(tmp_path)))
    assert [(e.name, e.priority, e.rate) for e in entries] == [("gold", 1, None), ("bronze", 2, None),
                                                              ("metrics", None, None)]
    assert entries[0].hash == key_hash(m.GOLD)


def test_clients_send_their_deadline_and_key():
    m = _script()
    assert m.Clients(rate=1, deadline_ms=1000, key="k").headers() == {"X-Request-Timeout-Ms": "1000",
                                                                      "Authorization": "Bearer k"}
    assert m.Clients(rate=1).headers() == {}
