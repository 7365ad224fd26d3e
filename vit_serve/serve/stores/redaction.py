"""Store URLs without their passwords (`redacted`), for logs, errors and the settings' repr."""

from __future__ import annotations

import re
from urllib.parse import parse_qs, urlsplit

# A URL's user:password@ (up to the authority's last @, as urlsplit reads it) and password-like query values.
_USERINFO = re.compile(r"(?P<scheme>\b[a-z][a-z0-9+.-]*://)(?P<info>[^\s/?#]*)@", re.IGNORECASE)
_QUERY_SECRET = re.compile(r"(?P<name>[?&;](?:password|passwd|pass|pwd)=)[^&#;\s'\"]*", re.IGNORECASE)


def redacted(text: str) -> str:
    """`text` (a URL, or a message with URLs in it) without passwords: `user:password@` becomes `user:***@` and
    `?password=...` becomes `?password=***` (redis-py reads both); for logs, errors and the settings' repr."""
    def userinfo(m: re.Match[str]) -> str:
        user, colon, _ = m["info"].partition(":")
        return f"{m['scheme']}{user}:***@" if colon else m[0]

    return _QUERY_SECRET.sub(lambda m: m["name"] + "***", _USERINFO.sub(userinfo, text))


def url_has_password(url: str) -> bool:
    """Whether the URL carries a password (user:password@ or ?password=)."""
    parts = urlsplit(url)
    return parts.password is not None or "password" in parse_qs(parts.query)
