"""The client's address behind the TLS proxy (ABPLAT_TRUSTED_PROXIES, docs/deploy.md).

Behind a proxy every request comes from the proxy's address, so the per-address limits (admin
logins, anonymous API calls: abplat/api.py) and the /metrics address check would treat all
users as one. When the connection comes from a listed proxy, the client is the right-most
address of X-Forwarded-For that is not itself a listed proxy: each proxy appends the address it
was connected from, and only the entries our own proxies wrote can be believed (a client writes
whatever it likes to the left of them). Nothing listed (the default): REMOTE_ADDR is the peer,
and X-Forwarded-For is never read.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from django.conf import settings

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_proxies(items: Sequence[str], name: str = "ABPLAT_TRUSTED_PROXIES") -> tuple[Network, ...]:
    """Addresses or networks (CIDR); ValueError naming ``name`` and the item otherwise."""
    out = []
    for item in items:
        try:
            out.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(
                f"Unexpected value {name} item {item!r}: use IP addresses or networks "
                "(127.0.0.1, 10.0.0.0/8, ::1), comma-separated."
            ) from None
    return tuple(out)


def _listed(address: str, networks: Sequence[Network]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in net for net in networks)


def client_address(peer: str, forwarded_for: str, proxies: Sequence[Network]) -> str:
    """The client of a request that arrived from ``peer`` carrying ``forwarded_for``."""
    if not proxies or not _listed(peer, proxies):
        return peer
    client = peer
    for hop in reversed([h.strip() for h in forwarded_for.split(",")] if forwarded_for else []):
        try:
            ipaddress.ip_address(hop)
        except ValueError:
            break  # not an address a proxy of ours wrote: the last believed one stands
        client = hop
        if not _listed(hop, proxies):
            break
    return client


class TrustedProxyMiddleware:
    """REMOTE_ADDR becomes the client's address when the request came through a listed proxy
    (the proxy's own address is kept in META["abplat.proxy_addr"]).

    X-Forwarded-Proto (Django's SECURE_PROXY_SSL_HEADER with debug off) is believed only from a
    listed proxy: from anyone else it is dropped, so a client cannot claim TLS it did not use.
    Without it Django falls back to the server's own scheme, which gunicorn sets from the same
    header for the addresses in ABPLAT_WEB_FORWARDED_ALLOW_IPS (nginx on the same host by
    default: docs/deploy.md, "TLS in front")."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        proxies = settings.TRUSTED_PROXY_NETWORKS
        meta = request.META
        if "HTTP_X_FORWARDED_PROTO" in meta and not (
            proxies and _listed(meta.get("REMOTE_ADDR", ""), proxies)
        ):
            del meta["HTTP_X_FORWARDED_PROTO"]
        if proxies:
            peer = meta.get("REMOTE_ADDR", "")
            client = client_address(peer, meta.get("HTTP_X_FORWARDED_FOR", ""), proxies)
            if client != peer:
                meta["abplat.proxy_addr"] = peer
                meta["REMOTE_ADDR"] = client
        return self.get_response(request)
