"""Refusals: a checkpoint that is readable but of an architecture or format we do not take (BEiT's relative position
bias, RADIO, the 7B DINOv3, a bare timm state dict that does not name its architecture, a TorchScript archive). One
line naming what is missing; the CLI exits 2."""

from __future__ import annotations

from vit_serve.checkpoints.converted import CheckpointError


class UnsupportedCheckpoint(CheckpointError):  # noqa: N818 (named as the readers know it)
    """A known but unsupported architecture or format; `exit_code` 2 in the CLI (a usage error, nothing written)."""

    exit_code = 2
