"""Image URLs (`http(s)://`) a request names, fetched by the gateway only where the operator allows it: the hosts of
`image_url_hosts` (off when empty, the default), at most `image_url_max_bytes` (413 beyond), within
`image_url_timeout_s` for the whole fetch (DNS, redirects and body).

Fetching for a caller is a server-side request forgery door, so a host allowed by name is not trusted by name:
each hop's host is resolved and every address it resolves to is checked (`UrlPolicy.refusal`): loopback
(127.0.0.0/8, ::1), link-local (169.254.0.0/16, fe80::/10: the cloud metadata service among them), private
(10/8, 172.16/12, 192.168/16, fc00::/7), unspecified (0.0.0.0, ::) and anything else not public are refused
unless `image_url_networks` names them (an image store on the cluster's own network). The connection goes to the
address that was checked (no second lookup an attacker's DNS could answer differently), the Host header and TLS
name being the URL's host. Redirects are followed by hand, at most `MAX_REDIRECTS`, each checked as the first URL.
No proxy from the environment is used, no credentials in a URL are accepted and no cookies are kept.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urljoin, urlsplit

from vit_serve.serve.errors import BadRequestError, TooLargeError

if TYPE_CHECKING:
    from vit_serve.serve.settings import SecuritySettings

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], Awaitable[list[str]]]

MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)
# Named in the refusal; anything else that is not a public address is refused as "not public".
REFUSED: tuple[tuple[str, str], ...] = (
    ("0.0.0.0/8", "unspecified"), ("::/128", "unspecified"), ("127.0.0.0/8", "loopback"), ("::1/128", "loopback"),
    ("169.254.0.0/16", "link-local"), ("fe80::/10", "link-local"), ("10.0.0.0/8", "private"),
    ("172.16.0.0/12", "private"), ("192.168.0.0/16", "private"), ("fc00::/7", "private"),
    ("100.64.0.0/10", "shared (carrier-grade NAT)"))
_REFUSED = tuple((ipaddress.ip_network(n), what) for n, what in REFUSED)


class UrlRefusedError(BadRequestError):
    """An image URL the gateway will not fetch, or whose fetch failed (400)."""


@dataclass(frozen=True)
class UrlPolicy:
    """What may be fetched: `hosts` (lowercase; `*.example.com` its subdomains; empty: nothing), the extra
    `networks` an allowed host may resolve to, the size cap and the timeout of one fetch."""

    hosts: tuple[str, ...] = ()
    networks: tuple[Network, ...] = ()
    max_bytes: int = 8 * 2**20
    timeout_s: float = 5.0

    @classmethod
    def of(cls, s: SecuritySettings) -> UrlPolicy:
        return cls(tuple(s.image_url_hosts), tuple(ipaddress.ip_network(n) for n in s.image_url_networks),
                   s.image_url_max_bytes, s.image_url_timeout_s)

    @property
    def on(self) -> bool:
        return bool(self.hosts)

    def allows_host(self, host: str) -> bool:
        """Whether `host` (lowercase, no trailing dot) is allowed by name."""
        return any(host == h or (h.startswith("*.") and host.endswith(h[1:])) for h in self.hosts)

    def refusal(self, address: Address) -> str | None:
        """Why a connection to `address` is refused (None: it is allowed): the range it lies in, unless
        `networks` names it."""
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
        if any(address in n for n in self.networks):
            return None
        for network, what in _REFUSED:
            if address.version == network.version and address in network:
                return f"{address} is a {what} address ({network})"
        if not address.is_global or address.is_multicast:
            return f"{address} is not a public address"
        return None


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to (the system's resolver, as a connection would use)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


async def fetch(url: str, policy: UrlPolicy, what: str = "the image URL", resolve: Resolver = system_resolver
                ) -> bytes:
    """The body of `url` under `policy` (`what` names it in errors): 400 (`UrlRefusedError`) for a URL it does not
    allow, a refused address, a failed or slow fetch, a status other than 200; 413 beyond the size cap."""
    if not policy.on:
        raise UrlRefusedError(f"{what}: this gateway fetches no image URLs (image_url_hosts is empty); send the "
                              f"image itself, base64 or as a data: URI")
    import httpx

    try:
        async with asyncio.timeout(policy.timeout_s), httpx.AsyncClient(
                follow_redirects=False, trust_env=False, timeout=policy.timeout_s) as client:
            for _ in range(MAX_REDIRECTS + 1):
                target, headers, sni = await _checked(url, policy, what, resolve)
                extensions = {"sni_hostname": sni} if sni else {}
                async with client.stream("GET", target, headers=headers, extensions=extensions) as r:
                    if r.status_code in REDIRECTS and "location" in r.headers:
                        url = urljoin(url, r.headers["location"])
                        continue
                    if r.status_code != 200:
                        raise UrlRefusedError(f"{what}: its server answered HTTP {r.status_code}")
                    return await _body(r, policy.max_bytes, what)
    except TimeoutError:
        raise UrlRefusedError(f"{what}: not fetched within {policy.timeout_s:g} s (image_url_timeout_s)") from None
    except httpx.HTTPError as e:
        raise UrlRefusedError(f"{what}: the fetch failed ({type(e).__name__})") from None
    raise UrlRefusedError(f"{what}: more than {MAX_REDIRECTS} redirects")


async def _checked(url: str, policy: UrlPolicy, what: str, resolve: Resolver
                   ) -> tuple[str, dict[str, str], str | None]:
    """(the URL to connect to, on the checked address; its headers (Host); the TLS name for https), or 400."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise UrlRefusedError(f"{what}: only http:// and https:// URLs are fetched")
    try:
        host, port = (parts.hostname or "").rstrip("."), parts.port or (443 if scheme == "https" else 80)
    except ValueError:
        raise UrlRefusedError(f"{what}: not a valid URL") from None
    if not host or parts.username is not None or parts.password is not None:
        raise UrlRefusedError(f"{what}: a URL with a host and without credentials is needed")
    if not policy.allows_host(host):
        raise UrlRefusedError(f"{what}: host {host!r} is not one this gateway fetches from (image_url_hosts)")
    try:
        found = [ipaddress.ip_address(a.split("%")[0]) for a in await resolve(host, port)]
    except (OSError, ValueError):
        raise UrlRefusedError(f"{what}: host {host!r} does not resolve") from None
    if not found:
        raise UrlRefusedError(f"{what}: host {host!r} does not resolve")
    for address in found:  # every address: a round-robin record cannot slip a private one in
        why = policy.refusal(address)
        if why is not None:
            raise UrlRefusedError(f"{what}: host {host!r} resolves to {why}, which is never fetched")
    pinned = f"[{found[0]}]" if found[0].version == 6 else str(found[0])
    target = parts._replace(scheme=scheme, netloc=f"{pinned}:{port}").geturl()
    default = port == (443 if scheme == "https" else 80)
    shown = f"[{host}]" if ":" in host else host
    headers = {"Host": shown if default else f"{shown}:{port}", "Accept": "image/*"}
    return target, headers, host if scheme == "https" else None


async def _body(r, limit: int, what: str) -> bytes:
    """The answer's body, at most `limit` bytes (413 beyond, said by Content-Length or counted)."""
    declared = r.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLargeError(f"{what}: {int(declared)} bytes, over the limit of {limit} (image_url_max_bytes)")
    parts, size = [], 0
    async for chunk in r.aiter_bytes():  # decoded as it comes: the cap holds for a compressed answer too
        size += len(chunk)
        if size > limit:
            raise TooLargeError(f"{what}: over the limit of {limit} bytes (image_url_max_bytes)")
        parts.append(chunk)
    return b"".join(parts)
