"""Client limits of the gateway (pure): token buckets (per user, per tenant), the tenants' API
keys, and how deeply a request body nests.

No I/O: the caller passes the clock reading and the key file's text.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass


class TokenBuckets:
    """One token bucket per key: ``rate`` tokens a second, holding at most ``burst``.

    ``take(key, now)`` returns 0.0 when the request may go, else the seconds until it could.
    Memory is bounded: past ``max_keys`` the buckets that have refilled completely (the same as
    a new one) are dropped, then the oldest."""

    __slots__ = ("rate", "burst", "max_keys", "_buckets")

    def __init__(self, rate: float, burst: int, max_keys: int = 100_000) -> None:
        if not rate > 0:
            raise ValueError(f"rate={rate!r}: must be positive")
        if burst < 1:
            raise ValueError(f"burst={burst!r}: must be at least 1")
        self.rate = float(rate)
        self.burst = float(burst)
        self.max_keys = max_keys
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, key: str, now: float) -> float:
        tokens, at = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + max(0.0, now - at) * self.rate)
        if tokens >= 1.0:
            self._buckets[key] = (tokens - 1.0, now)  # re-inserted: dict order is last use
            if len(self._buckets) > self.max_keys:
                self._prune(now)
            return 0.0
        self._buckets[key] = (tokens, now)
        return (1.0 - tokens) / self.rate

    def _prune(self, now: float) -> None:
        full_after = self.burst / self.rate
        for key in [k for k, (_, at) in self._buckets.items() if now - at >= full_after]:
            del self._buckets[key]
        while len(self._buckets) > self.max_keys:
            del self._buckets[next(iter(self._buckets))]  # least recently used


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """API key digests -> tenant. The keys themselves are not kept."""

    tenants: Mapping[bytes, str]

    def tenant(self, key: str) -> str | None:
        # A dict lookup by digest: no comparison of the secret itself that could leak by timing.
        tenant = self.tenants.get(_digest(key))
        if tenant is None:
            hmac.compare_digest(b"x" * 32, b"y" * 32)  # about the same work for a miss
        return tenant

    def __len__(self) -> int:
        return len(self.tenants)


def parse_keys(text: str, setting: str = "ABPLAT_GATEWAY_KEYS_FILE") -> ApiKeys:
    """One ``TENANT KEY`` a line; blank lines and ``#`` comments skipped. ValueError naming the
    setting and line (never the key)."""
    tenants: dict[bytes, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{setting} line {number}: use 'TENANT KEY' (two words)")
        tenant, key = parts
        if len(tenant) > 64 or not tenant.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"{setting} line {number}: the tenant is letters, digits, - and _ (at most 64)")
        if len(key) < 16 or not key.isascii() or not key.isprintable():
            raise ValueError(
                f"{setting} line {number}: the key must be at least 16 printable ASCII characters"
            )
        digest = _digest(key)
        if digest in tenants:
            raise ValueError(f"{setting} line {number}: this key is listed twice")
        tenants[digest] = tenant
    return ApiKeys(tenants)


def json_depth(value: object, limit: int) -> int:
    """How deeply objects and arrays nest in a parsed JSON value (a scalar: 0), counting no
    further than ``limit + 1``. Iterative: a hostile body cannot exhaust the stack here, and
    the walk stops as soon as the limit is passed."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        depth += 1
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                return deepest
        stack.extend((c, depth) for c in children if isinstance(c, dict | list))
    return deepest
