"""`vit-serve serve --config FILE`: the gateway's settings from a .toml or .json file.

The file holds the flat setting names of `ServeSettings` (those of VIT_SERVE_<NAME> and of the flags, with
underscores), e.g.::

    model = "exports/vit_224_int8.onnx"
    backend = "onnxruntime"
    threads = 1
    decode_workers = 2
    max_batch = 8
    max_delay_ms = 2.0

Precedence: flags > VIT_SERVE_* variables > the file > the defaults. Relative paths in the file are taken from the
file's folder (a file written beside its exports moves with them): the `*_file` settings and the SSL certificate
and key always, `model` when something by that name is there (otherwise it is kept as written: a hub id, a Triton
model name). `tome` may be a number or a list (13, [13, 13, 8]) as well as the flag's text.

Every failure is a `SettingsFileError` (a ValueError) whose one-line message names the file, and the setting:
"serve.toml: unknown setting 'max_bach' (did you mean 'max_batch'?)", "serve.toml: max_batch: Input should be
greater than or equal to 1". `serve_settings` gives the command's settings, with or without a file, every error
one line naming where the bad value came from.
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from vit_serve.serve.settings import _FILE_VALUES, GROUPS, ServeSettings

SUFFIXES = (".toml", ".json")
# Settings naming a file, taken from the settings file's folder when relative.
PATH_SETTINGS = ("api_keys_file", "admin_api_keys_file", "store_password_file", "store_secret_file", "ssl_certfile",
                 "ssl_keyfile")
ENV_PREFIX = "VIT_SERVE_"

__all__ = ["PATH_SETTINGS", "SUFFIXES", "SettingsFileError", "describe", "read_settings_file", "serve_settings",
           "settings_from_file"]


class SettingsFileError(ValueError):
    """A settings file that cannot be used; the message (one line) names the file, and the setting."""


def _parse(path: Path) -> dict[str, Any]:
    if path.suffix.lower() not in SUFFIXES:
        raise SettingsFileError(f"{path}: a settings file is .toml or .json")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SettingsFileError(f"{path}: cannot read it: {getattr(e, 'strerror', None) or e}") from None
    try:
        data = tomllib.loads(text) if path.suffix.lower() == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        kind = "TOML" if path.suffix.lower() == ".toml" else "JSON"
        raise SettingsFileError(f"{path}: not valid {kind}: {e}") from None
    if not isinstance(data, dict):
        raise SettingsFileError(f"{path}: expected a table of settings (name = value), got {type(data).__name__}")
    return data


def _tome(value: Any) -> Any:
    """13 -> "13", [13, 13, 8] -> "13,13,8": the flag's text, which the field takes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return ",".join(str(v) for v in value)
    return value


def read_settings_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The file's settings by flat name, relative paths taken from its folder (module docstring); unknown names
    refused (`SettingsFileError`). The values are not checked here (`settings_from_file` does)."""
    path = Path(path)
    data = _parse(path)
    known = ServeSettings.flat_fields()
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            groups = " (groups are not tables here: write their fields' names flat)" if key in GROUPS else ""
            raise SettingsFileError(f"{path}: unknown setting {key!r}{hint}{groups}")
    folder = path.parent
    values = dict(data)
    for key in PATH_SETTINGS:
        if isinstance(values.get(key), str) and values[key] and not Path(values[key]).is_absolute():
            values[key] = os.path.abspath(folder / values[key])
    model = values.get("model")
    if isinstance(model, str) and model and not Path(model).is_absolute() and (folder / model).exists():
        values["model"] = os.path.abspath(folder / model)
    if "tome" in values:
        values["tome"] = _tome(values["tome"])
    return values


def _env_names() -> set[str]:
    """The flat names the environment sets (VIT_SERVE_<NAME>, any case, as pydantic-settings reads them)."""
    return {k[len(ENV_PREFIX):].lower() for k in os.environ if k.upper().startswith(ENV_PREFIX)}


def _flat_name(loc: tuple[Any, ...]) -> str:
    return "_".join(str(p) for p in loc if p not in GROUPS)


def describe(error: ValidationError, file: str | os.PathLike[str] | None = None,
             from_file: set[str] | frozenset[str] = frozenset()) -> str:
    """One line for a ValidationError of `ServeSettings`: each bad value named where it came from: "FILE: name:
    message" for the names in `from_file`, else "--flag / VIT_SERVE_NAME: message"."""
    parts = []
    for err in error.errors():
        name = _flat_name(err["loc"])
        if not name:
            parts.append(err["msg"])
        elif name in from_file and file is not None:
            parts.append(f"{file}: {name}: {err['msg']}")
        else:
            parts.append(f"--{name.replace('_', '-')} / {ENV_PREFIX}{name.upper()}: {err['msg']}")
    return "; ".join(parts)


def settings_from_file(path: str | os.PathLike[str], **overrides: Any) -> ServeSettings:
    """`ServeSettings` from the file at `path`, under the environment and `overrides` (flat names: the flags).
    SettingsFileError when the file is unusable or every bad value came from it; pydantic's ValidationError
    when a bad value came from `overrides` or the environment (`describe` words both)."""
    values = read_settings_file(path)
    token = _FILE_VALUES.set(values)
    try:
        return ServeSettings.of(overrides)
    except ValidationError as e:
        from_file = set(values) - set(overrides) - _env_names()
        if all(_flat_name(err["loc"]) in from_file for err in e.errors()):
            raise SettingsFileError(describe(e, path, from_file)) from None
        raise
    finally:
        _FILE_VALUES.reset(token)


def serve_settings(config: str | os.PathLike[str] | None, flags: dict[str, Any]) -> ServeSettings:
    """`vit-serve serve`'s settings: `flags` (flat names; None left out) over VIT_SERVE_* over the file
    `config` (if any) over the defaults. ValueError, its message one line naming the file, flag or variable of
    each bad value."""
    flags = {k: v for k, v in flags.items() if v is not None}
    try:
        if config is None:
            return ServeSettings.of(flags)
        return settings_from_file(config, **flags)
    except ValidationError as e:
        from_file = set()
        if config is not None:
            from_file = set(read_settings_file(config)) - set(flags) - _env_names()
        raise ValueError(describe(e, config, from_file)) from None
