"""The start-burst guard: at most N new connections per event-loop pass, in arrival order, so the
loop reads the running streams between every N opens (streaming/pacing.py)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from simulator.serve import DEFAULT_MODEL
from streaming import pacing
from streaming.client import VariantClient
from streaming.pacing import OpenPacer, pacer_for
from streaming.result import Outcome, StreamCancelled


async def _burst(pacer: OpenPacer, n: int, cancel: frozenset[int] = frozenset()) -> list[tuple[int, int]]:
    """n takers started in one pass; (taker, pass it was let through), in the order let through."""
    loop = asyncio.get_running_loop()
    passes = 0
    running = True

    def tick() -> None:  # re-scheduled from itself: runs exactly once per pass
        nonlocal passes
        passes += 1
        if running:
            loop.call_soon(tick)

    loop.call_soon(tick)
    got: list[tuple[int, int]] = []

    async def taker(i: int) -> None:
        await pacer.take()
        got.append((i, passes))

    tasks = [asyncio.ensure_future(taker(i)) for i in range(n)]
    await asyncio.sleep(0)  # every taker has run once: the first N are through, the rest wait
    for i in cancel:
        tasks[i].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    running = False
    return got


def test_a_burst_goes_through_n_per_pass_in_arrival_order():
    async def main():
        return await _burst(OpenPacer(asyncio.get_running_loop(), 8), 100)

    got = asyncio.run(main())
    assert [i for i, _ in got] == list(range(100))  # first come, first served
    per_pass = Counter(p for _, p in got)
    assert [per_pass[p] for p in sorted(per_pass)] == [8] * 12 + [4]  # 8 a pass, the rest last


def test_a_cancelled_waiter_spends_no_budget_and_the_rest_go_through():
    async def main():
        return await _burst(OpenPacer(asyncio.get_running_loop(), 2), 10, cancel=frozenset({3, 6}))

    got = asyncio.run(main())
    assert [i for i, _ in got] == [0, 1, 2, 4, 5, 7, 8, 9]
    assert max(Counter(p for _, p in got).values()) == 2


def test_without_a_burst_nobody_waits():
    async def main():
        loop = asyncio.get_running_loop()
        pacer = OpenPacer(loop, 4)
        for _ in range(20):  # one open per pass: always within budget, take() never suspends
            step = pacer.take().__await__()
            with pytest.raises(StopIteration):
                step.send(None)
            await asyncio.sleep(0)
        return pacer

    pacer = asyncio.run(main())
    assert not pacer.waiters and pacer.left == 4


def test_one_pacer_per_loop_and_a_bad_budget_is_refused():
    async def both():
        loop = asyncio.get_running_loop()
        return pacer_for(loop), pacer_for(loop)

    a, b = asyncio.run(both())
    c, _ = asyncio.run(both())
    assert a is b and a is not c
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ValueError, match="per_pass must be at least 1"):
            OpenPacer(loop, 0)
    finally:
        loop.close()


def test_the_client_paces_its_new_connections_and_a_waiting_request_can_be_cancelled(fast, monkeypatch):
    """1 open per pass: 6 requests on cold connections all succeed, each on its own new
    connection; one cancelled while it waits its turn ends CANCELLED before its clock ran."""
    monkeypatch.setattr(pacing, "OPENS_PER_PASS", 1)

    async def main():
        async with VariantClient(fast.url + "/v1", DEFAULT_MODEL, "completions", transport="h1") as c:
            tasks = [asyncio.ensure_future(c.stream(f"p{i}", "hi", 3)) for i in range(6)]
            await asyncio.sleep(0)  # all started: p0 opens, p1..p5 wait their turn
            assert len(pacer_for(asyncio.get_running_loop()).waiters) == 5
            tasks[5].cancel()
            with pytest.raises(StreamCancelled) as info:  # awaited itself: gather would re-wrap it
                await tasks[5]
            return [await t for t in tasks[:5]], info.value.result

    done, cancelled = asyncio.run(main())
    assert [r.outcome for r in done] == [Outcome.OK] * 5
    assert all(r.new_connection and r.connect_ms is not None for r in done)
    assert cancelled.outcome is Outcome.CANCELLED and cancelled.ttft_ms is None and cancelled.start_ns > 0
