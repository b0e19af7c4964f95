"""The event loop requests are streamed on: uvloop where it is installed, asyncio's own otherwise.

A replay process spends most of its CPU in the event loop itself: one wake-up, one read and one
callback per streamed token, per stream. uvloop runs that loop in C (libuv) and takes about a
tenth off the replay's CPU per streamed token (bench/bench_replay_cpu.py). The lean
HTTP/1.1 path reads its sockets itself (streaming/h1.py, ``loop.add_reader``), so kernel receive
stamps and the start-burst pacing (streaming/pacing.py: uvloop runs the callbacks that are ready
at the start of a pass, as asyncio does) work the same on both loops. ``name="asyncio"`` keeps
asyncio's loop (the benchmarks compare both).

While a replay loop runs, the process's GIL switch interval is 0.5 ms instead of Python's 5 ms
(``short_switch_interval``). The loop shares its process with threads that hold the interpreter
in stretches: the sample sink validating and inserting a batch (replay/sink.py), a capacity
step's looks at the store (capacity/steps.py), the command that waits for the run. At 5 ms each
time the loop wants the interpreter back it may wait a whole interval, and under a few hundred
streams those waits pile up into the schedule lag: the demo's capacity steps lagged 8-163 ms at
p99 at 64-128 req/s, 4.5-7.3 ms with the shorter interval on the same quiet machine
(bench/RESULTS.md, "The demo").

While a replay shard runs, the heap it started with is frozen (``frozen_heap``): gc.freeze()
moves every object alive then out of the collector's sight, so a full collection during the
schedule walks only what the shard itself made. A worker process with Django and the replay
stack imported holds ~150,000 tracked objects; one full collection over them took 110-160 ms
here. Python starts one once the objects promoted to the oldest generation since the last
exceed a quarter of those it holds, so a long schedule meets them, and a send due in that pause
goes late by up to its length.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
CHOICES = ("uvloop", "asyncio")
SWITCH_INTERVAL_S = 0.0005

_switch_lock = threading.Lock()
_switch_users = 0
_switch_before = 0.0
_freeze_users = 0
_frozen_before = False


@contextlib.contextmanager
def short_switch_interval(interval_s: float = SWITCH_INTERVAL_S) -> Iterator[None]:
    """The process's GIL switch interval at most ``interval_s`` while any caller is inside
    (loops may run in several threads at once); the interval before is restored when the last
    one leaves."""
    global _switch_users, _switch_before
    with _switch_lock:
        if _switch_users == 0:
            _switch_before = sys.getswitchinterval()
            if _switch_before > interval_s:
                sys.setswitchinterval(interval_s)
        _switch_users += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_users -= 1
            if _switch_users == 0:
                sys.setswitchinterval(_switch_before)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """The heap as it is now, collected once and frozen (gc.freeze) while any caller is inside;
    unfrozen (back in the oldest generation, collectable again) when the last one leaves, unless
    the process had frozen its heap itself before (the gateway does at start: that stays). The
    first caller pays one full collection here, before its schedule starts; a caller that
    enters while another is inside freezes without collecting (the other's loop is running)."""
    global _freeze_users, _frozen_before
    with _switch_lock:
        if _freeze_users == 0:
            _frozen_before = gc.get_freeze_count() > 0
            gc.collect()
        gc.freeze()
        _freeze_users += 1
    try:
        yield
    finally:
        with _switch_lock:
            _freeze_users -= 1
            if _freeze_users == 0 and not _frozen_before:
                gc.unfreeze()


def loop_factory(name: str = "uvloop") -> Callable[[], asyncio.AbstractEventLoop]:
    """New loops of ``name``: uvloop (asyncio's when uvloop is not importable) or asyncio."""
    if name not in CHOICES:
        raise ValueError(f"event loop {name!r}: use one of {', '.join(CHOICES)}")
    if name == "uvloop":
        try:
            import uvloop
        except ImportError:  # not installed: asyncio's loop, which works the same, a little slower
            return asyncio.new_event_loop
        return uvloop.new_event_loop
    return asyncio.new_event_loop


def run(coro: Coroutine[Any, Any, T], name: str = "uvloop") -> T:
    """``asyncio.run(coro)`` on the streaming loop (``loop_factory``), with the short GIL switch
    interval while it runs."""
    with short_switch_interval(), asyncio.Runner(loop_factory=loop_factory(name)) as runner:
        return runner.run(coro)
