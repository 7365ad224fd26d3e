"""No change since the surface was saved (tests/data/surface, before the redesign of issue 20, 5c1a208) removed
or altered any of it: every saved flag with its defaults, every saved setting default, every saved path, parameter
and schema of the OpenAPI document is still there, as it was. Later features may only add (new flags, settings,
query parameters, routes); each addition is printed, so a reviewer sees what grew.

Changed once on purpose, by issue 39 (point 3, settings by scope), the saved copy untouched:
- deprecated: the nested environment spelling of a group's field (VIT_SERVE_LIMITS__MAX_BATCH), read for one
  release with a SettingNameWarning naming the flat variable (VIT_SERVE_MAX_BATCH), which stays canonical and
  wins where both are set (vit_serve.serve.settings.ENV_RENAMED); every saved name still reads, silently;
- removed: ServeSettings' flat attributes (settings.max_batch: read settings.limits.max_batch); its flat keywords
  (ServeSettings(max_batch=4)) stay, as the flags, variables and files name a setting;
- --help lists the server's options under their scope's titles (server: listeners, ...), the model defaults in a
  group of their own; the usage line keeps its order."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests import surface

SAVED = Path(__file__).parent / "data" / "surface"


def _usage(text: str) -> str:
    """The usage paragraph of a --help text: every flag, its metavar and its order (choices, which may grow,
    as {...})."""
    return re.sub(r"\{[^}]*\}", "{...}", " ".join(text.split("\n\n", 1)[0].split()))


def _contains(now, saved, where: str = "") -> list[str]:
    """What of `saved` is missing or different in `now` (dicts: every saved key, recursively; lists: the saved
    items in order, new ones allowed after or between them; anything else: equal)."""
    if isinstance(saved, dict) and isinstance(now, dict):
        return [p for k, v in saved.items() if k != "description"  # prose may say more; what it describes may not
                for p in (_contains(now[k], v, f"{where}/{k}") if k in now else [f"{where}/{k} removed"])]
    if isinstance(saved, list) and isinstance(now, list) and saved and not isinstance(saved[0], (dict, list)):
        rest = iter(now)  # scalars (an enum's values): each saved one still there, in order
        return [f"{where}: {v!r} removed" for v in saved if not any(v == n for n in rest)]
    if isinstance(saved, list) and isinstance(now, list) and not (saved and not isinstance(saved[0], dict)):
        rest = iter(now)
        missing = [f"{where}[{i}]" for i, item in enumerate(saved) if not any(not _contains(n, item) for n in rest)]
        return missing
    return [] if now == saved else [f"{where}: {saved!r} -> {now!r}"]


def test_saved_flags_and_defaults_kept():
    saved = json.loads((SAVED / "flags.json").read_text())
    now = {name: surface.flags(p) for name, p in surface._parsers().items()}
    assert set(saved) <= set(now)
    for name in saved:
        kept = {f["dest"]: f for f in now[name]}
        for flag in saved[name]:
            got = dict(kept.get(flag["dest"], {}))
            if flag.get("choices") and set(flag["choices"]) <= set(got.get("choices") or ()):
                got["choices"] = flag["choices"]  # a new choice is an addition
            assert got == flag, (name, flag["dest"])
        order = [f["dest"] for f in now[name] if f["dest"] in {g["dest"] for g in saved[name]}]
        assert order == [f["dest"] for f in saved[name]], name
        added = sorted(set(kept) - {f["dest"] for f in saved[name]})
        if added:
            print(f"{name}: added {', '.join(added)}")


def _saved_help(name: str) -> str | None:
    """The saved --help text of command `name`; None for a command added since (printed: an addition)."""
    path = SAVED / f"{name.replace(' ', '_')}.help.txt"
    if not path.exists():
        print(f"added command: {name}")
        return None
    return path.read_text()


def test_saved_usage_kept_in_order():
    for name, parser in surface._parsers().items():
        if (saved := _saved_help(name)) is None:
            continue
        tokens, now = _usage(saved).split(), iter(_usage(parser.format_help()).split())
        assert all(any(t == n for n in now) for t in tokens), name


def test_every_option_still_documented():
    for name, parser in surface._parsers().items():
        if (saved := _saved_help(name)) is None:
            continue
        for flag in sorted(set(re.findall(r"^\s+(--[a-z0-9-]+)", saved, re.M))):
            assert re.search(rf"^\s+{re.escape(flag)}\b", parser.format_help(), re.M), (name, flag)


def test_saved_environment_names_kept():
    """Each saved setting is still read as VIT_SERVE_<NAME>, and none of those names is deprecated."""
    from vit_serve.serve.settings import ENV_RENAMED, ServeSettings

    saved = json.loads((SAVED / "serve_defaults.json").read_text())
    assert set(saved) <= set(ServeSettings.flat_fields())
    assert not {f"VIT_SERVE_{name.upper()}" for name in saved} & set(ENV_RENAMED)


def test_saved_serve_defaults_kept():
    now, saved = surface.serve_defaults(), json.loads((SAVED / "serve_defaults.json").read_text())
    assert _contains(now, saved) == []
    print("added settings:", sorted(set(now) - set(saved)))


@pytest.mark.parametrize("name", ["default", "keys"])
def test_saved_openapi_schema_kept(name):
    now, saved = json.loads(surface.openapi()[name]), json.loads((SAVED / f"openapi_{name}.json").read_text())
    assert _contains(now, saved) == []


def test_contains_sees_a_removal_and_a_change():
    saved = {"a": [{"name": "x"}, {"name": "y"}], "b": 1}
    assert _contains({"a": [{"name": "x"}, {"name": "new"}, {"name": "y"}], "b": 1, "c": 2}, saved) == []
    assert _contains({"a": [{"name": "x"}], "b": 1}, saved) == ["/a[1]"]
    assert _contains({"a": [{"name": "x"}, {"name": "y"}], "b": 2}, saved) == ["/b: 1 -> 2"]
