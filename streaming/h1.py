"""The one HTTP/1.1 connection core: the replay's client and the gateway's upstream both speak
HTTP/1.1 to variants through it. It owns the sockets, the framing, the deadlines' timer and the
keep-alive pool; what a response means is its exchange's business (the sink):
``streaming/timed_exchange.py`` measures and stores (the replay), ``gateway/upstream.py``
forwards, then measures (the gateway).

Why not httpx here: profiling 64 concurrent streams showed ~100-200 us of CPU per streamed
token, over half of it in httpx/httpcore/h11/anyio layers, one task wake-up per chunk and one
``asyncio.timeout`` reschedule per chunk. While the loop is busy with one chunk the other
sockets' bytes wait in the kernel, and that wait is measurement error. Here:

1. Each read is stamped before anything else is done with it. Bytes stamped by the clock read
   only (no kernel stamp, see 4.) are queued as ``(t_ns, bytes)`` and parsed in one
   ``call_soon`` after every socket that was ready in this loop iteration has been read, so the
   timestamps of a burst are not delayed by each other's parsing; bytes with a kernel stamp are
   parsed at once (their stamp does not depend on when they are read).
2. HTTP framing (status, headers, chunked encoding) is parsed by httptools (C, llhttp), whose
   callbacks go straight to the exchange (``Exchange``: ``on_body`` with ``now`` set to the
   read's stamp): no task wakes up per chunk.
3. Deadlines: one ``Deadline`` (a TimerHandle) per exchange, re-armed lazily when it fires
   (for a later phase's deadline, or from the last read's time for the stall deadline) instead
   of rescheduled per phase or per chunk.
4. Kernel receive timestamps (Linux, on by default, see ``RX_TIMESTAMPS``): even with 1., the
   loop reads a burst's sockets one after another, so at 64 streams the last socket's clock read
   came ~2 ms after its bytes arrived. With ``SO_TIMESTAMPNS`` the kernel stamps each packet on
   arrival and ``recvmsg`` returns the stamp, so a socket read late still gets its arrival time.
   Any other platform, or a read without a stamp, falls back to the clock read of 1.
5. The connection owns its TCP socket (``open_connection`` creates and connects it) and reads
   it itself when the loop reports it readable (``loop.add_reader``, on the default loop and on
   uvloop alike), with no asyncio transport or protocol in between: one callback per read
   instead of four layers, the stamp taken from the same ``recvmsg`` (bench/RESULTS.md,
   "Replay CPU per token against vLLM's client"). TLS (``TLSConnection``) goes through asyncio's
   SSL transport instead, with clock stamps: the same parsing, deadlines and pool.
6. Reads held for the end of the pass (``defer_reads``, set by the exchange): an engine emits a
   token for every running request in one step, so reads come in bursts, one per stream. A
   forwarded stream past its first token holds its reads until after the pass's other reads
   and the request tasks the pass woke (a ``call_soon`` that re-queues itself once), in arrival
   order with their arrival stamps, so another stream's first token, the TTFT of the SLA, waits
   for the other first tokens of the burst only.
7. Keep-alive (``Pool``): idle connections are reused for ``IDLE_EXPIRY_S``; bytes with no
   request in flight, or after a response's end, mean the connection is in an unknown state: it
   is closed, never reused. Egress (streaming/egress.py): with an allowlist, every new
   connection resolves the host itself, checks every address and dials only checked ones.
"""

from __future__ import annotations

import asyncio
import functools
import platform
import socket
import ssl
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

import httptools

from streaming.egress import Allowlist, allowed_addresses
from streaming.rx_clock import realtime_offset, rx_stamp_ns

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
    "x86_64",
    "amd64",
    "aarch64",
    "arm64",
    "riscv64",
}
_TIMESPEC = struct.Struct("@ll")  # struct timespec: two native longs (64-bit on these machines)
_CMSG_SPACE = socket.CMSG_SPACE(_TIMESPEC.size) if _RX_STAMPS_SUPPORTED else 0
_SOL_SOCKET = socket.SOL_SOCKET


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
    host: str,
    port: int,
    on_idle: Callable[[H1Connection], None],
    rx_timestamps: bool | None = None,
    *,
    on_close: Callable[[H1Connection], None] | None = None,
    ssl_context: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
) -> tuple[H1Connection, int, int]:
    """Open a keep-alive connection on a TCP socket created here (kernel receive stamps are
    switched on before it connects; the connection reads it itself), or with ``ssl_context`` a
    TLS connection on it (``server_hostname``: the name the certificate is checked against).

    Returns (connection, connect start ns, connect end ns): the two clock reads around the TCP
    handshake (and, over TLS, the TLS handshake too). Addresses are tried in getaddrinfo order,
    as ``loop.create_connection`` does; the last error is raised when all fail (a certificate
    that does not verify is an ``ssl.SSLError``, an OSError). The caller's deadline
    (``asyncio.timeout``) covers name resolution too. Every failure, cancellation included,
    closes the socket it made: no fd outlives a failed attempt."""
    loop = asyncio.get_running_loop()
    want_stamps = ssl_context is None and (RX_TIMESTAMPS if rx_timestamps is None else rx_timestamps)
    error: OSError | None = None
    for family, addr in await _addresses(host, port, loop):
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            stamps = want_stamps and _enable_rx_timestamps(sock)
            c0 = _perf()
            await loop.sock_connect(sock, addr)
            if ssl_context is None:
                conn: H1Connection = H1Connection(sock, on_idle, stamps, on_close=on_close)
            else:
                tls = TLSConnection(on_idle, on_close=on_close)
                await loop.create_connection(
                    functools.partial(_TLSProtocol, tls),
                    sock=sock,
                    ssl=ssl_context,
                    server_hostname=server_hostname or host,
                )
                conn = tls
            c1 = _perf()
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


class Deadline:
    """One timer handle for an exchange's deadlines, re-armed lazily: ``set`` to a later time
    keeps the armed handle (when it fires early it re-arms for the time set since), to an
    earlier one re-arms it. A request shorter than its first deadline arms one timer in all, not
    one per phase (each costs a heap push and a cancel). ``fire(now)`` is called at the time last
    set, at most once per set."""

    __slots__ = ("loop", "fire", "handle", "armed_ns", "due_ns")

    def __init__(self, loop: asyncio.AbstractEventLoop, fire: Callable[[int], None]) -> None:
        self.loop = loop
        self.fire = fire
        self.handle: asyncio.TimerHandle | None = None
        self.armed_ns = 0
        self.due_ns = 0

    def set(self, due_ns: int) -> None:
        self.due_ns = due_ns
        if self.handle is not None:
            if self.armed_ns <= due_ns:
                return  # fires first; _expired re-arms for the time set now
            self.handle.cancel()
        self.armed_ns = due_ns
        self.handle = self.loop.call_later(max(0.0, (due_ns - _perf()) / 1e9), self._expired)

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def close(self) -> None:
        """Cancel for good, dropping the callback: it is the exchange's own method, and a cycle
        left behind per request is work for the cyclic collector, whose passes pause the event
        loop (bench/RESULTS.md, "Gateway overhead")."""
        self.cancel()
        self.fire = _ignore

    def _expired(self) -> None:
        self.handle = None
        now = _perf()
        if now < self.due_ns - 1_000_000:  # armed for an earlier time than the one set since
            self.set(self.due_ns)
            return
        self.fire(now)


def _ignore(now: int) -> None:
    pass


class Exchange:
    """One request/response on one connection, the base every user of the core extends (the
    sink). The connection's parser calls its httptools callbacks, with ``now`` set to the stamp
    of the read being parsed; a subclass implements ``on_body`` and the hooks below. When it is
    done with the response it calls ``conn.finish(self)``; that reuses, drains or closes the
    connection."""

    __slots__ = ("conn", "now", "status", "headers", "keep_alive", "message_complete")

    def __init__(self) -> None:
        self.conn: H1Connection | None = None
        self.now = 0
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []  # names lower-cased
        # Whether the server keeps the connection open after this response: read when the
        # headers are complete (the parser forgets it once the message is over).
        self.keep_alive = False
        self.message_complete = False

    # httptools callbacks --------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        conn = self.conn
        assert conn is not None
        self.status = conn.parser.get_status_code()
        self.keep_alive = conn.parser.should_keep_alive()
        self.response_head()

    def on_body(self, body: bytes) -> None:
        raise NotImplementedError

    def on_message_complete(self) -> None:
        self.message_complete = True
        conn = self.conn
        if conn is not None and conn.draining:
            conn.drained()
            return
        self.response_end()

    # what a sink does --------------------------------------------------------------------------
    def response_head(self) -> None:
        """The status and headers are in (at ``now``)."""

    def response_end(self) -> None:
        """The body ended (at ``now``)."""

    def lost(self, now: int, exc: BaseException | None) -> None:
        """The connection closed (``exc`` None: the server closed it) or failed before the
        exchange let it go."""

    def broken(self, now: int, exc: Exception) -> None:
        """The response is not valid HTTP/1.1 (``httptools.HttpParserUpgrade``: the server
        tried to upgrade the connection); the connection is closed right after."""


class H1Connection:
    """One keep-alive HTTP/1.1 connection carrying one exchange at a time, on a TCP socket it
    reads and writes itself (5. above).

    Reads go into one buffer allocated once (``recv_into``/``recvmsg_into``): a fresh
    ``recv(256 KiB)`` per read, as a plain asyncio Protocol gets, goes through mmap and page
    faults (measured here: ~18 us per read vs ~3 us with a reused 64 KiB buffer)."""

    def __init__(
        self,
        sock: socket.socket | None,
        on_idle: Callable[[H1Connection], None],
        rx_timestamps: bool = False,
        *,
        on_close: Callable[[H1Connection], None] | None = None,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.sock = sock  # non-blocking and connected (open_connection); None over TLS
        self._fd = sock.fileno() if sock is not None else -1
        self.exchange: Exchange | None = None
        self.parser: Any = None
        self.pending: list[tuple[int, Any]] = []
        self.scheduled = False
        self.closed = False
        self.paused = False
        self.idle_since = 0.0
        self._on_idle = on_idle
        self._on_close = on_close
        self.draining = False  # the exchange ended before its message did: waiting for the rest
        # 6.: set by the exchange; reads wait for the end of the loop pass (and its woken tasks)
        self.defer_reads = False
        self.last_read_ns = 0  # the stamp of the latest read, parsed or not (stall deadlines)
        self._buf = bytearray(_READ_SIZE)
        self._view = memoryview(self._buf)
        self._bufs = (self._view,)
        self._out: bytearray | None = None  # request bytes the kernel did not take yet
        # Whether the socket's reads carry kernel receive stamps (open_connection sets it up).
        self.rx_timestamps = rx_timestamps
        self.rx_offset_ns = 0
        self.rx_floor_ns = 0  # stamps never go before the request write or an earlier stamp
        if self._fd >= 0:
            self.loop.add_reader(self._fd, self._on_readable)

    # socket I/O ---------------------------------------------------------------------------------
    def _on_readable(self) -> None:
        try:
            if self.rx_timestamps:
                n, ancdata, _, _ = self.sock.recvmsg_into(self._bufs, _CMSG_SPACE)  # type: ignore[union-attr]
            else:
                n = self.sock.recv_into(self._view)  # type: ignore[union-attr]
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
            if stamp and not self.pending and not self.defer_reads:
                # Stamped by the kernel on arrival: parsing them now delays no other socket's
                # stamp (1. is for clock reads). At once, without a copy or a callback of its own.
                self.last_read_ns = t
                self._feed(t, self._view[:n])
                return
        self.received(t, self._buf[:n])

    def received(self, t_ns: int, data: Any) -> None:
        """Bytes read at ``t_ns``, parsed at the end of this loop pass (1., 6.)."""
        self.last_read_ns = t_ns
        self.pending.append((t_ns, data))
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self._drain_after_tasks if self.defer_reads else self._drain)

    def _write(self, data: bytes) -> None:
        if self._out is not None:
            self._out += data
            return
        try:
            sent = self.sock.send(data)  # type: ignore[union-attr]
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
            sent = self.sock.send(out)  # type: ignore[union-attr]
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            return self._lost(exc)
        del out[:sent]
        if not out:
            self._out = None
            self.loop.remove_writer(self._fd)

    def pause(self) -> None:
        """Stop reading (the exchange's consumer is slow): the server's bytes wait in the
        kernel, and TCP flow control holds the server."""
        if not self.paused and not self.closed:
            self.paused = True
            self.loop.remove_reader(self._fd)

    def resume(self) -> None:
        if self.paused and not self.closed:
            self.paused = False
            self.loop.add_reader(self._fd, self._on_readable)

    def _lost(self, exc: BaseException | None) -> None:
        """The connection is gone (EOF from the server, or a socket error): parse what was read,
        then tell an exchange still holding it."""
        if self.closed:
            return
        if self.pending:
            self._drain()
        ex = self.exchange
        self.close()
        if ex is not None:
            ex.lost(_perf(), exc)

    # parsing ----------------------------------------------------------------------------------
    def _drain_after_tasks(self) -> None:
        # Once more to the back of the queue: the request tasks this pass woke (a new user's
        # request, written upstream in its first step) run before the held-back reads.
        self.loop.call_soon(self._drain)

    def _drain(self) -> None:
        """The reads queued so far, in arrival order, each with its stamp."""
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
        except (httptools.HttpParserUpgrade, httptools.HttpParserError) as exc:
            ex.broken(t_ns, exc)
            self.close()
            return False
        return True

    # exchanges ---------------------------------------------------------------------------------
    def start(self, ex: Exchange, request: bytes, floor_ns: int = 0) -> None:
        """Write ``request`` for ``ex``. ``floor_ns``: no read of its response is stamped
        earlier (the request's clock start; default: now)."""
        self.exchange = ex
        ex.conn = self
        self.draining = False
        self.defer_reads = False
        self.parser = httptools.HttpResponseParser(ex)
        if self.rx_timestamps:
            self.rx_offset_ns = realtime_offset()
            self.rx_floor_ns = floor_ns or _perf()
        self._write(request)

    def finish(self, ex: Exchange, drain: bool = False) -> None:
        """``ex`` is done with the connection: back to the pool when its response is complete
        and the server keeps the connection alive; with ``drain`` and the response not complete
        yet (the stream's last event came, the chunked terminator not yet), parsing goes on (the
        exchange ignores the bytes) and the connection is reused once the message is complete;
        otherwise closed, so the server sees the client go away (vLLM aborts the request)
        instead of streaming into the void."""
        if self.closed or self.exchange is not ex:
            return
        if ex.message_complete:
            if ex.keep_alive and not self.pending:
                self._release()
            else:
                self.close()
        elif drain:
            self.draining = True
        else:
            self.close()

    def drained(self) -> None:
        if self.draining and not self.closed:
            if self.exchange is not None and self.exchange.keep_alive:
                self._release()
            else:
                self.close()

    def _release(self) -> None:
        self.draining = False
        self.defer_reads = False
        self.exchange = None
        self.parser = None  # it holds the exchange: no cycle left behind (Deadline.close)
        self.resume()  # a paused read (flow control) must not outlive its exchange
        self.idle_since = self.loop.time()
        self._on_idle(self)

    def close(self) -> None:
        self.closed = True
        self.draining = False
        self.exchange = None
        self.parser = None
        self._close_io()
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close(self)

    def _close_io(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            try:
                if not self.paused:
                    self.loop.remove_reader(fd)
                if self._out is not None:
                    self.loop.remove_writer(fd)
            except RuntimeError:  # its loop is closed already (a connection left from an earlier run)
                pass
            self._out = None
            assert self.sock is not None
            self.sock.close()


class TLSConnection(H1Connection):
    """The same connection over asyncio's SSL transport: reads come from ``_TLSProtocol``
    stamped by the clock (decrypted bytes carry no kernel stamp), writes go to the transport."""

    def __init__(
        self,
        on_idle: Callable[[H1Connection], None],
        *,
        on_close: Callable[[H1Connection], None] | None = None,
    ) -> None:
        super().__init__(None, on_idle, False, on_close=on_close)
        self.transport: asyncio.Transport | None = None

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def pause(self) -> None:
        if not self.paused and not self.closed and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and not self.closed and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def _close_io(self) -> None:
        transport, self.transport = self.transport, None
        if transport is not None:
            transport.abort()


class _TLSProtocol(asyncio.Protocol):
    __slots__ = ("conn",)

    def __init__(self, conn: TLSConnection) -> None:
        self.conn = conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.conn.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.conn.received(_perf(), data)  # 1.: the clock first

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn._lost(exc)


class Pool:
    """Keep-alive connections to one host and port, for one event loop (7. above). ``take``
    an idle one or ``open`` a new one; a connection comes back by itself when its exchange
    finishes with it (``H1Connection.finish``) and leaves when it closes."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        allow: Allowlist | None = None,
        ssl_context: ssl.SSLContext | None = None,
        rx_timestamps: bool | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.allow = allow
        self.ssl_context = ssl_context
        self.rx_timestamps = rx_timestamps
        self._idle: list[H1Connection] = []
        self._all: set[H1Connection] = set()

    def take(self, loop: asyncio.AbstractEventLoop) -> H1Connection | None:
        """The most recently idled connection still fresh enough, on this loop; None if none."""
        now = loop.time()
        while self._idle:
            conn = self._idle.pop()
            if conn.closed or conn.loop is not loop or now - conn.idle_since > IDLE_EXPIRY_S:
                conn.close()
                continue
            return conn
        return None

    async def open(self) -> tuple[H1Connection, int, int]:
        """A new connection (open_connection: the connect's clock reads with it); with an
        allowlist, to the host's checked addresses only, in resolution order (EgressRefused
        when none is allowed). The caller's deadline covers it."""
        if self.allow is None:
            addresses = [self.host]
        else:
            addresses = await allowed_addresses(self.host, self.port, self.allow)
        error: OSError | None = None
        for address in addresses:
            try:
                conn, c0, c1 = await open_connection(
                    address,
                    self.port,
                    self._idle.append,
                    self.rx_timestamps,
                    on_close=self._forget,
                    ssl_context=self.ssl_context,
                    server_hostname=self.host,
                )
            except OSError as exc:
                error = exc
                continue
            self._all.add(conn)
            return conn, c0, c1
        assert error is not None
        raise error

    def connections(self) -> list[H1Connection]:
        """The connections open now, idle or carrying an exchange."""
        return [c for c in self._all if not c.closed]

    def _forget(self, conn: H1Connection) -> None:
        self._all.discard(conn)
        try:
            self._idle.remove(conn)
        except ValueError:
            pass

    def close(self) -> None:
        for conn in list(self._all) + self._idle:
            conn.close()
        self._all.clear()
        self._idle.clear()


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
