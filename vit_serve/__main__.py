"""`python -m vit_serve ...` (also what `torchrun -m vit_serve` runs)."""

import sys

from vit_serve.cli import main

sys.exit(main())
