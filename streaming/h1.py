"""The lean HTTP/1.1 streaming path for plain-http variants: its own socket reads + httptools.

Why not httpx here: profiling 64 concurrent streams showed ~100-200 us of CPU per streamed token,
over half of it in httpx/httpcore/h11/anyio layers, one task wake-up per chunk and one
``asyncio.timeout`` reschedule per chunk. While the loop is busy with one chunk the other
sockets' bytes wait in the kernel, and that wait is measurement error. Here:

1. Each read is stamped before anything else is done with it. Bytes stamped by the clock read
   only (no kernel stamp, see 4.) are queued as ``(t_ns, bytes)`` and parsed in one
   ``call_soon`` after every socket that was ready in this loop iteration has been read, so the
   timestamps of a burst are not delayed by each other's parsing; bytes with a kernel stamp are
   parsed at once (their stamp does not depend on when they are read).
2. HTTP framing (status, headers, chunked encoding) is parsed by httptools (C, llhttp); SSE
   events go straight from ``on_body`` into the StreamTimer, in callbacks: no task wakes up
   until the request is over (one wake-up per request, not per token).
3. Deadlines are one TimerHandle per exchange, re-armed lazily when it fires (for a later
   phase's deadline, or from the last event's time for the stall deadline) instead of
   rescheduled per phase or per chunk.
4. Kernel receive timestamps (Linux, on by default, see ``RX_TIMESTAMPS``): even with 1., the
   loop reads a burst's sockets one after another, so at 64 streams the last socket's clock read
   came ~2 ms after its bytes arrived. With ``SO_TIMESTAMPNS`` the kernel stamps each packet on
   arrival and ``recvmsg`` returns the stamp, so a socket read late still gets its arrival time.
   Any other platform, or a read without a stamp, falls back to the clock read of 1.
5. The connection owns its TCP socket (``open_connection`` creates and connects it) and reads
   it itself when the loop reports it readable (``loop.add_reader``, on the default loop and on
   uvloop alike), with no asyncio transport or protocol in between: one callback per read
   instead of four layers, the stamp taken from the same ``recvmsg`` (bench/RESULTS.md,
   "Replay CPU per token against vLLM's client").

HTTP/2 and TLS variants keep httpx (client.py picks the path).
"""

from __future__ import annotations

import asyncio
import platform
import socket
import struct
import sys
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
_SOL_SOCKET = socket.SOL_SOCKET
_OFFSET_MAX_AGE_NS = 1_000_000_000


def _enable_rx_timestamps(sock: socket.socket) -> bool:
    """Turn on kernel receive timestamps on a TCP socket this module created. False (and nothing
    changed) where that is not possible: not Linux, or the kernel refused."""
    if not _RX_STAMPS_SUPPORTED:
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
    except OSError:
        return False
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
    """Open a keep-alive connection on a TCP socket created here (kernel receive stamps are
    switched on before it connects; the connection reads it itself).

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
            stamps = want_stamps and _enable_rx_timestamps(sock)
            c0 = _perf()
            await loop.sock_connect(sock, addr)
            c1 = _perf()
            conn = H1Connection(sock, on_idle, stamps)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        except BaseException:
            sock.close()
            raise
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
        "body_started", "handle", "armed_ns", "deadline_ns", "conn", "done", "result",
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
        self.armed_ns = 0  # when the handle fires
        self.deadline_ns = 0  # the current phase's deadline (the stall phase's: see _on_deadline)
        self.conn: H1Connection | None = None
        self.done = False
        self.result: StreamResult | None = None
        self._arm(self.start_ns + int(timeouts.headers_s * 1e9))

    # deadlines ----------------------------------------------------------------------------
    # One timer handle per exchange, re-armed lazily: a phase whose deadline is later than the
    # armed one keeps it, and when it fires the current phase's deadline is checked and the
    # timer re-armed if that is still ahead. With the default timeouts a request shorter than
    # headers_s arms one timer in all (not one per phase; each costs a heap push and a cancel).
    def _arm(self, deadline_ns: int) -> None:
        deadline_ns = min(deadline_ns, self.total_ns)
        self.deadline_ns = deadline_ns
        if self.handle is not None:
            if self.armed_ns <= deadline_ns:
                return  # fires first; _on_deadline re-arms for this phase
            self.handle.cancel()
        self.armed_ns = deadline_ns
        self.handle = self.loop.call_later(max(0.0, (deadline_ns - _perf()) / 1e9), self._on_deadline)

    def _rearm(self, deadline_ns: int) -> None:
        self.handle = None
        self._arm(deadline_ns)

    def _on_deadline(self) -> None:
        self.handle = None
        if self.done:
            return
        now = _perf()
        t = self.timeouts
        if now >= self.total_ns - 1_000_000:
            return self.end(now, Outcome.TOTAL_TIMEOUT, f"total timeout {t.total_s}s")
        if self.phase == "stall":
            due = min(self.last_event_ns + int(t.stall_s * 1e9), self.total_ns)
            if now < due:  # events arrived since the timer was armed: lazily re-arm
                return self._rearm(due)
            return self.end(now, Outcome.STALL, f"stall timeout after {t.stall_s}s")
        if now < self.deadline_ns - 1_000_000:  # armed for an earlier phase's deadline
            return self._rearm(self.deadline_ns)
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
        events = self.sse.feed_data(body)
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
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
        result = self.timer.finish(now, outcome, error)
        self.result = result
        if self.conn is not None:
            self.conn.exchange_ended(self)
        if not self.future.done():
            self.future.set_result(result)


class H1Connection:
    """One keep-alive HTTP/1.1 connection carrying one exchange at a time, on a TCP socket it
    reads and writes itself (5. above).

    Reads go into one buffer allocated once (``recv_into``/``recvmsg_into``): a fresh
    ``recv(256 KiB)`` per read, as a plain asyncio Protocol gets, goes through mmap and page
    faults (measured here: ~18 us per read vs ~3 us with a reused 64 KiB buffer)."""

    def __init__(self, sock: socket.socket, on_idle: Callable[[H1Connection], None],
                 rx_timestamps: bool = False) -> None:  # fmt: skip
        self.loop = asyncio.get_running_loop()
        self.sock = sock  # non-blocking and connected (open_connection)
        self._fd = sock.fileno()
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
        self._bufs = (self._view,)
        self._out: bytearray | None = None  # request bytes the kernel did not take yet
        # Whether the socket's reads carry kernel receive stamps (open_connection sets it up).
        self.rx_timestamps = rx_timestamps
        self.rx_offset_ns = 0
        self.rx_floor_ns = 0  # stamps never go before the request write or an earlier stamp
        self.loop.add_reader(self._fd, self._on_readable)

    # socket I/O ---------------------------------------------------------------------------------
    def _on_readable(self) -> None:
        try:
            if self.rx_timestamps:
                n, ancdata, _, _ = self.sock.recvmsg_into(self._bufs, _CMSG_SPACE)
            else:
                n = self.sock.recv_into(self._view)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            return self._lost(exc)
        # 1. the clock first: this is when the bytes came off the socket
        t = _perf()
        if not n:
            return self._lost(None)  # the server closed its side
        if self.rx_timestamps:  # 4. or, better, when they arrived
            stamp = 0
            # The stamp in the control messages (CLOCK_REALTIME ns, 0: none); for TCP the
            # arrival time of the newest packet in the data returned.
            for level, kind, data in ancdata:
                if level == _SOL_SOCKET and kind == _SO_TIMESTAMPNS and len(data) >= 16:
                    sec, nsec = _TIMESPEC.unpack_from(data)
                    stamp = sec * 1_000_000_000 + nsec
            t = rx_stamp_ns(stamp, self.rx_offset_ns, t, self.rx_floor_ns)
            self.rx_floor_ns = t
            if stamp and not self.pending:
                # Stamped by the kernel on arrival: parsing them now delays no other socket's
                # stamp (1. is for clock reads). At once, without a copy or a callback of its own.
                self._feed(t, self._view[:n])
                return
        self.pending.append((t, self._buf[:n]))
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self._drain)

    def _write(self, data: bytes) -> None:
        if self._out is not None:
            self._out += data
            return
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            # Lost as a failed read would be (the exchange ends as a disconnect), from the loop
            # rather than inside start().
            self.loop.call_soon(self._lost, exc)
            return
        if sent < len(data):  # the send buffer is full: the rest when the socket is writable
            self._out = bytearray(memoryview(data)[sent:])
            self.loop.add_writer(self._fd, self._on_writable)

    def _on_writable(self) -> None:
        out = self._out
        if out is None or self.closed:
            return
        try:
            sent = self.sock.send(out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            return self._lost(exc)
        del out[:sent]
        if not out:
            self._out = None
            self.loop.remove_writer(self._fd)

    def _lost(self, exc: BaseException | None) -> None:
        """The connection is gone (EOF from the server, or a socket error): parse what was read,
        then end an exchange still running (``Exchange._eof`` says how)."""
        if self.closed:
            return
        if self.pending:
            self._drain()
        ex = self.exchange
        self.close()
        if ex is not None and not ex.done:
            ex._eof(_perf())

    # parsing ----------------------------------------------------------------------------------
    def _drain(self) -> None:
        self.scheduled = False
        pending, self.pending = self.pending, []
        for t_ns, data in pending:
            if not self._feed(t_ns, data):
                return

    def _feed(self, t_ns: int, data: Any) -> bool:
        """Parse bytes read at ``t_ns``; False when the connection was closed for them."""
        ex = self.exchange
        if ex is None or self.closed:
            # Bytes with no request in flight (or after the end): the connection is in an
            # unknown state; never reuse it.
            self.close()
            return False
        ex.now = t_ns
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            ex.end(t_ns, Outcome.MALFORMED, "server tried to upgrade the connection")
            self.close()
            return False
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            if isinstance(cause, StreamProtocolError):
                ex.end(t_ns, Outcome.MALFORMED, str(cause))
            else:
                ex.end(t_ns, Outcome.DISCONNECT, f"invalid HTTP response: {exc}")
            self.close()
            return False
        return True

    # exchanges ---------------------------------------------------------------------------------
    def start(self, ex: Exchange, request: bytes) -> None:
        self.exchange = ex
        ex.conn = self
        self.draining = False
        self.parser = httptools.HttpResponseParser(ex)
        if self.rx_timestamps:
            self.rx_offset_ns = realtime_offset()
            self.rx_floor_ns = ex.start_ns
        self._write(request)

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
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        try:
            self.loop.remove_reader(fd)
            if self._out is not None:
                self.loop.remove_writer(fd)
        except RuntimeError:  # its loop is closed already (a connection left from an earlier run)
            pass
        self._out = None
        self.sock.close()


def request_bytes(host: str, path: str, headers: dict[str, str], body: bytes) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"host: {host}", f"content-length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    head = "\r\n".join(lines)
    # No CR, LF or NUL inside any line: then the head holds exactly the CRLFs that join its
    # lines (three scans of the head, instead of three per header name and value).
    if "\0" in head or not head.count("\r") == head.count("\n") == len(lines) - 1:
        for name, value in headers.items():
            if any(c in name or c in value for c in "\r\n\0"):
                raise ValueError(f"header {name!r}: name and value must not contain CR, LF or NUL")
        raise ValueError("path and host must not contain CR, LF or NUL")
    return (head + "\r\n\r\n").encode("latin-1") + body
