"""`python -m vit_serve.cli ...`: the `vit-serve` command."""

import sys

from vit_serve.cli.main import main

sys.exit(main())
