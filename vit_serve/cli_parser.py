"""The argument parser of both commands (`vit-serve`, `vit-export`): usage errors are one line."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn, TypeVar

T = TypeVar("T")


class OneLineParser(argparse.ArgumentParser):
    """argparse, but usage errors are one line (the full usage stays behind --help)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def argument_type(parse: Callable[[str], T]) -> Callable[[str], T]:
    """A library parser as an argparse `type=`: its ValueError's message becomes the usage error, word for word
    (argparse would otherwise replace it with "invalid <name> value")."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert
