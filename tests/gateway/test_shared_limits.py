"""The client limits shared through Redis (ABPLAT_GATEWAY_LIMITS_URL, gateway/shared_limits.py):
the script's bucket arithmetic on an injected clock, the in-flight slots and their leases, two
gateways that share nothing but Redis holding a tenant to its one rate, and a Redis that is down
or hangs costing the limits their sharing, never the requests (counted in /metrics)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis

from gateway.limits import Admission, ProcessLimits, Refused
from gateway.shared_limits import LEASE_S, SharedLimits, limits_client
from telemetry import metrics
from tests.gateway.conftest import KEY, OTHER_KEY, dead_port
from tests.workers.background import wait_for

pytestmark = pytest.mark.services

REDIS_URL = os.environ.get("ABPLAT_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
MESSAGES = [{"role": "user", "content": "Hi"}]
AUTH = {"authorization": f"Bearer {KEY}"}
FALLBACKS = "abplat_gateway_limit_fallback_requests_total"


@pytest.fixture
def prefix():
    """A key prefix of this test's own in the test Redis database; a failed test (never a skip)
    when Redis is not there."""
    r = redis.Redis.from_url(REDIS_URL, socket_timeout=2)
    try:
        r.ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis not reachable at {REDIS_URL} (ABPLAT_TEST_REDIS_URL): {exc}", pytrace=False)
    name = f"test-limits-{uuid.uuid4().hex[:10]}"
    yield name
    for key in r.scan_iter(f"{name}:*"):
        r.delete(key)


def fallbacks(reason: str) -> float:
    return metrics.REGISTRY.get_sample_value(FALLBACKS, {"reason": reason}) or 0.0


def run(make_and_use):
    """asyncio.run of ``make_and_use(client)`` with a fresh redis.asyncio client (bound to that loop)."""

    async def go():
        client = limits_client(REDIS_URL)
        try:
            return await make_and_use(client)
        finally:
            await client.aclose()

    return asyncio.run(go())


def shared(client, prefix, url=None, **limits) -> SharedLimits:
    return SharedLimits(client, ProcessLimits(**limits), timeout_s=2.0, prefix=prefix)


def test_the_script_gives_the_burst_then_the_rate_on_its_clock(prefix):
    async def use(client):
        lim = shared(client, prefix, tenant_rate=2, tenant_burst=3)
        t = 1000.0
        got = [await lim.admit("acme", "u", now=t) for _ in range(4)]
        assert [isinstance(g, Admission) for g in got] == [True, True, True, False]
        assert got[3] == Refused("tenant", pytest.approx(0.5))  # one token in 1/rate
        assert got[3].retry_after_s == pytest.approx(0.5, abs=1e-6)
        late = await lim.admit("acme", "u", now=t + 0.25)
        assert late == Refused("tenant", pytest.approx(0.25, abs=1e-6))
        assert isinstance(await lim.admit("acme", "u", now=t + 0.5), Admission)  # exactly one back
        assert isinstance(await lim.admit("acme", "u", now=t + 0.5), Refused)
        assert isinstance(await lim.admit("beta", "u", now=t + 0.5), Admission)  # per tenant
        # long idle: full again, never above the burst
        got = [await lim.admit("acme", "u", now=t + 100) for _ in range(4)]
        assert [isinstance(g, Admission) for g in got] == [True, True, True, False]
        return await client.call("PTTL", lim.keys("acme", "u")[0])

    ttl_ms = run(use)
    assert 0 < ttl_ms <= (3 / 2 + 1) * 1000  # gone once it would be full again


def test_on_redis_time_a_bucket_refills_at_its_rate_and_the_user_and_tenant_are_charged_together(prefix):
    async def use(client):
        # the tenant refills a token per 100 ms: the three calls below take far less, where at
        # 1,000 a second a millisecond's pause on a busy host gave one back before it was read
        lim = shared(client, prefix, tenant_rate=10, tenant_burst=2, user_rate=1, user_burst=1)
        assert isinstance(await lim.admit("acme", "u1"), Admission)
        refused = await lim.admit("acme", "u1")  # the user's, not the tenant's
        assert refused.limit == "user" and 0.9 < refused.retry_after_s <= 1.0
        # the user's refusal took none of the tenant's tokens: two more users get through
        assert isinstance(await lim.admit("acme", "u2"), Admission)
        fields = await client.call("HGETALL", lim.keys("acme", "u2")[0])
        return float(dict(zip(fields[::2], fields[1::2], strict=True))[b"tokens"])

    assert run(use) < 1.0  # two of two taken: two admitted requests, nothing for the refused one


def test_in_flight_slots_are_freed_at_the_end_and_come_back_when_their_holder_dies(prefix):
    async def use(client):
        one = shared(client, prefix, tenant_streams=2)
        other = shared(client, prefix, tenant_streams=2)  # another process
        t = 5000.0
        a = await one.admit("acme", "u", now=t)
        b = await other.admit("acme", "u", now=t)
        assert isinstance(a, Admission) and isinstance(b, Admission) and a.holder != b.holder
        assert await other.admit("acme", "u", now=t) == Refused("streams", 1.0)
        await other.release(b)
        assert not other.held
        c = await other.admit("acme", "u", now=t + 1)
        assert isinstance(c, Admission)
        await other.release(c)
        # `one` dies holding `a`: nothing releases or renews it; its lease ends it
        d = await other.admit("acme", "u", now=t + 2)
        assert isinstance(d, Admission)
        assert await other.admit("acme", "u", now=t + LEASE_S - 1) == Refused("streams", 1.0)
        got = await other.admit("acme", "u", now=t + LEASE_S + 1)  # a's lease is over (and d's)
        return got

    assert isinstance(run(use), Admission)


def test_a_running_request_keeps_its_slot_past_the_lease_by_renewing_it(prefix):
    async def use(client):
        holder = shared(client, prefix, tenant_streams=1)
        other = shared(client, prefix, tenant_streams=1)
        t = 100.0  # an injected clock far behind Redis's: renewing moves the lease to Redis time
        assert isinstance(await holder.admit("acme", "u", now=t), Admission)
        await holder.renew()
        return await other.admit("acme", "u", now=t + LEASE_S + 1)

    assert run(use) == Refused("streams", 1.0)


def test_redis_down_falls_back_to_this_processes_limits_and_counts_it():
    async def use(_client):
        down = limits_client(f"redis://127.0.0.1:{dead_port()}/0")
        counted: list[str] = []
        lim = SharedLimits(
            down,
            ProcessLimits(tenant_rate=1, tenant_burst=2, tenant_streams=5),
            timeout_s=0.05,
            fallback=counted.append,
        )
        got = [await lim.admit("acme", "u") for _ in range(3)]
        await lim.release(got[0])
        await down.aclose()
        return got, counted, dict(lim.local.active)

    got, counted, active = run(use)
    # fail open to the process's own limits, not to none: the burst of 2, then 429
    assert [type(g) for g in got] == [Admission, Admission, Refused] and got[2].limit == "tenant"
    assert counted == ["error", "down", "down"]  # the failure, then Redis left alone for a while
    assert active == {"acme": 1}  # the slot counted here is released here


def test_a_redis_that_hangs_costs_a_request_its_deadline_then_the_process_counts_alone():
    hung = socket.socket()  # accepts connections (the kernel's backlog), never answers
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    try:

        async def use(_client):
            client = limits_client(f"redis://127.0.0.1:{hung.getsockname()[1]}/0")
            counted: list[str] = []
            lim = SharedLimits(
                client, ProcessLimits(tenant_rate=1, tenant_burst=1), timeout_s=0.05, fallback=counted.append
            )
            got = [await lim.admit("acme", "u"), await lim.admit("acme", "u")]
            await client.aclose()
            return got, counted

        got, counted = run(use)
    finally:
        hung.close()
    assert [type(g) for g in got] == [Admission, Refused]
    assert counted == ["timeout", "down"]


# ---- two gateways sharing nothing but Redis -----------------------------------------------------


@pytest.mark.django_db
def test_two_gateways_hold_a_tenant_to_its_one_rate_together(running_with, make_gateway, prefix):
    """A tenant at several times its rate through two gateways gets burst + rate x time in all,
    within 5%: each gateway alone would let as much through again."""
    running_with()
    rate, burst = 40, 10
    # What is measured is the sharing: a Redis call slower than the production 50 ms (a loaded
    # test machine: eight threads, two gateways and the rest of the suite on two cores) would put
    # that gateway on its own limits for a while and let through as much again. The timeout's
    # own behaviour is tested above.
    config = dict(
        limits_url=REDIS_URL, limits_prefix=prefix, tenant_rate=rate, tenant_burst=burst, limits_timeout_s=2.0
    )
    gateways = [make_gateway(**config), make_gateway(**config)]
    body = {"model": "ttft-opt", "messages": MESSAGES, "max_tokens": 2}
    for g in gateways:  # warm: the upstream connections, on the other tenant's bucket
        beta = {"authorization": f"Bearer {OTHER_KEY}"}
        assert httpx.post(g.url + "/v1/chat/completions", json=body, headers=beta).status_code == 200
    stop = time.monotonic() + 4.0
    lock = threading.Lock()
    ok: list[float] = []  # when each request let through was sent
    refused = [0]

    def hammer(k: int) -> None:
        with httpx.Client(base_url=gateways[k % 2].url, headers=AUTH, timeout=10) as http:
            i = 0
            while time.monotonic() < stop:
                sent = time.monotonic()
                r = http.post("/v1/chat/completions", json={**body, "user": f"u{k}-{i}"})
                i += 1
                assert r.status_code in (200, 429), r.text
                with lock:
                    if r.status_code == 200:
                        ok.append(sent)
                    else:
                        refused[0] += 1

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(hammer, range(8)))
    # The bucket is full at the first request let through; from then on the rate refills it.
    expected = burst + rate * (max(ok) - min(ok))
    assert refused[0] > len(ok), "the tenant was not sending well over its rate"
    assert abs(len(ok) - expected) <= 0.05 * expected, (len(ok), expected, refused[0])
    assert all(g.gateway.limits.tenants is not None and len(g.gateway.limits.tenants) == 0 for g in gateways)


@pytest.mark.django_db
def test_a_shared_slot_is_freed_when_the_request_ends_and_when_the_client_goes_away(
    running_with, make_gateway, prefix
):
    running_with()
    config = dict(limits_url=REDIS_URL, limits_prefix=prefix, tenant_streams=1)
    gw = make_gateway(forward_headers=frozenset({"x-abplat-fault"}), **config)
    other = make_gateway(**config)  # another gateway, the same tenant
    r = redis.Redis.from_url(REDIS_URL, socket_timeout=2)
    flight = f"{prefix}:{{acme}}:flight"
    quick = {"model": "ttft-opt", "messages": MESSAGES, "max_tokens": 2, "user": "u2"}
    assert httpx.post(gw.url + "/v1/chat/completions", json=quick, headers=AUTH).status_code == 200
    wait_for(lambda: r.zcard(flight) == 0, timeout=10)  # the end of the request freed it
    held = json.dumps(
        {"model": "ttft-opt", "messages": MESSAGES, "max_tokens": 5, "user": "u1", "stream": True}
    ).encode()
    port = int(gw.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(  # the simulator holds its headers: in flight until this client goes away
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\nx-abplat-fault: slow_headers\r\n"
            b"Content-Length: " + str(len(held)).encode() + b"\r\n\r\n" + held
        )
        wait_for(lambda: r.zcard(flight) == 1, timeout=10)
        refused = httpx.post(other.url + "/v1/chat/completions", json=quick, headers=AUTH)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "concurrency_limit_exceeded"
        beta = {"authorization": f"Bearer {OTHER_KEY}"}
        assert httpx.post(other.url + "/v1/chat/completions", json=quick, headers=beta).status_code == 200
    wait_for(lambda: r.zcard(flight) == 0, timeout=10)  # the client went away: the slot is free
    assert httpx.post(other.url + "/v1/chat/completions", json=quick, headers=AUTH).status_code == 200


@pytest.mark.django_db
def test_a_gateway_whose_redis_is_down_serves_with_its_own_limits_and_counts_it(running_with, make_gateway):
    running_with()
    before = fallbacks("error") + fallbacks("down")
    gw = make_gateway(
        limits_url=f"redis://127.0.0.1:{dead_port()}/0", limits_timeout_s=0.05, tenant_rate=1, tenant_burst=2
    )
    codes = [
        httpx.post(
            gw.url + "/v1/chat/completions",
            json={"model": "ttft-opt", "messages": MESSAGES, "max_tokens": 2, "user": f"u{i}"},
            headers=AUTH,
        ).status_code
        for i in range(3)
    ]
    assert codes == [200, 200, 429]  # open, to the process's own rate
    assert fallbacks("error") + fallbacks("down") - before == 3


def test_the_pipe_matches_replies_in_order_across_pieces_and_drops_the_unawaited_ones():
    from gateway.redis_pipe import RedisError, _Protocol

    async def feed():
        loop = asyncio.get_running_loop()
        proto = _Protocol(loop.create_future())
        gave_up, array, error, bulk = (loop.create_future() for _ in range(4))
        gave_up.cancel()  # its caller's deadline passed before the reply came
        proto.waiting.extend([gave_up, None, array, error, bulk])  # None: sent, not awaited (ZREM)
        wire = b":7\r\n:1\r\n*2\r\n:0\r\n:250000\r\n-NOSCRIPT No matching script\r\n$3\r\nabc\r\n"
        for i in range(len(wire)):  # a byte at a time: every reply cut everywhere
            proto.data_received(wire[i : i + 1])
        assert not proto.waiting and not proto.buf
        with pytest.raises(RedisError, match="NOSCRIPT"):
            error.result()
        pending = loop.create_future()
        proto.waiting.append(pending)
        proto.connection_lost(None)  # Redis went away: the waiting call fails, not hangs
        with pytest.raises(ConnectionError):
            pending.result()
        return array.result(), bulk.result()

    assert asyncio.run(feed()) == ([0, 250000], b"abc")
