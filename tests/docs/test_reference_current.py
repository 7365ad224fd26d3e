"""The generated pages of the docs (docs/reference/, docs/troubleshooting.md) are what the code gives today, and
they list everything: every flag of every command, every setting, every route, every manifest field and every
status of the gateway's error table. Adding a flag, a setting or a route without running
`python docs/gen_reference.py` fails here."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_reference"] = module  # docs/troubleshooting.py imports it by this name
    spec.loader.exec_module(module)
    return module


gen = _load_generator()


@pytest.fixture(scope="module")
def generated() -> dict[str, str]:
    return gen.pages()


def test_committed_pages_are_current(generated):
    stale = gen.stale(generated)
    assert not stale, (f"generated docs are stale: {', '.join('docs/' + p for p in stale)}; run "
                       f"`{gen.COMMAND}` and commit the pages")


def test_every_flag_of_every_command_is_listed(generated):
    page = generated["reference/cli.md"]
    for name, parser in gen._parsers().items():
        assert f"## `{name}`" in page
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            for flag in action.option_strings or [action.metavar or action.dest]:
                assert f"`{flag}`" in page, (name, flag)


def test_a_new_flag_changes_the_commands_page(monkeypatch):
    before = gen.cli_page()
    parsers = gen._parsers()
    parsers["vit-serve predict"].add_argument("--brand-new-flag", help="added by the test")
    monkeypatch.setattr(gen, "_parsers", lambda: parsers)
    after = gen.cli_page()
    assert after != before and "`--brand-new-flag`" in after and "added by the test" in after


def test_every_setting_is_listed_with_its_variable_and_default(generated):
    from vit_serve.runtime.model_config import KEYS
    from vit_serve.serve.settings import ServeSettings

    page = generated["reference/settings.md"]
    settings, model_keys = page.split("## A model's own config.toml", 1)
    rows = {line.split("<br>")[0].strip("| `"): line for line in settings.splitlines() if line.startswith("| `")}
    for name, info in ServeSettings.flat_fields().items():
        assert f"`VIT_SERVE_{name.upper()}`" in rows[name], name
        default = info.get_default(call_default_factory=True)
        if isinstance(default, int) and not isinstance(default, bool) and default < 1 << 20:
            assert f"`{default}`" in rows[name], (name, default)
    assert all(f"| `{key}` |" in model_keys for key in KEYS)


def test_every_route_is_listed(generated):
    page = generated["reference/http.md"]
    schema = gen.openapi_schema()
    for path, item in schema["paths"].items():
        for method in item:
            assert f"### `{method.upper()} {path}`" in page
    for name in schema["components"]["schemas"]:
        assert f"### {name}\n" in page


def test_every_manifest_field_is_listed(generated):
    from vit_serve.manifest import Architecture, ExportManifest, TensorRTBuild, TritonMeta

    page = generated["reference/manifest.md"]
    for cls in (ExportManifest, TritonMeta, Architecture, TensorRTBuild):
        section = page.split(f"## {cls.__name__}\n", 1)[1].split("\n## ", 1)[0]
        for f in dataclasses.fields(cls):
            key = gen.MANIFEST_KEYS.get((cls.__name__, f.name), f.name)
            assert f"| `{key}` |" in section, (cls.__name__, f.name)


def test_every_status_of_the_error_table_is_explained(generated):
    from vit_serve.serve.errors import STATUSES

    page = generated["troubleshooting.md"]
    for cls, status in STATUSES.items():
        row = next(line for line in page.splitlines() if line.startswith(f"| {status} |"))
        assert f"`{cls.__name__}`" in row
    assert "`OptionError`" in page and "`UnsupportedCheckpoint`" in page  # the classes that exit 2


def test_api_pages_name_modules_that_exist(generated):
    for _title, module, _what in gen.API_MODULES:
        assert importlib.util.find_spec(module) is not None, module
        assert any(f"::: {module}\n" in text for text in generated.values())


def test_a_status_without_advice_is_refused(monkeypatch):
    from troubleshooting import troubleshooting_page

    from vit_serve.serve import errors

    class TeapotError(errors.GatewayError):
        pass

    monkeypatch.setitem(errors.STATUSES, TeapotError, 418)
    with pytest.raises(SystemExit, match="418"):
        troubleshooting_page()


@pytest.mark.parametrize("saved", ["tiny_explain.json", "tiny_int8.json", "model_sm90.json"])
def test_the_manifest_page_names_the_keys_vit_export_writes(generated, saved):
    """The JSON keys of real manifests (tests/data/manifest_v1, read and written again as schema 2) are the keys the
    page lists, nested objects included: a renamed key in `to_dict` fails here."""
    import json

    from vit_serve.manifest import ExportManifest

    data = ExportManifest.from_dict(json.loads((DOCS.parent / "tests/data/manifest_v1" / saved).read_text()))
    page = generated["reference/manifest.md"]
    listed = {key.strip() for line in page.splitlines() if line.startswith("| `")
              for key in line.split("`")[1].split(",")}
    written = data.to_dict()
    free_form = ("preprocess", "int8", "versions", "reference")  # objects whose keys are not the manifest's own
    nested = [written] + [v for k, v in written.items() if isinstance(v, dict) and k not in free_form]
    missing = {k for d in nested for k in d if k not in listed}
    assert not missing, f"keys {sorted(missing)} are written but not on the manifest page (gen_reference.MANIFEST_KEYS)"
