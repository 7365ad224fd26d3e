"""API keys as the gateway keeps them: sha256 hashes (`key_hash`), from settings or key files (`read_key_file`).

Settings hash their keys when they validate (`vit_serve.serve.settings`), and the key check compares hashes
(`vit_serve.serve.security`); a `sha256:HEX` entry is taken as a hash already, so that a deployment need not hold
the keys at all.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

HASH_PREFIX = "sha256:"


def key_hash(key: str) -> str:
    """"sha256:HEX" of a key (a "sha256:HEX" entry is taken as a hash already)."""
    key = key.strip()
    if key.startswith(HASH_PREFIX) and re.fullmatch(r"[0-9a-f]{64}", key[len(HASH_PREFIX):]):
        return key
    return HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def read_key_file(path: str) -> list[str]:
    """Keys (or hashes) of a file, one a line; blank lines and # comments skipped. ValueError naming the file."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the key file {path}: {e}") from e
    keys = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    if not keys:
        raise ValueError(f"the key file {path} holds no key")
    return keys
