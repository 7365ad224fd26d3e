"""The `vit-export` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vit-export",
                                description="Export a vit-serve checkpoint to ONNX / TensorRT / Triton.")
    p.add_argument("checkpoint")
    p.add_argument("--res", default=None, help="resolution, e.g. 384 or 224x320, or 'dynamic'")
    p.add_argument("--format", default="onnx,triton")
    p.add_argument("--out", default="model_repo")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    build_parser().parse_args(argv)
    print("vit-export: error: exporting is not implemented in this release yet; convert checkpoints with "
          "`vit-serve convert` meanwhile", file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
