"""The lean HTTP/1.1 streaming path for plain-http variants: asyncio Protocol + httptools.

Why not httpx here: profiling 64 concurrent streams showed ~100-200 us of CPU per streamed token,
over half of it in httpx/httpcore/h11/anyio layers, one task wake-up per chunk and one
``asyncio.timeout`` reschedule per chunk. While the loop is busy with one chunk the other
sockets' bytes wait in the kernel, and that wait is measurement error. Here:

1. ``data_received`` reads the clock first and only queues ``(t_ns, bytes)``; the parsing runs
   in one ``call_soon`` after every socket that was ready in this loop iteration has been read,
   so the timestamps of a burst are not delayed by each other's parsing.
2. HTTP framing (status, headers, chunked encoding) is parsed by httptools (C, llhttp); SSE
   events go straight from ``on_body`` into the StreamTimer, in callbacks: no task wakes up
   until the request is over (one wake-up per request, not per token).
3. Deadlines are one TimerHandle per phase; the stall deadline is lazy (re-armed from the last
   event's time when it fires) instead of rescheduled per chunk.

HTTP/2 and TLS variants keep httpx (client.py picks the path).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httptools

from workers.streaming.result import Outcome, StreamResult
from workers.streaming.sse import SSEParser
from workers.streaming.timing import StreamProtocolError, StreamTimer

_ERROR_BODY_LIMIT = 2048
# Idle keep-alive connections older than this are dropped, not reused: uvicorn (vLLM, the
# simulator) closes idle connections after 5 s by default, and reusing one the server is closing
# turns a healthy request into a spurious DISCONNECT.
IDLE_EXPIRY_S = 4.0
_perf = time.perf_counter_ns
_READ_SIZE = 65536


class Exchange:
    """One request/response on one connection: the httptools callback target and the per-phase
    state machine. Ends exactly once, by resolving ``future`` with the finished StreamResult."""

    __slots__ = (
        "timer", "timeouts", "loop", "future", "sse", "phase", "start_ns", "total_ns",
        "last_event_ns", "now", "status", "ctype", "error_body", "message_complete",
        "body_started", "handle", "conn", "done", "result",
    )  # fmt: skip

    def __init__(self, timer: StreamTimer, timeouts: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.timer = timer
        self.timeouts = timeouts
        self.loop = loop
        self.future: asyncio.Future[StreamResult] = loop.create_future()
        self.sse = SSEParser()
        self.phase = "headers"
        self.start_ns = timer.start_ns
        self.total_ns = self.start_ns + int(timeouts.total_s * 1e9)
        self.last_event_ns = 0
        self.now = 0
        self.status = 0
        self.ctype = b""
        self.error_body = b""
        self.message_complete = False
        self.body_started = False
        self.handle: asyncio.TimerHandle | None = None
        self.conn: H1Connection | None = None
        self.done = False
        self.result: StreamResult | None = None
        self._arm(self.start_ns + int(timeouts.headers_s * 1e9))

    # deadlines ----------------------------------------------------------------------------
    def _arm(self, deadline_ns: int) -> None:
        if self.handle is not None:
            self.handle.cancel()
        deadline_ns = min(deadline_ns, self.total_ns)
        self.handle = self.loop.call_later(max(0.0, (deadline_ns - _perf()) / 1e9), self._on_deadline)

    def _on_deadline(self) -> None:
        self.handle = None
        if self.done:
            return
        now = _perf()
        t = self.timeouts
        if now >= self.total_ns - 1_000_000:
            return self.end(now, Outcome.TOTAL_TIMEOUT, f"total timeout {t.total_s}s")
        if self.phase == "stall":
            due = self.last_event_ns + int(t.stall_s * 1e9)
            if now < due:  # events arrived since the timer was armed: lazily re-arm
                return self._arm(due)
            return self.end(now, Outcome.STALL, f"stall timeout after {t.stall_s}s")
        outcome, limit = {
            "headers": (Outcome.HEADERS_TIMEOUT, t.headers_s),
            "error body": (Outcome.HEADERS_TIMEOUT, t.headers_s),
            "first token": (Outcome.FIRST_TOKEN_TIMEOUT, t.first_token_s),
        }[self.phase]
        self.end(now, outcome, f"{self.phase} timeout after {limit}s")

    # httptools callbacks ------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.ctype = value

    def on_headers_complete(self) -> None:
        if self.done:
            return
        conn = self.conn
        assert conn is not None
        status = conn.parser.get_status_code()
        self.status = status
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
        events = self.sse.feed(body)
        if events:
            self._events(events, now)

    def on_message_complete(self) -> None:
        self.message_complete = True
        if self.done:
            if self.conn is not None:
                self.conn.message_complete()
            return
        if self.phase == "error body":
            self._http_error(self.now)
        else:
            self._eof(self.now)

    # stream logic ---------------------------------------------------------------------------
    def _events(self, events: list, now: int) -> None:
        timer = self.timer
        try:
            for ev in events:
                status = timer.event(now, ev.data)
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
                self._events(events, now)
        except StreamProtocolError as exc:
            return self.end(now, Outcome.MALFORMED, str(exc))
        if not self.done:
            self.end(now, Outcome.DISCONNECT, "stream ended before [DONE]")

    def end(self, now: int, outcome: Outcome, error: str = "") -> None:
        if self.done:
            return
        self.done = True
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
        result = self.timer.finish(now, outcome, error)
        self.result = result
        if self.conn is not None:
            self.conn.exchange_ended(self)
        if not self.future.done():
            self.future.set_result(result)


class H1Connection(asyncio.BufferedProtocol):
    """One keep-alive HTTP/1.1 connection carrying one exchange at a time.

    A BufferedProtocol, so asyncio ``recv_into``s a buffer allocated once: plain ``Protocol``
    makes asyncio ``recv(256 KiB)`` per read, and allocating 256 KiB goes through mmap and page
    faults (measured here: ~18 us per read vs ~3 us with a reused 64 KiB buffer)."""

    def __init__(self, on_idle: Callable[[H1Connection], None]) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self.parser: Any = None
        self.pending: list[tuple[int, bytearray]] = []
        self.scheduled = False
        self.closed = False
        self.idle_since = 0.0
        self._on_idle = on_idle
        self.draining = False  # the exchange ended at [DONE]; waiting for the chunked trailer
        self._buf = bytearray(_READ_SIZE)
        self._view = memoryview(self._buf)

    # asyncio.Protocol -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._view

    def buffer_updated(self, nbytes: int) -> None:
        # 1. the clock first: this is when the bytes came off the socket
        self.pending.append((_perf(), self._buf[:nbytes]))
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self._drain)

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.pending:
            self._drain()
        self.closed = True
        ex = self.exchange
        if ex is not None and not ex.done:
            ex._eof(_perf())

    # parsing ----------------------------------------------------------------------------------
    def _drain(self) -> None:
        self.scheduled = False
        pending, self.pending = self.pending, []
        for t_ns, data in pending:
            ex = self.exchange
            if ex is None or self.closed:
                # Bytes with no request in flight (or after the end): the connection is in an
                # unknown state; never reuse it.
                self.close()
                return
            ex.now = t_ns
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                ex.end(t_ns, Outcome.MALFORMED, "server tried to upgrade the connection")
                self.close()
                return
            except httptools.HttpParserError as exc:
                cause = exc.__context__
                if isinstance(cause, StreamProtocolError):
                    ex.end(t_ns, Outcome.MALFORMED, str(cause))
                else:
                    ex.end(t_ns, Outcome.DISCONNECT, f"invalid HTTP response: {exc}")
                self.close()
                return

    # exchanges ---------------------------------------------------------------------------------
    def start(self, ex: Exchange, request: bytes) -> None:
        self.exchange = ex
        ex.conn = self
        self.draining = False
        self.parser = httptools.HttpResponseParser(ex)
        assert self.transport is not None
        self.transport.write(request)

    def exchange_ended(self, ex: Exchange) -> None:
        if self.closed:
            return
        if ex.message_complete:
            if self.parser.should_keep_alive():
                self._release()
            else:
                self.close()
        elif ex.timer.done:
            # [DONE] came; the chunked terminator usually follows in the same packet or the
            # next. Keep feeding the same parser (the ended exchange ignores the bytes) and
            # reuse the connection once the message is complete.
            self.draining = True
        else:
            # Anything else ended mid-body: close, so the server sees the client go away
            # (vLLM aborts the request) instead of streaming into the void.
            self.close()

    def message_complete(self) -> None:
        if self.draining and not self.closed:
            if self.parser.should_keep_alive():
                self._release()
            else:
                self.close()

    def _release(self) -> None:
        self.draining = False
        self.exchange = None
        self.idle_since = self.loop.time()
        self._on_idle(self)

    def close(self) -> None:
        self.closed = True
        self.draining = False
        self.exchange = None
        if self.transport is not None:
            self.transport.close()


def request_bytes(host: str, path: str, headers: dict[str, str], body: bytes) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"host: {host}", f"content-length: {len(body)}"]
    for name, value in headers.items():
        if any(c in name or c in value for c in "\r\n\0"):
            raise ValueError(f"header {name!r}: name and value must not contain CR, LF or NUL")
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
