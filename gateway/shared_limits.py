"""The client limits shared by every gateway process through Redis (ABPLAT_GATEWAY_LIMITS_URL).

Without it each worker process keeps its own buckets and counts (gateway/limits.py,
``ProcessLimits``), so N processes behind a load balancer give every tenant N times its limits.
With it:

1. One Lua script (EVALSHA on one pipelined connection per process, gateway/redis_pipe.py;
   loaded once, again only if Redis lost it) checks and charges a
   request atomically: the tenant's requests in flight, the tenant's bucket, the user's bucket,
   and charges all three only when all let the request go. Time is Redis's own (``TIME``), so
   hosts whose clocks disagree share one clock. A bucket is a hash (tokens, at) that expires once
   it would be full again: an idle bucket is the same as a missing one, and vanishes.
2. Requests in flight are a sorted set per tenant: one member per request, scored by the end
   of its lease (``LEASE_S``). The request's end removes it; while it runs, its process renews
   the leases of all it holds every ``LEASE_S / 3`` seconds. A process that is killed renews
   nothing, so its slots come back within ``LEASE_S``.
3. Redis slow or down: every call has a short deadline (ABPLAT_GATEWAY_LIMITS_TIMEOUT_MS, 50 ms
   by default). Past it, or on any Redis error, the request is checked by this process's own
   limits instead (``ProcessLimits``: the same rates, burst and cap, counted here alone): the
   limits fail open to what one process without Redis enforces, never to no limit, and a Redis
   outage never becomes a gateway outage. After a failure Redis is left alone for ``DOWN_S``
   (every request would otherwise wait out the deadline). Each such request is counted in
   ``abplat_gateway_limit_fallback_requests_total{reason}`` (timeout, error, down).

Keys: ``PREFIX:{TENANT}:...``, the tenant in braces so that one request's keys share a Redis
Cluster slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from typing import Any

from gateway.limits import Admission, ProcessLimits, Refused
from gateway.redis_pipe import RedisPipe

log = logging.getLogger(__name__)

LEASE_S = 30.0  # a request's slot in flight, renewed while it runs
DOWN_S = 1.0  # after a failed call, this process's limits alone for this long
PREFIX = "abplat-gw-limits"
_LIMITS = ("", "streams", "tenant", "user")  # the script's answer codes

# KEYS: tenant bucket, user bucket, tenant's in-flight set.
# ARGV: now ("" = Redis TIME), tenant rate, tenant burst, user rate, user burst, cap, holder, lease s.
# Returns {code, microseconds to wait}: 0 let through (charged), 1 streams, 2 tenant, 3 user.
ADMIT = """
local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
else
  now = tonumber(ARGV[1])
end
local cap = tonumber(ARGV[6])
if cap > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= cap then return {1, 1000000} end
end
local function level(key, rate, burst)
  local v = redis.call('HMGET', key, 'tokens', 'at')
  if not v[1] then return burst end
  local dt = now - tonumber(v[2])
  if dt < 0 then dt = 0 end
  return math.min(burst, tonumber(v[1]) + dt * rate)
end
local tr, tb = tonumber(ARGV[2]), tonumber(ARGV[3])
local ur, ub = tonumber(ARGV[4]), tonumber(ARGV[5])
local tt, ut = 0, 0
if tr > 0 then
  tt = level(KEYS[1], tr, tb)
  if tt < 1 then return {2, math.ceil((1 - tt) / tr * 1000000)} end
end
if ur > 0 then
  ut = level(KEYS[2], ur, ub)
  if ut < 1 then return {3, math.ceil((1 - ut) / ur * 1000000)} end
end
local function charge(key, tokens, rate, burst)
  redis.call('HSET', key, 'tokens', string.format('%.17g', tokens - 1), 'at', string.format('%.6f', now))
  redis.call('PEXPIRE', key, math.ceil((burst / rate + 1) * 1000))
end
if tr > 0 then charge(KEYS[1], tt, tr, tb) end
if ur > 0 then charge(KEYS[2], ut, ur, ub) end
if cap > 0 then
  local lease = tonumber(ARGV[8])
  redis.call('ZADD', KEYS[3], string.format('%.6f', now + lease), ARGV[7])
  redis.call('PEXPIRE', KEYS[3], math.ceil((lease + 1) * 1000))
end
return {0, 0}
"""

# KEYS: in-flight sets; ARGV[1]: lease s, ARGV[i + 1]: the holder in KEYS[i]. Only members still
# there (XX): one released or expired meanwhile is not brought back.
RENEW = """
local t = redis.call('TIME')
local lease = tonumber(ARGV[1])
local until_ = string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1000000 + lease)
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, 'XX', until_, ARGV[i + 1])
  redis.call('PEXPIRE', key, math.ceil((lease + 1) * 1000))
end
return #KEYS
"""
ADMIT_SHA, RENEW_SHA = (hashlib.sha1(s.encode()).hexdigest() for s in (ADMIT, RENEW))


def limits_client(url: str) -> RedisPipe:
    """The Redis connection of the shared limits: asynchronous, so a request waiting on Redis
    never blocks the event loop, and pipelined (gateway/redis_pipe.py says why not redis-py's
    asyncio client). It connects on the event loop that first uses it. (The web's Django caches
    reach the same Redis through abplat/caches.py; the gateway, below abplat in the layers,
    cannot import it.)"""
    return RedisPipe(url)


class SharedLimits:
    """The limits of ``local`` (its rates, bursts and cap), counted in Redis for every process
    that uses the same ``client`` and ``prefix``; ``local`` itself is the fallback."""

    def __init__(
        self,
        client: RedisPipe,
        local: ProcessLimits,
        *,
        timeout_s: float = 0.05,
        prefix: str = PREFIX,
        fallback: Any = None,
        lease_s: float = LEASE_S,
    ) -> None:
        """client: ``limits_client(url)``; fallback(reason):
        called once per request checked by ``local`` instead (the metric)."""
        self.client = client
        self.local = local
        self.timeout_s = timeout_s
        self.prefix = prefix
        self.lease_s = lease_s
        self._fallback = fallback or (lambda reason: None)
        users, tenants = local.users, local.tenants
        self._args = (  # (an empty TokenBuckets is falsy: `is None`)
            0 if tenants is None else tenants.rate,
            0 if tenants is None else tenants.burst,
            0 if users is None else users.rate,
            0 if users is None else users.burst,
            local.cap,
        )
        self._down_until = 0.0
        self.held: dict[str, str] = {}  # holder -> its in-flight set: what this process renews
        self._renewer: asyncio.Task | None = None

    def keys(self, tenant: str, user_key: str) -> list[str]:
        base = f"{self.prefix}:{{{tenant}}}"
        return [f"{base}:rate", f"{base}:user:{user_key}", f"{base}:flight"]

    async def admit(self, tenant: str, user: str, *, now: float | None = None) -> Admission | Refused:
        """Check and charge one request of ``tenant`` from ``user``; ``now`` replaces Redis's
        clock (tests only)."""
        if time.monotonic() < self._down_until:
            return self._locally("down", tenant, user)
        holder = uuid.uuid4().hex if self.local.cap else ""
        keys = self.keys(tenant, user)
        args = ("" if now is None else repr(now), *self._args, holder, self.lease_s)
        try:
            async with asyncio.timeout(self.timeout_s):
                code, wait_us = await self.client.evalsha(ADMIT_SHA, ADMIT, keys, args)  # type: ignore[misc]
        except TimeoutError:
            return self._failed("timeout", tenant, user)
        except Exception as exc:  # noqa: BLE001 - any Redis failure: this process's limits
            return self._failed("error", tenant, user, exc)
        if self._down_until:
            self._down_until = 0.0  # Redis answers again
        if code:
            return Refused(_LIMITS[code], wait_us / 1e6)
        if holder:
            self.held[holder] = keys[2]
        return Admission(tenant, holder)

    def _failed(
        self, reason: str, tenant: str, user: str, exc: Exception | None = None
    ) -> Admission | Refused:
        if self._down_until == 0.0:  # the first of a run of failures
            log.warning(
                "gateway: the shared limits' Redis failed (%s%s): this process's own limits for now",
                reason,
                f": {exc!r}" if exc is not None else "",
            )
        self._down_until = time.monotonic() + DOWN_S
        return self._locally(reason, tenant, user)

    def _locally(self, reason: str, tenant: str, user: str) -> Admission | Refused:
        self._fallback(reason)
        return self.local.admit(tenant, user, time.monotonic())

    async def release(self, admission: Admission) -> None:
        """The request ended (or its client went away): its slot in flight back. Nothing waits
        for Redis here; a release that does not reach it is ended by the lease (``lease_s``)."""
        holder = admission.holder
        if not holder:
            self.local.release(admission.tenant)
            return
        key = self.held.pop(holder, None)
        if key is None or time.monotonic() < self._down_until:
            return  # (Redis just failed: its lease ends it, no deadline waited out here)
        # Written, not waited for: the response is already out, and nothing here needs the
        # answer. If it is lost (no connection), the lease ends the slot.
        self.client.send("ZREM", key, holder)

    # leases -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Renew the leases of the requests this process holds (call on the event loop)."""
        if self.local.cap and self._renewer is None:
            self._renewer = asyncio.get_running_loop().create_task(self._renew_loop())

    async def renew(self) -> None:
        if not self.held:
            return
        holders = list(self.held.items())
        async with asyncio.timeout(max(1.0, self.timeout_s)):
            await self.client.evalsha(
                RENEW_SHA, RENEW, [k for _, k in holders], (self.lease_s, *(h for h, _ in holders))
            )

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                await self.renew()
            except Exception as exc:  # noqa: BLE001 - tried again next time; the lease is 3x this
                log.warning("gateway: renewing the shared in-flight leases failed: %r", exc)

    async def aclose(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
            self._renewer = None
        with contextlib.suppress(Exception):
            await self.client.aclose()
