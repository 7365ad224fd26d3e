"""The `vit-serve` commands: `main` (the console script, `vit_serve.cli:main`) and `build_parser`.

main.py: parse, call the library, print; flags.py: flags generated from typed fields (`vit_serve.flag.Flag`);
drift_figure.py: `vit-serve inspect --drift`'s picture. Nothing imports the CLI.
"""

from vit_serve.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
