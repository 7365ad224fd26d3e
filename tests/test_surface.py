"""The redesign of issue 20 changed no public surface: the flags and defaults of every command and the OpenAPI
schema are those saved in tests/data/surface before it (5c1a208), by tests/surface.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests import surface

SAVED = Path(__file__).parent / "data" / "surface"


def _usage(text: str) -> str:
    """The usage paragraph of a --help text: every flag, its metavar and its order."""
    return " ".join(text.split("\n\n", 1)[0].split())


def test_flags_and_defaults_unchanged():
    saved = json.loads((SAVED / "flags.json").read_text())
    now = {name: surface.flags(p) for name, p in surface._parsers().items()}
    assert sorted(now) == sorted(saved)
    for name in saved:
        assert now[name] == saved[name], name


def test_usage_lines_unchanged():
    for name, parser in surface._parsers().items():
        saved = (SAVED / f"{name.replace(' ', '_')}.help.txt").read_text()
        assert _usage(parser.format_help()) == _usage(saved), name


def test_every_option_still_documented():
    for name, parser in surface._parsers().items():
        saved = (SAVED / f"{name.replace(' ', '_')}.help.txt").read_text()
        for flag in sorted(set(re.findall(r"^\s+(--[a-z0-9-]+)", saved, re.M))):
            assert re.search(rf"^\s+{re.escape(flag)}\b", parser.format_help(), re.M), (name, flag)


def test_serve_defaults_unchanged():
    assert surface.serve_defaults() == json.loads((SAVED / "serve_defaults.json").read_text())


@pytest.mark.parametrize("name", ["default", "keys"])
def test_openapi_schema_byte_identical(name):
    assert surface.openapi()[name] == (SAVED / f"openapi_{name}.json").read_text()
