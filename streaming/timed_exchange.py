"""The replay's exchange on the HTTP/1.1 core (streaming/h1.py): it measures a streamed
response as it is parsed and ends, exactly once, with the finished StreamResult.

SSE events go straight from ``on_body`` into the StreamTimer, inside the connection's read
callback: no task wakes up until the request is over (one wake-up per request, not per token).
The phases (headers, first token, stall after the first content, the total) share one lazily
re-armed ``Deadline``; each ends the request with its own outcome.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httptools

from streaming.h1 import Deadline, Exchange
from streaming.result import Outcome, StreamResult
from streaming.sse import SSEParser
from streaming.timing import StreamProtocolError, StreamTimer

_ERROR_BODY_LIMIT = 2048


class TimedExchange(Exchange):
    """One measured request. ``future`` resolves with its StreamResult."""

    __slots__ = (
        "timer", "timeouts", "future", "sse", "phase", "start_ns", "total_ns", "last_event_ns",
        "ctype", "error_body", "body_started", "deadline", "done", "result",
    )  # fmt: skip

    def __init__(self, timer: StreamTimer, timeouts: Any, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.timer = timer
        self.timeouts = timeouts
        self.future: asyncio.Future[StreamResult] = loop.create_future()
        self.sse = SSEParser()
        self.phase = "headers"
        self.start_ns = timer.start_ns
        self.total_ns = self.start_ns + int(timeouts.total_s * 1e9)
        self.last_event_ns = 0
        self.ctype = b""
        self.error_body = b""
        self.body_started = False
        self.done = False
        self.result: StreamResult | None = None
        self.deadline = Deadline(loop, self._on_deadline)
        self._arm(self.start_ns + int(timeouts.headers_s * 1e9))

    # deadlines ----------------------------------------------------------------------------
    def _arm(self, deadline_ns: int) -> None:
        self.deadline.set(min(deadline_ns, self.total_ns))

    def _on_deadline(self, now: int) -> None:
        if self.done:
            return
        t = self.timeouts
        if now >= self.total_ns - 1_000_000:
            return self.end(now, Outcome.TOTAL_TIMEOUT, f"total timeout {t.total_s}s")
        if self.phase == "stall":
            due = min(self.last_event_ns + int(t.stall_s * 1e9), self.total_ns)
            if now < due:  # events arrived since the timer was set: lazily re-arm
                return self.deadline.set(due)
            return self.end(now, Outcome.STALL, f"stall timeout after {t.stall_s}s")
        outcome, limit = {
            "headers": (Outcome.HEADERS_TIMEOUT, t.headers_s),
            "error body": (Outcome.HEADERS_TIMEOUT, t.headers_s),
            "first token": (Outcome.FIRST_TOKEN_TIMEOUT, t.first_token_s),
        }[self.phase]
        self.end(now, outcome, f"{self.phase} timeout after {limit}s")

    # the core's callbacks -------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":  # the only header a measurement needs
            self.ctype = value

    def response_head(self) -> None:
        if self.done:
            return
        status = self.status
        self.timer.headers(self.now, status)
        if status >= 400:
            self.phase = "error body"
            return
        if status != 200 or not self.ctype.startswith(b"text/event-stream"):
            ctype = self.ctype.decode("latin-1")
            self.end(
                self.now,
                Outcome.MALFORMED,
                f"expected HTTP 200 text/event-stream, got {status} {ctype!r}",
            )
            return
        self.phase = "first token"
        self._arm(self.start_ns + int(self.timeouts.first_token_s * 1e9))

    def on_body(self, body: bytes) -> None:
        if self.done:
            return
        now = self.now
        if self.phase == "error body":
            self.error_body += body
            if len(self.error_body) >= _ERROR_BODY_LIMIT:
                self._http_error(now)
            return
        if not self.body_started:
            self.body_started = True
            self.timer.body_bytes(now)
        events = self.sse.feed_data(body)
        if events:
            self._events(events, now)

    def response_end(self) -> None:
        if self.done:  # ended before its message did, and the connection was not drained
            return
        if self.phase == "error body":
            self._http_error(self.now)
        else:
            self._eof(self.now)

    def lost(self, now: int, exc: BaseException | None) -> None:
        self._eof(now)

    def broken(self, now: int, exc: Exception) -> None:
        if isinstance(exc, httptools.HttpParserUpgrade):
            return self.end(now, Outcome.MALFORMED, "server tried to upgrade the connection")
        cause = exc.__context__
        if isinstance(cause, StreamProtocolError):
            return self.end(now, Outcome.MALFORMED, str(cause))
        self.end(now, Outcome.DISCONNECT, f"invalid HTTP response: {exc}")

    # stream logic ---------------------------------------------------------------------------
    def _events(self, events: list[str], now: int) -> None:
        """Each event's data, in order, read at ``now``."""
        timer = self.timer
        try:
            for data in events:
                status = timer.event(now, data)
                if status:
                    if status == StreamTimer.DONE:
                        return self.end(now, Outcome.OK)
                    return self.end(now, Outcome.ENGINE_ERROR)
        except StreamProtocolError as exc:
            return self.end(now, Outcome.MALFORMED, str(exc))
        self.last_event_ns = now
        if self.phase == "first token" and timer.first_content_seen:
            self.phase = "stall"
            self._arm(now + int(self.timeouts.stall_s * 1e9))

    def _http_error(self, now: int) -> None:
        detail = self.error_body[:_ERROR_BODY_LIMIT].decode("utf-8", "replace").strip()
        outcome = Outcome.HTTP_4XX if self.status < 500 else Outcome.HTTP_5XX
        self.end(now, outcome, f"HTTP {self.status}: {detail}")

    def _eof(self, now: int) -> None:
        """The body ended (message complete or connection closed) without [DONE]."""
        if self.done:
            return
        if self.phase == "headers":
            return self.end(now, Outcome.DISCONNECT, "server closed the connection before responding")
        if self.phase == "error body":
            return self._http_error(now)
        try:
            events = self.sse.finish()
            if events:
                self._events([ev.data for ev in events], now)
        except StreamProtocolError as exc:
            return self.end(now, Outcome.MALFORMED, str(exc))
        if not self.done:
            self.end(now, Outcome.DISCONNECT, "stream ended before [DONE]")

    def end(self, now: int, outcome: Outcome, error: str = "") -> None:
        if self.done:
            return
        self.done = True
        self.deadline.close()
        result = self.timer.finish(now, outcome, error)
        self.result = result
        if self.conn is not None:
            # After [DONE] the chunked terminator usually follows in the same packet or the
            # next: drain it and reuse the connection.
            self.conn.finish(self, drain=self.timer.done)
        if not self.future.done():
            self.future.set_result(result)
