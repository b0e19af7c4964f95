"""The replay's exchange on the HTTP/1.1 core (streaming/h1.py): it measures a streamed
response as it is parsed and ends, exactly once, with the finished StreamResult.

The bytes go straight from the core's callbacks into the ResponseReader (streaming/response.py:
what the response means, as on every other path), inside the connection's read callback: no
task wakes up until the request is over (one wake-up per request, not per token). The phases'
deadlines share one lazily re-armed ``Deadline``, set to whatever the reader says the current
phase allows.
"""

from __future__ import annotations

import asyncio
from typing import Any

from streaming.h1 import Deadline, Exchange
from streaming.response import ResponseReader
from streaming.result import Outcome, StreamResult
from streaming.timing import StreamTimer


class TimedExchange(Exchange):
    """One measured request. ``future`` resolves with its StreamResult."""

    __slots__ = ("reader", "future", "ctype", "deadline", "result", "done")

    def __init__(self, timer: StreamTimer, timeouts: Any, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.reader = ResponseReader(timer, timeouts)
        self.future: asyncio.Future[StreamResult] = loop.create_future()
        self.ctype = b""
        self.result: StreamResult | None = None
        self.done = False  # the result is settled (a plain slot: read on every read)
        self.deadline = Deadline(loop, self._on_deadline)
        self.deadline.set(self.reader.deadline_ns())

    def _on_deadline(self, now: int) -> None:
        if self.done:
            return
        if self.reader.timed_out(now):
            return self._settle(now)
        self.deadline.set(self.reader.deadline_ns())  # events arrived since: lazily re-armed

    # the core's callbacks -------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":  # the only header a measurement needs
            self.ctype = value

    def response_head(self) -> None:
        if self.done:
            return
        if self.reader.head(self.now, self.status, self.ctype):
            return self._settle(self.now)
        self.deadline.set(self.reader.deadline_ns())

    def on_body(self, body: bytes) -> None:
        if self.done:
            return
        reader = self.reader
        phase = reader.phase
        if reader.body(self.now, body):
            return self._settle(self.now)
        if reader.phase is not phase:  # the first content: the stall deadline from now on
            self.deadline.set(reader.deadline_ns())

    def response_end(self) -> None:
        if self.done:  # ended before its message did, and the connection was not drained
            return
        self.reader.end(self.now)
        self._settle(self.now)

    def lost(self, now: int, exc: BaseException | None) -> None:
        if not self.done:
            self.reader.end(now)
            self._settle(now)

    def broken(self, now: int, exc: Exception) -> None:
        if not self.done:
            self.reader.broken(exc)
            self._settle(now)

    # the end ------------------------------------------------------------------------------------
    def end(self, now: int, outcome: Outcome, error: str = "") -> None:
        """End the request now with ``outcome`` unless the response already decided one (the
        caller's cancel)."""
        if not self.done:
            self.reader.decide(outcome, error)
            self._settle(now)

    def _settle(self, now: int) -> None:
        if self.done:
            return
        self.done = True
        self.deadline.close()
        reader = self.reader
        result = self.result = reader.finish(now)
        if self.conn is not None:
            # After [DONE] the chunked terminator usually follows in the same packet or the
            # next: drain it and reuse the connection.
            self.conn.finish(self, drain=reader.timer.done)
        if not self.future.done():
            self.future.set_result(result)
