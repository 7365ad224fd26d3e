"""The `vit-serve` command: parse, call the library, print. Errors are one line and a non-zero exit."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

from vit_serve import __version__
from vit_serve.config import RESAMPLE_MODES


def parse_res(text: str) -> tuple[int, int]:
    """"384" -> (384, 384); "384x512" (height x width) -> (384, 512)."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:[xX,]\s*(\d+)\s*)?", text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad resolution {text!r}; use e.g. 384 or 384x512 (height x width)")
    h = int(m[1])
    return h, int(m[2]) if m[2] else h


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line (the full usage stays behind --help)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _cmd_convert(args: argparse.Namespace) -> int:
    from vit_serve.checkpoints import convert

    model = convert(args.src, args.dst, res=args.res, num_classes=args.num_classes, arch=args.arch,
                    resample_mode=args.resample_mode, overwrite=args.force)
    c = model.cfg
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.dst}: {c.embed_dim}d x {c.depth} layers, patch {c.patch_size}, "
          f"{c.img_size[0]}x{c.img_size[1]}, {c.num_classes} classes, {params / 1e6:.1f}M params, "
          f"resample={c.resample_mode}, gelu={c.gelu}, ln_eps={c.layer_norm_eps:g}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="vit-serve", description="Train, export and serve Vision Transformers.")
    p.add_argument("--version", action="version", version=f"vit-serve {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    c = sub.add_parser("convert", help="convert any supported checkpoint to vit-serve's .safetensors format",
                       description="Convert a vit_jax/big_vision .npz, timm, transformers or torchvision "
                                   "checkpoint (file, folder or hub id) to one vit-serve .safetensors file.")
    c.add_argument("src", help="checkpoint file, folder, or hub id (timm/<name>, google/vit-...)")
    c.add_argument("dst", help="output .safetensors path")
    c.add_argument("--res", type=parse_res, help="resample position embeddings to this resolution (384 or HxW)")
    c.add_argument("--num-classes", type=int, help="replace the head with a zero-initialised K-way head")
    c.add_argument("--arch", help="architecture name when the weights do not say (e.g. vit_base_patch16_224)")
    c.add_argument("--resample-mode", choices=RESAMPLE_MODES,
                   help="position-embedding resampling to use and record (default: the source's own)")
    c.add_argument("--force", action="store_true", help="overwrite DST if it exists")
    c.set_defaults(func=_cmd_convert)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileExistsError, FileNotFoundError, OSError) as e:
        # CheckpointError and bad sizes are ValueErrors with a message written for the user.
        print(f"vit-serve {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
