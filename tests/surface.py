"""The public surface frozen before the redesign (issue 20): every command's flags and defaults, and the OpenAPI
schema. `python -m tests.surface WRITE_DIR` writes it; tests/test_surface.py diffs today's against the copy in
tests/data/surface, saved at 5c1a208, before the change."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

# argparse wraps help at the terminal's width: fixed, so that the texts compare on any machine.
os.environ["COLUMNS"] = "120"


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from vit_export.cli import build_parser as export_parser

    from vit_serve.cli import build_parser

    top = build_parser()
    out = {"vit-serve": top, "vit-export": export_parser()}
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            out.update({f"vit-serve {name}": sub for name, sub in action.choices.items()})
    return out


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return repr(value)


def flags(parser: argparse.ArgumentParser) -> list[dict[str, Any]]:
    """Each argument of `parser`: its flags, destination, default, choices, nargs, const, required."""
    rows = []
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            continue
        rows.append({"flags": list(a.option_strings), "dest": a.dest, "default": _jsonable(a.default),
                     "choices": _jsonable(list(a.choices)) if a.choices is not None else None,
                     "nargs": _jsonable(a.nargs), "const": _jsonable(a.const), "required": a.required,
                     "action": type(a).__name__, "metavar": _jsonable(a.metavar)})
    return rows


def serve_defaults() -> dict[str, Any]:
    """ServeSettings' defaults by environment name (what an unset `serve` flag means), machine-dependent ones out."""
    from vit_serve.serve.settings import ServeSettings

    s = ServeSettings()
    dumped = s.model_dump(mode="json", exclude={"store_secret", "decode_workers"})
    flat: dict[str, Any] = {}
    for key, value in dumped.items():  # groups, if any, flattened: the environment names are flat
        flat.update(value if isinstance(value, dict) and key not in ("load_models",) else {key: value})
    return dict(sorted(flat.items()))


def openapi() -> dict[str, str]:
    """/openapi.json's bytes, for the default gateway and one with keys, CORS and a root path."""
    from fastapi.testclient import TestClient

    from vit_serve.serve import ServeSettings, create_app

    out = {}
    for name, settings in {"default": ServeSettings(),
                           "keys": ServeSettings(api_keys=["k"], admin_api_keys=["a"], cors_origins=["*"],
                                                 root_path="/vit")}.items():
        app = create_app(settings)
        with TestClient(app) as _:
            pass
        out[name] = TestClient(app).get("/openapi.json").text
    return out


def write(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    parsers = _parsers()
    (folder / "flags.json").write_text(json.dumps({k: flags(p) for k, p in parsers.items()}, indent=1) + "\n")
    (folder / "serve_defaults.json").write_text(json.dumps(serve_defaults(), indent=1) + "\n")
    for name, p in parsers.items():
        (folder / f"{name.replace(' ', '_')}.help.txt").write_text(p.format_help())
    for name, text in openapi().items():
        (folder / f"openapi_{name}.json").write_text(text)


if __name__ == "__main__":
    write(Path(sys.argv[1]))
