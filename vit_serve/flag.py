"""How a typed field is spelled on a command line: the `Flag` a field carries (`Annotated[T, Flag(...)]` in a
pydantic model, `field(metadata={FLAG_KEY: Flag(...)})` in a dataclass). Only a mark: the CLI
(`vit_serve.cli.flags`) turns marked fields into argparse arguments, so that the settings' modules import no CLI.
"""

from __future__ import annotations

from dataclasses import dataclass

FLAG_KEY = "flag"  # a dataclass field's metadata key


@dataclass(frozen=True)
class Flag:
    """How a field is spelled on a command line.

    help: the help text of a field without a description ("{default}" becomes the field's default); a field with
    one leaves it unset: its description is the help, with the default it leaves said after it (one text);
    name: the flag (default --field-name, or --no-field-name for a bool whose default is True); metavar;
    positional: an argument rather than a flag (optional, nargs "?", when the field has a default); none: the
    choice that means None (a `Literal[...] | None` field); after: the field whose flag this one follows in
    --help (default: the field order); section: the argument group it is listed under (None: the command's own
    options, which `vit-serve serve` lists by their scope, `vit_serve.serve.setting_scopes`; "model" for the model
    defaults, "triton", "store", "sampler", "ray"); hidden: a rarely used flag, left out of --help (listed by
    --help-all) and accepted for one release with a deprecation warning naming its VIT_SERVE_* variable and
    settings-file key, which stay the documented place.
    """

    help: str | None = None
    name: str | None = None
    metavar: str | None = None
    positional: bool = False
    none: str | None = None
    after: str | None = None
    section: str | None = None
    hidden: bool = False
