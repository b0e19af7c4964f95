"""Client limits of the gateway (pure): token buckets (per user, per tenant) and the tenants'
requests in flight as this process counts them, the tenants' API keys, and how deeply a request
body nests.

No I/O: the caller passes the clock reading and the key file's text.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass


class TokenBuckets:
    """One token bucket per key: ``rate`` tokens a second, holding at most ``burst``.

    ``take(key, now)`` returns 0.0 when the request may go, else the seconds until it could;
    ``wait(key, now)`` says the same without taking. Memory is bounded: past ``max_keys`` the
    least recently used buckets are dropped, one per new key (the dict is kept in last-use
    order, so that is its front: O(1), where a scan of every bucket for the full ones cost a
    new key past the bound milliseconds of the event loop). A bucket dropped while not yet full
    comes back full: with ``max_keys`` above the keys seen within ``burst / rate`` seconds none is."""

    __slots__ = ("rate", "burst", "max_keys", "_buckets")

    def __init__(self, rate: float, burst: int, max_keys: int = 100_000) -> None:
        if not rate > 0:
            raise ValueError(f"rate={rate!r}: must be positive")
        if burst < 1:
            raise ValueError(f"burst={burst!r}: must be at least 1")
        if max_keys < 1:
            raise ValueError(f"max_keys={max_keys!r}: must be at least 1")
        self.rate = float(rate)
        self.burst = float(burst)
        self.max_keys = max_keys
        # key -> (tokens, at); an OrderedDict: popping its front is O(1), where a dict's first
        # key after many deletions at the front is a walk over their empty slots.
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def _level(self, key: str, now: float) -> float:
        got = self._buckets.get(key)
        if got is None:
            return self.burst
        tokens, at = got
        return min(self.burst, tokens + max(0.0, now - at) * self.rate)

    def wait(self, key: str, now: float) -> float:
        tokens = self._level(key, now)
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate

    def take(self, key: str, now: float) -> float:
        tokens = self._level(key, now)
        buckets = self._buckets
        taken = tokens >= 1.0
        buckets[key] = (tokens - 1.0 if taken else tokens, now)
        buckets.move_to_end(key)  # last use at the back
        if len(buckets) > self.max_keys:
            buckets.popitem(last=False)  # least recently used
        return 0.0 if taken else (1.0 - tokens) / self.rate


@dataclass(frozen=True, slots=True)
class Refused:
    """Why a request may not go now: ``limit`` is ``streams`` (the tenant's requests in
    flight), ``tenant`` or ``user`` (their rates); ``retry_after_s`` until it could."""

    limit: str
    retry_after_s: float


@dataclass(frozen=True, slots=True)
class Admission:
    """A request let through: its tenant, and ``holder``, its entry in the shared count of
    requests in flight ("" when this process counted it)."""

    tenant: str
    holder: str = ""


class ProcessLimits:
    """The client limits kept in this process (the embedded default, and the fallback of the
    shared ones, gateway/shared_limits.py): the tenant's rate, the user's rate and the tenant's
    requests in flight, checked together and charged only when all three let the request go.
    A rate of 0 or a cap of 0 is no limit."""

    __slots__ = ("users", "tenants", "cap", "active")

    def __init__(
        self,
        *,
        user_rate: float = 0,
        user_burst: int = 20,
        tenant_rate: float = 0,
        tenant_burst: int = 100,
        tenant_streams: int = 0,
        max_keys: int = 100_000,
    ) -> None:
        self.users = TokenBuckets(user_rate, user_burst, max_keys) if user_rate else None
        self.tenants = TokenBuckets(tenant_rate, tenant_burst) if tenant_rate else None
        self.cap = tenant_streams
        self.active: Counter[str] = Counter()  # requests in flight per tenant

    def admit(self, tenant: str, user: str, now: float) -> Admission | Refused:
        user_key = f"{tenant}\0{user}"  # a user id is the tenant's own
        cap = self.cap
        if cap and self.active[tenant] >= cap:
            return Refused("streams", 1.0)
        if self.tenants is not None and (wait := self.tenants.wait(tenant, now)) > 0:
            return Refused("tenant", wait)
        if self.users is not None and (wait := self.users.wait(user_key, now)) > 0:
            return Refused("user", wait)
        if self.tenants is not None:
            self.tenants.take(tenant, now)
        if self.users is not None:
            self.users.take(user_key, now)
        self.active[tenant] += 1
        return Admission(tenant)

    def release(self, tenant: str) -> None:
        left = self.active[tenant] - 1
        if left > 0:
            self.active[tenant] = left
        else:
            del self.active[tenant]


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
