"""benchmarks/serve_load.py's batching checks say what the README says: equal at c=1, never slower above it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_load.py"


def _script():
    spec = importlib.util.spec_from_file_location("serve_load", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_batching_checks_pass_the_recorded_table_and_fail_a_slower_concurrent_run():
    checks = _script().batching_checks
    recorded = checks({1: 27.7, 4: 35.0, 16: 36.9, 64: 35.0}, {1: 27.8, 4: 32.5, 16: 33.0, 64: 31.8})
    assert [ok for *_, ok in recorded] == [True, True], recorded  # 0.996x at c=1 is noise, not a loss
    slower = checks({1: 27.7, 4: 32.0}, {1: 27.8, 4: 32.5})  # 0.98x at c=4: passed the old >= 0.95 check
    assert [ok for *_, ok in slower] == [True, False], slower
    assert "c=4" in slower[1][0]
