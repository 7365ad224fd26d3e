"""The `vit-serve` commands: `main` (the console script, `vit_serve.cli:main`) and `build_parser`.

- `main`: parse, call the library, print; only the command run gets its flags built (`--help` imports no torch).
- `flags`: flags generated from typed fields (`vit_serve.flag.Flag`).
- `drift_figure`: `vit-serve inspect --drift`'s picture.

Nothing imports the CLI.
"""

from vit_serve.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
