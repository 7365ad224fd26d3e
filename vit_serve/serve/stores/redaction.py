"""Store URLs without their passwords (`redacted`), for logs, errors and the settings' repr."""

from __future__ import annotations

import re
from urllib.parse import parse_qs, unquote_plus, urlsplit

# A URL's user:password@ (up to the authority's last @, as urlsplit reads it) and a query's name=value pairs.
_USERINFO = re.compile(r"(?P<scheme>\b[a-z][a-z0-9+.-]*://)(?P<info>[^\s/?#]*)@", re.IGNORECASE)
_QUERY_PAIR = re.compile(r"(?P<name>[?&;](?P<key>[^=&#;?\s'\"]*)=)[^&#;\s'\"]*")
# Query parameters whose value is a secret, by name once percent-decoded, case-folded and without - and _
# (`?pass%77ord=`, `?Api-Key=` and `?ACCESS_TOKEN=` are all caught: parsers decode names before they read them).
SECRET_NAMES = frozenset({"password", "passwd", "pass", "pwd", "secret", "token", "key", "apikey", "xapikey",
                          "accesstoken", "refreshtoken", "authtoken", "idtoken", "sessiontoken", "clientsecret",
                          "auth", "authorization", "credential", "credentials", "signature", "sig"})


def secret_name(name: str) -> bool:
    """Whether a query parameter named `name` (as sent: percent-encoded, any case) holds a secret."""
    plain = unquote_plus(name).casefold()
    return plain.replace("-", "").replace("_", "").strip() in SECRET_NAMES


def redacted(text: str) -> str:
    """`text` (a URL, or a message with URLs in it) without secrets: `user:password@` becomes `user:***@` and the
    value of a query parameter whose name is a secret's (`SECRET_NAMES`: password, token, key, ...), however it is
    percent-encoded or cased, becomes `***` (`?pass%77ord=***`: redis-py decodes the name and reads it as the
    password); for logs, errors and the settings' repr."""
    def userinfo(m: re.Match[str]) -> str:
        user, colon, _ = m["info"].partition(":")
        return f"{m['scheme']}{user}:***@" if colon else m[0]

    def pair(m: re.Match[str]) -> str:
        return m["name"] + "***" if secret_name(m["key"]) else m[0]

    return _QUERY_PAIR.sub(pair, _USERINFO.sub(userinfo, text))


def url_has_password(url: str) -> bool:
    """Whether the URL carries a password (user:password@ or ?password=)."""
    parts = urlsplit(url)
    return parts.password is not None or "password" in parse_qs(parts.query)
