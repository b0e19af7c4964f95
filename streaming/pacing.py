"""At most N new connections per event-loop pass (the lean HTTP/1.1 path's start-burst guard).

An asyncio loop runs every ready callback before it polls the sockets again. When hundreds of
requests start at once on cold connections, one pass opens all of them (socket, connect,
transport, request write), and 500 opens kept the loop from reading the streams already running
for 60-100 ms. Their packets queue in the kernel, which merges unread segments and keeps only
the newest arrival stamp: those requests' first tokens were stamped that late (bench/
bench_streaming.py section 1b). Pacing the opens, N per pass in FIFO order, lets the loop read
the running streams between every N opens: at 512 streams N=32 still left 13-17 ms errors,
N=16 sometimes, N=8 none over 1.4 ms. The wait happens before a request's clock starts; the
replay records it as schedule lag.

Pure asyncio: no framework, no network.
"""

from __future__ import annotations

import asyncio
import collections
import weakref

OPENS_PER_PASS = 8  # read when a loop's pacer is made; the benchmark raises it to compare


class OpenPacer:
    """Hands out at most ``per_pass`` opens per pass of ``loop``; the rest wait in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop, per_pass: int | None = None) -> None:
        per_pass = OPENS_PER_PASS if per_pass is None else per_pass
        if per_pass < 1:
            raise ValueError(f"per_pass must be at least 1, got {per_pass}")
        self.loop = loop
        self.per_pass = per_pass
        self.left = per_pass
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._refill_scheduled = False

    async def take(self) -> None:
        """Return when this caller may open a connection (at once while the pass has budget)."""
        if self.left > 0 and not self.waiters:
            self.left -= 1
            self._schedule_refill()
            return
        fut: asyncio.Future[None] = self.loop.create_future()
        self.waiters.append(fut)
        self._schedule_refill()
        await fut  # cancelled: the future is done, so the refill skips it (no budget spent)

    def _schedule_refill(self) -> None:
        if not self._refill_scheduled:
            self._refill_scheduled = True
            self.loop.call_soon(self._refill)

    def _refill(self) -> None:
        # Runs once in the pass after budget was spent. The waiters it wakes resume in the pass
        # after this one, so their budget is reserved here and the next refill follows them.
        self._refill_scheduled = False
        self.left = self.per_pass
        while self.left and self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                self.left -= 1
        if self.waiters or self.left < self.per_pass:
            self._schedule_refill()


_pacers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, OpenPacer] = weakref.WeakKeyDictionary()


def pacer_for(loop: asyncio.AbstractEventLoop) -> OpenPacer:
    """The loop's one pacer: a burst is loop-wide, whichever variant's client opens."""
    pacer = _pacers.get(loop)
    if pacer is None:
        pacer = _pacers[loop] = OpenPacer(loop)
    return pacer
