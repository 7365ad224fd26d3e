"""API keys as the gateway keeps them: sha256 hashes (`key_hash`), from settings or key files (`read_key_file`).

Settings hash their keys when they validate (`vit_serve.serve.settings`), and the key check compares hashes
(`vit_serve.serve.security`); a configured `sha256:HEX` entry is taken as a hash already, so that a deployment need
not hold the keys at all. A key a request presents is always hashed (`presented_hash`): a presented `sha256:HEX`
is never taken for the hash it spells, so knowing a key's hash neither opens the gateway nor names its scope.

A key file holds one key (or `sha256:HEX`) a line; blank lines and `#` comments are skipped. A line may go on with
whitespace-separated fields (`KeyEntry`):

    sha256:2c26b46b...  name=batch-jobs  priority=3  rate=2.5  burst=5

`name` labels the key's metrics and logs (default `key-` + the first 8 hex digits of its sha256, never the key),
`priority` is its Triton level (1 the most urgent; without it, the level `default_key_priority` gives: by default
the middle of the levels the key files give, so that a key nobody ranked outranks no ranked one), `rate` its token
bucket's requests per second (a float > 0; none: no limit) and `burst` the bucket's size (an int >= 1; default
max(1, ceil(rate))). A key itself holds no whitespace. Rates, like every per-key limit, are per replica: each
gateway process keeps its own buckets, so N replicas behind a load balancer let a key through up to N times the
rate.

The key files are read again when they change (checked at most once a second) and on SIGHUP
(`security.KeyRing.refresh`), so that a key is revoked without a restart; a file that cannot be read then, or
holds a bad line, keeps the keys read before (an error is logged). Write a new file and rename it over the old
one, so that no half-written file is read.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path

HASH_PREFIX = "sha256:"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")  # a Prometheus label value that reads well in a log line
FIELDS = ("name", "priority", "rate", "burst")


def key_hash(key: str) -> str:
    """"sha256:HEX" of a configured key (a configured "sha256:HEX" entry is taken as a hash already; a presented
    key goes through `presented_hash`)."""
    key = key.strip()
    if key.startswith(HASH_PREFIX) and re.fullmatch(r"[0-9a-f]{64}", key[len(HASH_PREFIX):]):
        return key
    return HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def presented_hash(key: str) -> str:
    """"sha256:HEX" of a key a request presented: always its hash, even when it reads "sha256:HEX"."""
    return HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def default_name(hashed: str) -> str:
    """The name of a key given none: `key-` and the first 8 hex digits of its hash `hashed` ("sha256:HEX")."""
    return "key-" + hashed.removeprefix(HASH_PREFIX)[:8]


@dataclass(frozen=True)
class KeyEntry:
    """One key of a key file (or of the settings: no fields): its hash, the name its metrics carry, its priority
    level (None: not given, the ring's default level) and its token bucket (`rate` requests/s, `burst` tokens;
    None: no limit)."""

    hash: str
    name: str
    priority: int | None = None
    rate: float | None = None
    burst: int | None = None

    @classmethod
    def of(cls, hashed: str) -> KeyEntry:
        """A key without fields (`--api-key`): its default name, no level, no limit."""
        return cls(hashed, default_name(hashed))


def _field_value(name: str, value: str) -> str | int | float:
    """A field's value, or ValueError saying what it must be."""
    if name == "name":
        if not NAME.fullmatch(value):
            raise ValueError("a name is 1 to 64 letters, digits, '_', '.', ':' or '-', starting with a letter or digit")
        return value
    if name in ("priority", "burst"):
        least = 1
        if not re.fullmatch(r"\d+", value) or int(value) < least:
            raise ValueError(f"{name} must be an integer >= {least}" + (" (1 is the most urgent level)"
                                                                        if name == "priority" else ""))
        return int(value)
    try:
        rate = float(value)
    except ValueError:
        rate = math.nan
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError("rate must be a number of requests per second > 0")
    return rate


def key_entry(line: str, where: str) -> KeyEntry:
    """The KeyEntry of a key file's line (`where`: "the key file F, line N"); a bad field is a ValueError naming
    `where` and the field (never the key)."""
    key, *fields = line.split()
    values: dict[str, str | int | float] = {}
    for i, text in enumerate(fields, start=2):
        name, eq, value = text.partition("=")
        if not eq or name not in FIELDS:
            # Unknown text is not echoed: it may be the rest of a key that held whitespace.
            shown = f"field {name!r}" if eq and re.fullmatch(r"[a-z_]{1,20}", name) else f"field {i}"
            raise ValueError(f"{where}, {shown}: not one of {', '.join(f + '=' for f in FIELDS)} (a key holds no "
                             f"whitespace)")
        if name in values:
            raise ValueError(f"{where}, field {name!r}: given twice")
        try:
            values[name] = _field_value(name, value)
        except ValueError as e:
            raise ValueError(f"{where}, field {text!r}: {e}") from None
    if "burst" in values and "rate" not in values:
        raise ValueError(f"{where}, field 'burst={values['burst']}': burst needs rate= (requests per second)")
    hashed = key_hash(key)
    rate = values.get("rate")
    burst = values.get("burst", None if rate is None else max(1, math.ceil(rate)))
    priority = values.get("priority")
    return KeyEntry(hashed, str(values.get("name", default_name(hashed))), None if priority is None else int(priority),
                    None if rate is None else float(rate), None if burst is None else int(burst))


def read_key_file(path: str) -> list[KeyEntry]:
    """The keys of a file, one a line with its fields (`key_entry`); blank lines and # comments skipped. ValueError
    naming the file (and the line: a bad field, the same key twice)."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the key file {path}: {e}") from e
    entries: list[KeyEntry] = []
    seen: dict[str, int] = {}
    for n, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        entry = key_entry(line, f"the key file {path}, line {n}")
        if entry.hash in seen:
            raise ValueError(f"the key file {path}, line {n}: the same key as line {seen[entry.hash]}")
        seen[entry.hash] = n
        entries.append(entry)
    if not entries:
        raise ValueError(f"the key file {path} holds no key")
    return entries


def file_stamp(path: str) -> tuple[int, int, int, int] | None:
    """What tells that a key file changed: its device, inode (a file renamed over it), mtime (ns) and size; None
    when it cannot be looked at."""
    try:
        st = Path(path).stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size
