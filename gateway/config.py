"""The gateway's configuration, from the ABPLAT_GATEWAY_* settings, checked at start.

abplat/config.py parses each variable's type; what needs more (the keys file, the routes,
the header names) is checked here when the gateway starts, and a bad value stops it with
``ImproperlyConfigured`` naming the setting. Other processes never read these.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from gateway.limits import ApiKeys, parse_keys
from gateway.routing import Reach, Routes, parse_reach, parse_retry_on_control, parse_routes
from gateway.upstream import Deadlines

_HEADER_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
# Headers the gateway sets itself towards the variant: never taken from the client.
_OWN_HEADERS = {
    "authorization",
    "host",
    "content-length",
    "content-type",
    "x-request-id",
    "traceparent",
    "connection",
    "transfer-encoding",
    "te",
    "upgrade",
    "keep-alive",
    "proxy-authorization",
}


@dataclass(frozen=True)
class GatewayConfig:
    keys: ApiKeys | None  # None: no client auth (ABPLAT_GATEWAY_AUTH=none)
    routes: Routes = field(default_factory=lambda: Routes({}, ()))
    user_header: str = ""
    retry_on_control: frozenset[str] = frozenset()
    forward_headers: frozenset[str] = frozenset()
    max_body_bytes: int = 4 * 1024 * 1024
    user_rate: int = 0
    user_burst: int = 20
    reach: Reach = field(default_factory=lambda: Reach({}))
    tenant_rate: int = 0
    tenant_burst: int = 100
    tenant_streams: int = 0  # concurrent requests per tenant; 0: no limit
    limits_url: str = ""  # Redis shared by every gateway process for the limits; "": per process
    limits_timeout_s: float = 0.05  # each call to it, before this process counts alone
    limits_prefix: str = "abplat-gw-limits"  # its keys' prefix (tests: one of their own)
    body_timeout_s: float = 30.0
    deadlines: Deadlines = field(default_factory=Deadlines)
    drain_s: int = 30
    variants_refresh_s: int = 5
    shadows_in_flight: int = 8  # shadows to the control at once per process (gateway/shadow.py)

    def retries(self, experiment: str) -> bool:
        return "*" in self.retry_on_control or experiment in self.retry_on_control

    @classmethod
    def from_settings(cls) -> GatewayConfig:
        s = settings
        keys: ApiKeys | None = None
        if s.GATEWAY_AUTH == "keys":
            if not s.GATEWAY_KEYS_FILE:
                raise ImproperlyConfigured(
                    "ABPLAT_GATEWAY_KEYS_FILE is not set: with ABPLAT_GATEWAY_AUTH=keys (the default) the "
                    "gateway needs the file of its clients' API keys ('TENANT KEY' a line); "
                    "ABPLAT_GATEWAY_AUTH=none turns client auth off (development only)."
                )
            try:
                with open(s.GATEWAY_KEYS_FILE, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as exc:
                raise ImproperlyConfigured(
                    f"Unexpected value ABPLAT_GATEWAY_KEYS_FILE={s.GATEWAY_KEYS_FILE!r}: cannot read it ({exc})."
                ) from None
            try:
                keys = parse_keys(text)
            except ValueError as exc:
                raise ImproperlyConfigured(str(exc)) from None
            if not len(keys):
                raise ImproperlyConfigured(
                    f"ABPLAT_GATEWAY_KEYS_FILE={s.GATEWAY_KEYS_FILE!r} lists no key: nobody could use the gateway."
                )
        header = s.GATEWAY_USER_HEADER
        if header and (not _HEADER_RE.match(header) or header in _OWN_HEADERS):
            raise ImproperlyConfigured(
                f"Unexpected value ABPLAT_GATEWAY_USER_HEADER={header!r}: a header name (letters, digits, -) "
                "other than the ones the gateway sets."
            )
        forward = set()
        for name in s.GATEWAY_FORWARD_HEADERS:
            name = name.lower()
            if not _HEADER_RE.match(name) or name in _OWN_HEADERS:
                raise ImproperlyConfigured(
                    f"Unexpected value ABPLAT_GATEWAY_FORWARD_HEADERS item {name!r}: a header name "
                    "(letters, digits, -) other than the ones the gateway sets."
                )
            forward.add(name)
        try:
            routes = parse_routes(s.GATEWAY_ROUTES, s.GATEWAY_DEFAULT_EXPERIMENT)
            retry = parse_retry_on_control(s.GATEWAY_RETRY_ON_CONTROL)
            reach = parse_reach(s.GATEWAY_REACH)
        except ValueError as exc:
            raise ImproperlyConfigured(str(exc)) from None
        if s.GATEWAY_HEADERS_TIMEOUT_S > s.GATEWAY_TOTAL_TIMEOUT_S:
            raise ImproperlyConfigured(
                f"ABPLAT_GATEWAY_HEADERS_TIMEOUT_S={s.GATEWAY_HEADERS_TIMEOUT_S} is longer than "
                f"ABPLAT_GATEWAY_TOTAL_TIMEOUT_S={s.GATEWAY_TOTAL_TIMEOUT_S}."
            )
        return cls(
            keys=keys,
            routes=routes,
            user_header=header,
            retry_on_control=retry,
            forward_headers=frozenset(forward),
            max_body_bytes=s.GATEWAY_MAX_BODY_BYTES,
            user_rate=s.GATEWAY_USER_RATE,
            user_burst=s.GATEWAY_USER_BURST,
            reach=reach,
            tenant_rate=s.GATEWAY_TENANT_RATE,
            tenant_burst=s.GATEWAY_TENANT_BURST,
            tenant_streams=s.GATEWAY_TENANT_STREAMS,
            limits_url=s.GATEWAY_LIMITS_URL,
            limits_timeout_s=s.GATEWAY_LIMITS_TIMEOUT_MS / 1000,
            body_timeout_s=s.GATEWAY_BODY_TIMEOUT_S,
            deadlines=Deadlines(
                connect_s=s.GATEWAY_CONNECT_TIMEOUT_S,
                headers_s=s.GATEWAY_HEADERS_TIMEOUT_S,
                stall_s=s.GATEWAY_STALL_TIMEOUT_S,
                total_s=s.GATEWAY_TOTAL_TIMEOUT_S,
            ),
            drain_s=s.GATEWAY_DRAIN_S,
            variants_refresh_s=s.GATEWAY_VARIANTS_REFRESH_S,
            shadows_in_flight=s.GATEWAY_SHADOWS_IN_FLIGHT,
        )
