"""A chaos drill reaches every documented error class (docs/measuring.md).

The slow faults last longer than the client's deadline for the phase they slow, so they end as
timeouts; the drill runs on scaled-down deadlines (and faults scaled with them) to stay fast.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from serving.children import free_port
from simulator.profiles import OVER_DEADLINE, chaos_faults, get_profile
from simulator.serve import start_in_thread
from streaming.client import Timeouts, VariantClient
from streaming.result import Outcome

# What the client records for each fault kind the simulator injects.
EXPECTED = {
    "": Outcome.OK,
    "split_utf8": Outcome.OK,  # valid bytes, split across writes
    "http_error": Outcome.HTTP_5XX,
    "rate_limited": Outcome.HTTP_4XX,
    "engine_error": Outcome.ENGINE_ERROR,
    "stall": Outcome.STALL,
    "disconnect": Outcome.DISCONNECT,
    "malformed": Outcome.MALFORMED,
    "slow_headers": Outcome.HEADERS_TIMEOUT,
    "slow_first_token": Outcome.FIRST_TOKEN_TIMEOUT,
}


def test_the_shipped_chaos_profile_outlasts_the_clients_default_deadlines():
    # The bug: stall and slow headers lasted 1.5 s, under 30 s deadlines, so never timed out.
    faults, t = get_profile("chaos").faults, Timeouts()
    assert faults.stall_ms > 1000 * t.stall_s
    assert faults.slow_headers_ms > 1000 * t.headers_s
    assert faults.slow_first_token_ms > 1000 * t.first_token_s
    assert {k for k in faults.KINDS if getattr(faults, f"{k}_rate") > 0} == set(EXPECTED) - {""}


IN_FLIGHT = 40


def test_a_chaos_drill_produces_every_documented_error_class():
    timeouts = Timeouts(connect_s=2.0, headers_s=0.5, first_token_s=0.8, stall_s=0.5, total_s=10.0)
    chaos = get_profile("chaos")
    profile = dataclasses.replace(chaos, faults=chaos_faults(timeouts))
    assert profile.faults.stall_ms == pytest.approx(OVER_DEADLINE * 500.0)
    ids = [f"drill-{i}" for i in range(400)]
    drawn = {rid: profile.faults.draw(random.Random(f"fault:{profile.seed}:{rid}").random()) for rid in ids}
    assert set(drawn.values()) == set(EXPECTED)  # the drill is big enough to draw every kind
    h = start_in_thread(profile)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: the network's own class

    async def go():
        async with (
            VariantClient(h.url, "abplat-sim", "chat", timeouts=timeouts) as c,
            VariantClient(dead, "abplat-sim", "chat", timeouts=timeouts) as d,
        ):
            results = await asyncio.gather(*(c.stream(rid, "x", 6) for rid in ids))
            return results, await d.stream("drill-dead", "x", 6)

    try:
        results, down = asyncio.run(go())
    finally:
        h.stop()
    got = {rid: r.outcome for rid, r in zip(ids, results)}
    wrong = {
        rid: (drawn[rid], got[rid], r.error)
        for rid, r in zip(ids, results)
        if got[rid] != EXPECTED[drawn[rid]]
    }
    assert not wrong, wrong
    assert set(got.values()) | {down.outcome} == set(EXPECTED.values()) | {Outcome.CONNECT_ERROR}
