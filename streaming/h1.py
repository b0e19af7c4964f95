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
4. Kernel receive timestamps (Linux, on by default, see ``RX_TIMESTAMPS``): even with 1., the
   loop reads a burst's sockets one after another, so at 64 streams the last socket's clock read
   came ~2 ms after its bytes arrived. With ``SO_TIMESTAMPNS`` the kernel stamps each packet on
   arrival and ``recvmsg`` returns the stamp, so a socket read late still gets its arrival time.
   The client creates and connects the TCP socket itself (``open_connection``) to set this up,
   then hands it to asyncio. Any platform, event loop (uvloop) or read without a stamp falls
   back to the clock read of 1.

HTTP/2 and TLS variants keep httpx (client.py picks the path).
"""

from __future__ import annotations

import asyncio
import functools
import platform
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import httptools

from streaming.result import Outcome, StreamResult
from streaming.sse import SSEParser
from streaming.timing import StreamProtocolError, StreamTimer

_ERROR_BODY_LIMIT = 2048
# Idle keep-alive connections older than this are dropped, not reused: uvicorn (vLLM, the
# simulator) closes idle connections after 5 s by default, and reusing one the server is closing
# turns a healthy request into a spurious DISCONNECT.
IDLE_EXPIRY_S = 4.0
_perf = time.perf_counter_ns
_READ_SIZE = 65536

# Kernel receive timestamps -------------------------------------------------------------------
# Set False (or pass rx_timestamps=False) to stamp reads with the clock read only: the benchmark
# compares both.
RX_TIMESTAMPS = True
# SO_TIMESTAMPNS is 35 in asm-generic and x86 (Python's socket module does not export it); other
# architectures (alpha, mips, parisc, sparc) number it differently, so they take the fallback.
_SO_TIMESTAMPNS = 35
_RX_STAMPS_SUPPORTED = sys.platform == "linux" and platform.machine() in {
    "x86_64", "amd64", "aarch64", "arm64", "riscv64",
}  # fmt: skip
_TIMESPEC = struct.Struct("@ll")  # struct timespec: two native longs (64-bit on these machines)
_CMSG_SPACE = socket.CMSG_SPACE(_TIMESPEC.size) if _RX_STAMPS_SUPPORTED else 0
_OFFSET_MAX_AGE_NS = 1_000_000_000


# The stamp of the latest recv_into on this thread (CLOCK_REALTIME ns, 0 = none). The selector
# transport calls buffer_updated right after recv_into, with no other read in between.
class _RxStamp(threading.local):
    ns = 0


_rx = _RxStamp()


class _RxStampSocket(socket.socket):
    """The socket open_connection made, re-classed before asyncio gets it, so the selector
    loop's own ``recv_into`` becomes a ``recvmsg_into`` that also keeps the kernel's receive
    timestamp. For TCP the stamp is the arrival time of the newest packet in the data returned."""

    __slots__ = ()

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        if nbytes:
            buffer = memoryview(buffer)[:nbytes]
        n, ancdata, _, _ = self.recvmsg_into((buffer,), _CMSG_SPACE, flags)
        stamp = 0
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS and len(data) >= 16:
                sec, nsec = _TIMESPEC.unpack_from(data)
                stamp = sec * 1_000_000_000 + nsec
        _rx.ns = stamp
        return n


def _enable_rx_timestamps(sock: socket.socket, loop: asyncio.AbstractEventLoop) -> bool:
    """Turn on kernel receive timestamps on a TCP socket this module created. False (and nothing
    changed) where that is not possible: not Linux, or an event loop that does not read through
    the socket object's ``recv_into`` (uvloop reads the fd in libuv), or the kernel refused."""
    if not _RX_STAMPS_SUPPORTED or not isinstance(loop, asyncio.SelectorEventLoop):
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    # Our own socket, not yet handed to asyncio: re-classing it reaches into nothing private.
    sock.__class__ = _RxStampSocket
    return True


async def _addresses(host: str, port: int, loop: asyncio.AbstractEventLoop) -> list[tuple]:
    """(family, address) to try in order. A numeric host skips getaddrinfo, which the default
    loop runs in a thread: one hop per new connection, as asyncio's own fast path avoids."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        return [(family, (host, port) if family == socket.AF_INET else (host, port, 0, 0))]
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    if not infos:
        raise OSError(f"getaddrinfo({host!r}, {port}) returned no addresses")
    return [(family, addr) for family, _, _, _, addr in infos]


async def open_connection(
    host: str, port: int, on_idle: Callable[[H1Connection], None], rx_timestamps: bool | None = None
) -> tuple[H1Connection, int, int]:
    """Open a keep-alive connection on a TCP socket created here (so kernel receive stamps can
    be switched on without touching asyncio's private transport attributes).

    Returns (connection, connect start ns, connect end ns): the two clock reads around
    ``sock_connect``, the TCP handshake alone. Addresses are tried in getaddrinfo order, as
    ``loop.create_connection`` does; the last error is raised when all fail. The caller's
    deadline (``asyncio.timeout``) covers name resolution too. Every failure, cancellation
    included, closes the socket it made: no fd outlives a failed attempt."""
    loop = asyncio.get_running_loop()
    want_stamps = RX_TIMESTAMPS if rx_timestamps is None else rx_timestamps
    error: OSError | None = None
    for family, addr in await _addresses(host, port, loop):
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            stamps = want_stamps and _enable_rx_timestamps(sock, loop)
            c0 = _perf()
            await loop.sock_connect(sock, addr)
            c1 = _perf()
            _, conn = await loop.create_connection(
                functools.partial(H1Connection, on_idle, stamps), sock=sock
            )
        except OSError as exc:
            sock.close()
            error = exc
            continue
        except BaseException:
            sock.close()
            raise
        conn.sock = sock
        return conn, c0, c1
    assert error is not None
    raise error


def sample_realtime_offset(tries: int = 5) -> tuple[int, int]:
    """(CLOCK_REALTIME - perf_counter clock, error bound), in ns. Each try reads perf, realtime,
    perf back to back; the realtime read lies between the two perf reads, so taking their
    midpoint is off by at most half the gap. The try with the smallest gap wins."""
    best_gap = best_offset = -1
    for _ in range(tries):
        a = _perf()
        real = time.time_ns()
        b = _perf()
        if best_gap < 0 or b - a < best_gap:
            best_gap, best_offset = b - a, real - (a + b) // 2
    return best_offset, (best_gap + 1) // 2


_offset_ns, _, _offset_at = *sample_realtime_offset(), _perf()


def realtime_offset() -> int:
    """The cached offset, re-sampled when older than a second: both clocks are slewed alike by
    NTP, but a step of the realtime clock moves the offset, and this bounds how long a stale one
    is used."""
    global _offset_ns, _offset_at
    now = _perf()
    if now - _offset_at > _OFFSET_MAX_AGE_NS:
        _offset_ns = sample_realtime_offset()[0]
        _offset_at = _perf()
    return _offset_ns


def rx_stamp_ns(rx_realtime_ns: int, offset_ns: int, now_ns: int, floor_ns: int) -> int:
    """A kernel receive stamp on the perf_counter clock. No stamp (0) gives ``now_ns``, the
    clock read; the result never lies after ``now_ns`` (bytes cannot arrive after they were
    read: a later stamp is offset error or a clock step) nor before ``floor_ns`` (the request
    was written, or an earlier read on the connection was stamped, then)."""
    if not rx_realtime_ns:
        return now_ns
    t = rx_realtime_ns - offset_ns
    if t > now_ns:
        return now_ns
    if t < floor_ns:
        return floor_ns
    return t


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

    def __init__(self, on_idle: Callable[[H1Connection], None], rx_timestamps: bool = False) -> None:
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
        # Whether the socket's reads carry kernel receive stamps (open_connection sets it up).
        self.rx_timestamps = rx_timestamps
        self.sock: socket.socket | None = None  # the socket open_connection made, if it did
        self.rx_offset_ns = 0
        self.rx_floor_ns = 0  # stamps never go before the request write or an earlier stamp

    # asyncio.Protocol -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._view

    def buffer_updated(self, nbytes: int) -> None:
        # 1. the clock first: this is when the bytes came off the socket
        t = _perf()
        if self.rx_timestamps:  # 4. or, better, when they arrived
            t = rx_stamp_ns(_rx.ns, self.rx_offset_ns, t, self.rx_floor_ns)
            _rx.ns = 0  # consumed: a read that brings no stamp must not reuse this one
            self.rx_floor_ns = t
        self.pending.append((t, self._buf[:nbytes]))
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
        if self.rx_timestamps:
            self.rx_offset_ns = realtime_offset()
            self.rx_floor_ns = ex.start_ns
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
