"""The event loop requests are streamed on (streaming/loop.py): uvloop by default, asyncio's on
request, and a name that is neither refused."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from streaming import loop


async def _loop_type() -> type:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop())


def test_the_default_loop_is_uvloop():
    assert loop.run(_loop_type()) is uvloop.Loop


def test_asyncio_keeps_asyncios_own_loop():
    assert issubclass(loop.run(_loop_type(), "asyncio"), asyncio.SelectorEventLoop)


def test_an_unknown_loop_is_refused_with_the_choices_named():
    with pytest.raises(ValueError, match=r"event loop 'trio': use one of uvloop, asyncio"):
        loop.loop_factory("trio")


def test_a_replay_loop_runs_with_the_short_switch_interval_and_restores_it():
    import sys
    import threading

    before = sys.getswitchinterval()
    seen = []

    async def probe():
        seen.append(sys.getswitchinterval())

    loop.run(probe())
    assert seen == [pytest.approx(loop.SWITCH_INTERVAL_S)] and sys.getswitchinterval() == before

    # two loops in two threads at once: the interval stays short until the last one ends
    inside, release = threading.Event(), threading.Event()

    async def hold():
        inside.set()
        while not release.is_set():
            await asyncio.sleep(0.01)

    t = threading.Thread(target=loop.run, args=(hold(),))
    t.start()
    assert inside.wait(10)
    loop.run(probe())  # ends while the other still runs
    assert sys.getswitchinterval() == pytest.approx(loop.SWITCH_INTERVAL_S)
    release.set()
    t.join(10)
    assert sys.getswitchinterval() == before
    # an interval already shorter is left alone
    sys.setswitchinterval(0.0001)
    try:
        seen.clear()
        loop.run(probe())
        assert seen == [pytest.approx(0.0001)]
    finally:
        sys.setswitchinterval(before)


def test_the_heap_is_frozen_while_a_shard_runs_and_collectable_again_after():
    import gc

    class Cycle:
        pass

    before = gc.get_freeze_count()
    with loop.frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > before  # what was alive at the start is out of the collector's sight
        with loop.frozen_heap():  # a second caller inside: still frozen when it leaves
            pass
        assert gc.get_freeze_count() >= frozen
        # what the shard itself makes is still collected
        a = Cycle()
        a.self = a
        del a
        assert gc.collect() >= 1
    # unfrozen: the old objects are collectable again (a heap frozen before stays frozen)
    assert gc.get_freeze_count() == 0 if before == 0 else gc.get_freeze_count() >= before
