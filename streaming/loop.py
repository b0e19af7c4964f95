"""The event loop requests are streamed on: uvloop where it is installed, asyncio's own otherwise.

A replay process spends most of its CPU in the event loop itself: one wake-up, one read and one
callback per streamed token, per stream. uvloop runs that loop in C (libuv) and takes about a
tenth off the replay's CPU per streamed token (bench/bench_replay_cpu.py, issue 14). The lean
HTTP/1.1 path reads its sockets itself (streaming/h1.py, ``loop.add_reader``), so kernel receive
stamps and the start-burst pacing (streaming/pacing.py: uvloop runs the callbacks that are ready
at the start of a pass, as asyncio does) work the same on both loops. ``name="asyncio"`` keeps
asyncio's loop (the benchmarks compare both).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
CHOICES = ("uvloop", "asyncio")


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
    """``asyncio.run(coro)`` on the streaming loop (``loop_factory``)."""
    with asyncio.Runner(loop_factory=loop_factory(name)) as runner:
        return runner.run(coro)
