"""A password read from a file (a Kubernetes Secret mount), for the Redis clients of the explain store and the
payload sampler: one trailing newline dropped; an unreadable or empty file is a one-line ValueError."""

from __future__ import annotations

import os
from pathlib import Path


def read_password_file(path: str | os.PathLike, what: str) -> str:
    """The password in `path`; `what` names the setting in the error (e.g. "--store-password-file")."""
    try:
        password = Path(path).read_text().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{what}: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    if not password:
        raise ValueError(f"{what}: {path} is empty")
    return password
