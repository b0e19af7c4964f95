"""The gateway's shared client limits (ABPLAT_GATEWAY_LIMITS_URL): what they add, and how exact.

Part of bench/bench_gateway.py, run with ``--limits redis``:

    .venv/bin/python bench/bench_gateway.py --limits redis --quick
    .venv/bin/python bench/bench_gateway.py --limits redis --levels 1,64 --peers "" --rounds 3

- added latency: beside the gateway a second one, **gateway+redis**, the same gateway with the
  same limits (every one a rate of 1,000,000 a second, a burst as large, 1,000,000 requests in
  flight: every request is checked and charged, none refused) counted in Redis instead of in the
  process. Both gateways carry the limits, so the difference between their rows is the shared
  limits' own cost: one EVALSHA before the upstream send and one ZREM after the response. The
  table after the levels' table: the extra added TTFT at p50 and p99 (gateway+redis minus
  gateway, the same quantile of the same basis) and the ratio of their hops. Target: extra p50 at
  most 0.2 ms.
- exactness: two more gateway processes on the same Redis with a tenant rate R and burst B,
  hammered by one tenant at several times R for a few seconds through both; the requests let
  through against B + R x (last let through - first let through), and what each process alone
  would have let through.

Redis: ``--limits-url`` (default redis://127.0.0.1:6379/14, a database the test suite does not
use); the bench deletes its tenant's keys there before each measurement.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

SHARED = "gateway+redis"  # the path's name: the gateway with ABPLAT_GATEWAY_LIMITS_URL
TARGET_EXTRA_P50_MS = 0.2
# Limits every request is checked and charged against, never refused: their cost alone.
HUGE = {
    "ABPLAT_GATEWAY_TENANT_RATE": "1000000",
    "ABPLAT_GATEWAY_TENANT_BURST": "1000000",
    "ABPLAT_GATEWAY_USER_RATE": "1000000",
    "ABPLAT_GATEWAY_USER_BURST": "1000000",
    "ABPLAT_GATEWAY_TENANT_STREAMS": "1000000",
}
EXACT_RATE, EXACT_BURST, EXACT_SECONDS, EXACT_STREAMS = 200, 20, 5.0, 24


def forget(url: str) -> None:
    """Delete the shared limits' keys (the bench's tenant) in the bench's Redis database."""
    import redis

    r = redis.Redis.from_url(url, socket_timeout=5)
    for key in r.scan_iter("abplat-gw-limits:*"):
        r.delete(key)
    r.close()


def limits_env(url: str | None) -> dict[str, str]:
    return {**HUGE, "ABPLAT_GATEWAY_LIMITS_URL": url or "", "ABPLAT_GATEWAY_LIMITS_TIMEOUT_MS": "50"}


def extra_table(added: dict, figures: dict, baseline: str, quantile: Callable) -> None:
    """gateway+redis against the gateway with the same limits per process, per level."""
    print(f"\nthe shared limits' cost: {SHARED} against {baseline} (the same limits, counted in the process)")
    print(
        "| streams | added p50 ms, gateway / +redis | added p99 ms, gateway / +redis | extra p50 ms | extra p99 ms | hop p50 ratio | CPU us/token, gateway / +redis |"
    )
    print("|---:|---|---|---:|---:|---:|---|")
    for c, per in figures.items():
        if baseline not in per or SHARED not in per:
            continue
        a, b = added[(c, baseline)], added[(c, SHARED)]
        key = "hop" if per[SHARED]["hop"] else "ttft"
        ratio = quantile(per[SHARED][key], 0.5) / quantile(per[baseline][key], 0.5)
        ca, cb = (per[n]["cpu_s"] / per[n]["tokens"] * 1e6 for n in (baseline, SHARED))
        print(
            f"| {c} | {a[0]:+.3f} / {b[0]:+.3f} | {a[1]:+.3f} / {b[1]:+.3f} | {b[0] - a[0]:+.3f} | "
            f"{b[1] - a[1]:+.3f} | {ratio:.3f} | {ca:.1f} / {cb:.1f} |"
        )
        if c == 1:
            met = "met" if b[0] - a[0] <= TARGET_EXTRA_P50_MS else "NOT met"
            print(f"(target at 1 stream: extra p50 <= {TARGET_EXTRA_P50_MS} ms: {met})")


def hammer(urls: list[str], model: str, headers: dict[str, str], seconds: float, streams: int) -> dict:
    """``streams`` closed loops of one-token requests, spread over ``urls``, for ``seconds``:
    when each request let through was sent, and how many were refused (429)."""
    import httpx

    async def go() -> dict:
        ok: list[float] = []
        refused = other = 0
        stop = time.monotonic() + seconds

        async def loop(k: int, client: Any) -> None:
            nonlocal refused, other
            i = 0
            while time.monotonic() < stop:
                sent = time.monotonic()
                body = {"model": model, "prompt": "hi", "max_tokens": 1, "user": f"x{k}-{i}"}
                r = await client.post(urls[k % len(urls)] + "/v1/completions", json=body)
                i += 1
                if r.status_code == 200:
                    ok.append(sent)
                elif r.status_code == 429:
                    refused += 1
                else:
                    other += 1

        limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
        async with httpx.AsyncClient(headers=headers, timeout=30, limits=limits) as client:
            await asyncio.gather(*(loop(k, client) for k in range(streams)))
        return {"ok": ok, "refused": refused, "other": other}

    return asyncio.run(go())


def exactness(start: Callable[[dict[str, str], str], Any], url: str, model: str) -> str:
    """Two gateway processes on one Redis, a tenant at rate EXACT_RATE: the line for the report.
    ``start(extra env, name)`` starts one gateway (bench_gateway.start_gateway) and returns its Path."""
    from bench.benchlib import BenchFailed

    env = {
        **limits_env(url),
        "ABPLAT_GATEWAY_TENANT_RATE": str(EXACT_RATE),
        "ABPLAT_GATEWAY_TENANT_BURST": str(EXACT_BURST),
    }
    gateways = [start(env, f"{SHARED}-exact-{i}") for i in (1, 2)]
    try:
        forget(url)
        got = hammer([g.url for g in gateways], model, gateways[0].headers, EXACT_SECONDS, EXACT_STREAMS)
        for g in gateways:
            g.sent = 0  # their books are not checked: refused requests are no samples
    finally:
        for g in gateways:
            g.stop()
    ok = got["ok"]
    if got["other"] or not ok:
        raise BenchFailed(f"exactness: {got['other']} answers neither 200 nor 429, {len(ok)} let through")
    window = max(ok) - min(ok)
    expected = EXACT_BURST + EXACT_RATE * window
    sent = len(ok) + got["refused"]
    return (
        f"exactness: a tenant at rate {EXACT_RATE}/s (burst {EXACT_BURST}) through 2 gateway processes "
        f"sharing Redis, {sent} requests in {EXACT_SECONDS:g} s ({sent / EXACT_SECONDS:.0f}/s, "
        f"{EXACT_STREAMS} streams): {len(ok)} let through, {expected:.1f} expected "
        f"(B + R x {window:.3f} s), {100 * (len(ok) - expected) / expected:+.2f}%; per process they "
        f"would have let through up to {2 * expected:.0f}"
    )
