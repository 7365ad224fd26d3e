"""Command-line flags made from typed fields: `add_flags`, which turns the fields that carry a `vit_serve.flag.Flag`
into argparse arguments (name, type, choices from a `Literal`, append for a list, store_const for a bool).

A field gets a flag when it carries a `Flag`: in a pydantic model as `Annotated[T, Flag(...)]`, in a dataclass as
`field(metadata={"flag": Flag(...)})`. The flag's default is always None (unset): the settings keep the defaults,
so that an unset flag leaves the environment's or the field's value alone. A hidden flag (`Flag.hidden`) is left
out of --help (`HelpAll` lists it) and still parses; `warn_hidden` says, when one is given, where it is set instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from vit_serve.flag import FLAG_KEY, Flag


@dataclass(frozen=True)
class FlagField:
    """One field as `add_flags` reads it: its name, type, default (`required` when it has none), description."""

    name: str
    annotation: Any
    default: Any
    required: bool
    description: str | None
    flag: Flag


def pydantic_fields(fields: dict[str, Any]) -> list[FlagField]:
    """The fields of `fields` (name -> pydantic FieldInfo, in order) that carry a `Flag`."""
    out = []
    for name, info in fields.items():
        flag = next((m for m in info.metadata if isinstance(m, Flag)), None)
        if flag is None:
            continue
        required = info.is_required()
        default = None if required else info.get_default(call_default_factory=True)
        out.append(FlagField(name, info.annotation, default, required, info.description, flag))
    return out


def dataclass_fields(cls: type) -> list[FlagField]:
    """The fields of the dataclass `cls` that carry a `Flag` (metadata["flag"]), in order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        flag = f.metadata.get(FLAG_KEY)
        if flag is None:
            continue
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = None if required else (f.default if f.default is not dataclasses.MISSING else f.default_factory())
        out.append(FlagField(f.name, hints[f.name], default, required, None, flag))
    return out


def ordered(fields: list[FlagField]) -> list[FlagField]:
    """`fields` in --help order: the field order, each field with `Flag.after` moved behind the one it names."""
    out = [f for f in fields if f.flag.after is None]
    for f in fields:
        if f.flag.after is not None:
            out.insert(next(i for i, g in enumerate(out) if g.name == f.flag.after) + 1, f)
    return out


def _base(annotation: Any) -> tuple[Any, bool]:
    """(the annotation without None, whether None was allowed): `int | None` -> (int, True)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return (args[0] if len(args) == 1 else annotation), len(args) < len(typing.get_args(annotation))
    return annotation, False


def shown(default: Any) -> str:
    """A default as a help text says it: 10.0 -> "10", 67108864 -> "64 MiB", 50000000 -> "50 M"."""
    if isinstance(default, float):
        return f"{default:g}"
    if isinstance(default, int) and not isinstance(default, bool) and default >= 1 << 20:
        if default % (1 << 20) == 0:
            return f"{default >> 20} MiB"
        if default % 1_000_000 == 0:
            return f"{default // 1_000_000} M"
    return str(default)


def help_text(field: FlagField) -> str:
    """A flag's help: its `Flag.help` ("{default}" replaced), else the field's description, the one text of the
    setting, with the default it leaves alone said after it."""
    if field.flag.help is not None:
        return field.flag.help.replace("{default}", shown(field.default))
    text = (field.description or "").replace("%", "%%")  # argparse formats help with %
    if field.default is True:
        return f"{text} (on by default: this flag turns it off)"
    if field.default is None or field.default is False or field.default == [] or field.default == "":
        return text
    return f"{text} (default {shown(field.default)})"


def argument(field: FlagField) -> tuple[list[str], dict[str, Any]]:
    """The `add_argument` names and keywords of one field (its default is always None, i.e. unset)."""
    flag, (base, optional) = field.flag, _base(field.annotation)
    kw: dict[str, Any] = {"help": help_text(field)}
    if flag.metavar is not None:
        kw["metavar"] = flag.metavar
    if flag.positional:
        if not field.required:
            kw["nargs"] = "?"
        return [field.name], kw
    if base is bool:
        on = field.default is not True
        name = flag.name or ("--" if on else "--no-") + field.name.replace("_", "-")
        return [name], kw | {"dest": field.name, "action": "store_const", "const": on}
    name = flag.name or "--" + field.name.replace("_", "-")
    if name != "--" + field.name.replace("_", "-"):
        kw["dest"] = field.name
    if field.required:
        kw["required"] = True
    if typing.get_origin(base) is list:
        kw["action"], base = "append", typing.get_args(base)[0]
    if typing.get_origin(base) is Literal:
        kw["choices"] = (*typing.get_args(base), *([flag.none] if optional and flag.none else []))
    elif base in (int, float):
        kw["type"] = base
    return [name], kw


Container = argparse.ArgumentParser | argparse._ArgumentGroup


class FlagDeprecationWarning(DeprecationWarning):
    """A hidden flag (`Flag.hidden`) was given: the message names the environment variable and the settings-file
    key that stay the documented place."""


def warn_hidden(given: argparse.Namespace, fields: Iterable[FlagField], env_prefix: str) -> list[str]:
    """Warn (`FlagDeprecationWarning`) for each hidden flag of `fields` that `given` holds a value of; the flags
    warned about."""
    out = []
    for field in fields:
        value = getattr(given, field.name, None)
        if field.flag.hidden and value is not None:
            name = argument(field)[0][0]
            env = str(value).lower() if isinstance(value, bool) else str(value)
            toml = json.dumps(value)  # a TOML value too, for a bool, a number or a string
            warnings.warn(f"{name} is deprecated on the command line and hidden from --help (it still works in this "
                          f"release): set {env_prefix}{field.name.upper()}={env}, or {field.name} = {toml} in a "
                          "--config file", FlagDeprecationWarning, stacklevel=2)
            out.append(name)
    return out


class HelpAll(argparse.Action):
    """--help-all: the --help text with the hidden flags (`Flag.hidden`) shown too, then exit."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        hidden = [a for a in parser._actions if hasattr(a, "full_help")]
        for a in hidden:
            a.help = a.full_help
        try:
            parser.print_help()
        finally:
            for a in hidden:
                a.help = argparse.SUPPRESS
        parser.exit()


def add_flags(parser: Container, fields: list[FlagField], section: str | None = None,
              groups: dict[str, Container] | None = None,
              group_of: Callable[[FlagField], str] = lambda field: field.flag.section or "") -> None:
    """Add the flags of `fields` listed under `section` to `parser`, and the others to the group of `groups` that
    `group_of` names (default: their section), in --help order (one pass: the usage line keeps the field order
    whatever the groups). A hidden flag's help is kept as the action's `full_help`, for `HelpAll`."""
    for field in ordered(fields):
        target = parser if field.flag.section == section else (groups or {}).get(group_of(field))
        if target is not None:
            names, kw = argument(field)
            action = target.add_argument(*names, **kw)
            if field.flag.hidden:
                action.full_help, action.help = action.help, argparse.SUPPRESS
