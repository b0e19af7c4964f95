"""The gateway's upstream HTTP/1.1 client: forward a request to a variant, hand back its bytes.

Why not httpx: the gateway's per-chunk path is "bytes in from the variant, the same bytes out
to the user"; httpx adds its layers (httpcore, h11, anyio) and a task wake-up per chunk. Here a
connection is an asyncio Protocol with httptools (C) for the framing, as in streaming/h1.py:

1. ``data_received`` stamps each read (``time.perf_counter_ns``, the replay's clock) before
   anything else, and queues ``(t_ns, body bytes)``; the request's task wakes once per loop
   pass however many reads came, and forwards them.
2. Deadlines: connect and response headers under ``asyncio.timeout``; after the headers one
   lazily re-armed TimerHandle per exchange covers the stall deadline (gap between reads) and
   the total one, instead of a timeout rescheduled per chunk.
3. Flow control: past ``HIGH_WATER`` queued bytes (a slow user) reading from the variant pauses.
4. First tokens first: an engine emits a token for every running request in one step, so reads
   come in bursts, one per stream. A stream whose first content has gone out marks its exchange
   ``defer_reads``; its reads are then stamped on arrival and parsed and forwarded after the
   loop pass's other reads and after the request tasks the pass woke (a ``call_soon`` that
   re-queues itself once, per connection, in arrival order), so a stream's first token and a
   new user's request, the TTFT of the SLA, wait for the other first tokens of the burst only.
   The others' bytes go out one pass later; the figures keep the arrival stamps.
5. Egress (streaming/egress.py, as streaming/client.py applies it): with an allowlist, every new
   connection resolves the host itself, checks every address and dials only checked ones; TLS
   still verifies the certificate against the URL's host (SNI).
6. Keep-alive: idle connections are reused for ``IDLE_EXPIRY_S``; a reused one that closes
   before any byte of the response is retried once on a new connection (the server had closed
   it idle: it never saw the request).

HTTP/2 variants are spoken to over HTTP/1.1 here (both serve the same OpenAI API).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

import httptools

from streaming.client import allowed_addresses
from streaming.egress import Allowlist, EgressError, EgressRefused, split_url
from streaming.h1 import IDLE_EXPIRY_S, request_bytes
from streaming.result import Outcome

_perf = time.perf_counter_ns
HIGH_WATER = 1 << 20
LOW_WATER = 1 << 16


class UpstreamError(Exception):
    """The variant gave no response: the outcome class and a message safe to show."""

    def __init__(self, outcome: Outcome, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where one variant is: parsed once from its base URL."""

    scheme: str
    host: str
    port: int
    base_path: str  # the URL's path without a trailing /v1 (the API paths carry /v1)
    host_header: str

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        try:
            split_url(url)  # http(s) only, no credentials
        except EgressError as exc:
            raise ValueError(f"endpoint: {exc}") from None
        base = url.rstrip("/")
        if base.endswith("/v1"):
            base = base[:-3]
        parts = urllib.parse.urlsplit(base)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host_header = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
        return cls(parts.scheme, host, port, parts.path.rstrip("/"), host_header)


@dataclass(frozen=True, slots=True)
class Deadlines:
    connect_s: float = 5.0
    headers_s: float = 60.0
    stall_s: float = 60.0
    total_s: float = 600.0


class Exchange:
    """One request on one connection, as the gateway's request task sees it."""

    __slots__ = (
        "conn", "status", "headers", "keep_alive", "complete", "error", "sent_ns", "connected",
        "connect_started_ns", "connect_done_ns", "headers_ns", "_chunks", "_queued", "_waiter", "_headers_fut", "_timer",
        "_last_ns", "_total_deadline_ns", "_stall_ns", "_paused", "_got_bytes", "_sink", "on_head", "on_end",
        "defer_reads",
    )  # fmt: skip

    def __init__(self, conn: _Connection, deadlines: Deadlines) -> None:
        self.conn = conn
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        self.complete = False
        self.error: UpstreamError | None = None
        self.sent_ns = 0
        self.connected = False  # a new connection was opened for this request
        self.connect_started_ns = 0
        self.connect_done_ns = 0
        self.headers_ns = 0
        self._chunks: list[tuple[int, bytes]] = []
        self._queued = 0
        self._waiter: asyncio.Future | None = None
        self._headers_fut: asyncio.Future = conn.loop.create_future()
        self._timer: asyncio.TimerHandle | None = None
        self._last_ns = 0
        self._total_deadline_ns = 0
        self._stall_ns = int(deadlines.stall_s * 1e9)
        self._paused = False
        self._got_bytes = False
        self._sink: Callable[[int, bytes], None] | None = None
        # Called in the read callback when the headers are complete (before any body byte is
        # handed on), so the response can start without waiting for the request's task.
        self.on_head: Callable[[Exchange], None] | None = None
        # Called in the read callback when the body is complete (after its last on_body).
        self.on_end: Callable[[], None] | None = None
        # Set by the gateway once this stream's first content went out: its reads may wait for
        # the end of the loop pass (point 4 above).
        self.defer_reads = False

    # called by the connection ---------------------------------------------------------------
    def on_status(self, status: int) -> None:
        self.status = status

    def on_headers(self, headers: list[tuple[bytes, bytes]], keep_alive: bool, t_ns: int) -> None:
        self.headers = headers
        self.keep_alive = keep_alive
        self.headers_ns = t_ns
        if self.on_head is not None:
            self.on_head(self)
        if not self._headers_fut.done():
            self._headers_fut.set_result(None)

    def on_body(self, t_ns: int, body: bytes) -> None:
        sink = self._sink
        if sink is not None:
            sink(t_ns, body)  # straight on, inside the read callback: no task wake-up
            return
        self._chunks.append((t_ns, body))
        self._queued += len(body)
        if self._queued > HIGH_WATER and not self._paused:
            self._paused = True
            self.conn.pause()
        self._wake()

    def on_complete(self) -> None:
        self.complete = True
        if self.on_end is not None:
            self.on_end()
        self._wake()

    def on_bytes(self, t_ns: int) -> None:
        """Bytes arrived (stamped ``t_ns``), before they are parsed: the stall deadline counts
        gaps between arrivals, whether or not a read was held back (point 4)."""
        self._got_bytes = True
        self._last_ns = t_ns

    def fail(self, error: UpstreamError) -> None:
        if self.complete or self.error is not None:
            return
        self.error = error
        if not self._headers_fut.done():
            self._headers_fut.set_result(None)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # called by the gateway ------------------------------------------------------------------
    async def wait_headers(self, timeout_s: float) -> None:
        """Until the response headers came; UpstreamError for what happened instead."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._headers_fut
        except TimeoutError:
            self.fail(UpstreamError(Outcome.HEADERS_TIMEOUT, f"no response headers within {timeout_s:g} s"))
        if self.error is not None and not self.headers_ns:
            raise self.error

    def arm(self, total_deadline_ns: int) -> None:
        """Start the stall and total deadlines (after the headers)."""
        self._total_deadline_ns = total_deadline_ns
        self._last_ns = max(self._last_ns, self.headers_ns) or _perf()  # the latest arrival so far
        self._rearm()

    def _rearm(self) -> None:
        due = min(self._last_ns + self._stall_ns, self._total_deadline_ns)
        self._timer = self.conn.loop.call_later(max(0.0, (due - _perf()) / 1e9), self._on_deadline)

    def _on_deadline(self) -> None:
        self._timer = None
        if self.complete or self.error is not None:
            return
        now = _perf()
        if now >= self._total_deadline_ns:
            self.fail(UpstreamError(Outcome.TOTAL_TIMEOUT, "total timeout"))
            self.conn.abort()
        elif now - self._last_ns >= self._stall_ns:
            self.fail(UpstreamError(Outcome.STALL, f"no bytes for {self._stall_ns / 1e9:g} s"))
            self.conn.abort()
        else:
            self._rearm()

    def set_sink(self, sink: Callable[[int, bytes], None]) -> None:
        """From now on every read goes to ``sink(t_ns, body)`` as it arrives (after what had
        queued); ``finished()`` waits for the end. The sink must not raise."""
        queued, self._chunks, self._queued = self._chunks, [], 0
        for t_ns, body in queued:
            sink(t_ns, body)
        self._sink = sink
        if self._paused:
            self._paused = False
            self.conn.resume()

    async def finished(self) -> None:
        """Until the body ended or failed (``error`` says which)."""
        while not (self.complete or self.error is not None):
            self._waiter = self.conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def chunks(self) -> list[tuple[int, bytes]]:
        """The reads queued since the last call, waiting for one if there is none; [] at the
        end of the body or after an error (then ``error`` says which)."""
        while not self._chunks:
            if self.complete or self.error is not None:
                return []
            self._waiter = self.conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        out = self._chunks
        self._chunks = []
        self._queued = 0
        if self._paused:
            self._paused = False
            self.conn.resume()
        return out

    def close(self) -> None:
        """Done with the response: the connection goes back to the pool if it is reusable.
        The callbacks are dropped: they are the forwarder's, which holds this exchange, and a
        cycle left behind per request is work for the cyclic collector, whose passes pause the
        event loop (bench/RESULTS.md, "Gateway overhead")."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.conn.release(self)
        self._sink = self.on_head = self.on_end = None

    def abort(self) -> None:
        """The user went away or the request is abandoned: drop the connection."""
        self.fail(UpstreamError(Outcome.CANCELLED, "cancelled"))
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.conn.abort()


class _Connection(asyncio.Protocol):
    __slots__ = ("loop", "pool", "transport", "parser", "ex", "closed", "idle_since", "_headers", "_t",
                 "_deferred", "_feed_due")  # fmt: skip

    def __init__(self, loop: asyncio.AbstractEventLoop, pool: Pool) -> None:
        self.loop = loop
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.ex: Exchange | None = None
        self.closed = False
        self.idle_since = 0.0
        self._headers: list[tuple[bytes, bytes]] = []
        self._t = 0
        self._deferred: list[tuple[int, bytes]] = []  # reads stamped, not yet parsed (point 4)
        self._feed_due: asyncio.Handle | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def data_received(self, data: bytes) -> None:
        t = _perf()  # first: the arrival time of these bytes
        ex = self.ex
        if ex is None:  # bytes on an idle connection: the server is not following HTTP
            self.abort()
            return
        ex.on_bytes(t)
        if ex.defer_reads or self._deferred:  # after the pass's other reads, never out of order
            self._deferred.append((t, data))
            if self._feed_due is None:
                self._feed_due = self.loop.call_soon(self._feed_after_tasks)
            return
        self._feed(ex, t, data)

    def _feed_after_tasks(self) -> None:
        # Once more to the back of the queue: the request tasks this pass woke (a new user's
        # request, written upstream in its first step) run before the held-back reads.
        self._feed_due = self.loop.call_soon(self.feed_deferred)

    def feed_deferred(self) -> None:
        """The reads held back (point 4), in arrival order, each with its arrival stamp."""
        if self._feed_due is not None:
            self._feed_due.cancel()
            self._feed_due = None
        reads, self._deferred = self._deferred, []
        for t, data in reads:
            ex = self.ex
            if ex is None or self.closed:  # released or aborted meanwhile: nothing to deliver to
                return
            self._feed(ex, t, data)

    def _feed(self, ex: Exchange, t: int, data: bytes) -> None:
        self._t = t
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            ex.fail(UpstreamError(Outcome.MALFORMED, "the variant upgraded the connection"))
            self.abort()
        except httptools.HttpParserError as exc:
            ex.fail(UpstreamError(Outcome.MALFORMED, f"bad HTTP from the variant: {exc}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deferred and not self.closed:
            self.feed_deferred()  # what came before the close: maybe the response's end
        self.closed = True
        ex = self.ex
        if ex is not None and not ex.complete:
            ex.fail(UpstreamError(Outcome.DISCONNECT, "the variant closed the connection"))
        self.pool.forget(self)

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._headers = []

    def on_status(self, status: bytes) -> None:
        if self.ex is not None:
            self.ex.on_status(self.parser.get_status_code())

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        if self.ex is not None:
            self.ex.on_status(self.parser.get_status_code())
            self.ex.on_headers(self._headers, self.parser.should_keep_alive(), self._t)

    def on_body(self, body: bytes) -> None:
        if self.ex is not None:
            self.ex.on_body(self._t, body)

    def on_message_complete(self) -> None:
        if self.ex is not None:
            self.ex.on_complete()

    # for the exchange
    def pause(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.abort()
        self.pool.forget(self)

    def release(self, ex: Exchange) -> None:
        if self.ex is not ex:
            return
        self.ex = None
        # Bytes still held back after the response's end (point 4) are a server not following
        # HTTP: they must not reach the next request's parser.
        if ex.complete and ex.keep_alive and ex.error is None and not self.closed and not self._deferred:
            self.parser = httptools.HttpResponseParser(self)
            self.resume()  # a paused read (flow control) must not outlive its exchange
            self.idle_since = self.loop.time()
            self.pool.put_idle(self)
        else:
            self.abort()


class Pool:
    """Connections to one endpoint, for one event loop."""

    def __init__(
        self, endpoint: Endpoint, *, allow: Allowlist | None, ssl_context: ssl.SSLContext | None
    ) -> None:
        self.endpoint = endpoint
        self.allow = allow
        self.ssl_context = ssl_context
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()

    def put_idle(self, conn: _Connection) -> None:
        self._idle.append(conn)

    def forget(self, conn: _Connection) -> None:
        self._all.discard(conn)
        try:
            self._idle.remove(conn)
        except ValueError:
            pass

    def _take_idle(self, loop: asyncio.AbstractEventLoop) -> _Connection | None:
        now = loop.time()
        while self._idle:
            conn = self._idle.pop()
            if conn.closed or conn.loop is not loop or now - conn.idle_since > IDLE_EXPIRY_S:
                conn.abort()
                continue
            return conn
        return None

    async def _open(self, loop: asyncio.AbstractEventLoop, deadlines: Deadlines) -> _Connection:
        ep = self.endpoint
        try:
            async with asyncio.timeout(deadlines.connect_s):
                if self.allow is not None:
                    addresses = await allowed_addresses(ep.host, ep.port, self.allow)
                else:
                    addresses = [ep.host]
                error: OSError | None = None
                for address in addresses:
                    conn = _Connection(loop, self)
                    try:
                        await loop.create_connection(
                            lambda conn=conn: conn,
                            address,
                            ep.port,
                            ssl=self.ssl_context,
                            server_hostname=ep.host if self.ssl_context is not None else None,
                        )
                    except OSError as exc:
                        error = exc
                        continue
                    self._all.add(conn)
                    return conn
                assert error is not None
                raise error
        except EgressRefused as exc:
            raise UpstreamError(Outcome.CLIENT_ERROR, f"egress refused: {exc}") from None
        except TimeoutError:
            raise UpstreamError(
                Outcome.CONNECT_TIMEOUT,
                f"connect timeout after {deadlines.connect_s:g} s to {ep.host_header}",
            ) from None
        except OSError as exc:
            raise UpstreamError(
                Outcome.CONNECT_ERROR, f"cannot connect to {ep.host_header}: {exc.strerror or exc}"
            ) from None

    async def send(
        self,
        path: str,
        headers: dict[str, str],
        body: bytes,
        deadlines: Deadlines,
        on_head: Callable[[Exchange], None] | None = None,
    ) -> Exchange:
        """Write one POST and wait for its response headers; UpstreamError if none came.
        ``on_head``: see Exchange.on_head (it must not raise)."""
        loop = asyncio.get_running_loop()
        request = request_bytes(self.endpoint.host_header, self.endpoint.base_path + path, headers, body)
        for attempt in (1, 2):
            conn = self._take_idle(loop)
            reused = conn is not None
            c0 = c1 = 0
            if conn is None:
                c0 = _perf()
                conn = await self._open(loop, deadlines)
                c1 = _perf()
            ex = Exchange(conn, deadlines)
            ex.connected = not reused
            ex.connect_started_ns, ex.connect_done_ns = c0, c1
            ex.on_head = on_head
            conn.ex = ex
            ex.sent_ns = _perf()
            assert conn.transport is not None
            conn.transport.write(request)
            try:
                await ex.wait_headers(deadlines.headers_s)
            except UpstreamError:
                if (
                    reused
                    and attempt == 1
                    and not ex._got_bytes
                    and ex.error is not None
                    and (ex.error.outcome is Outcome.DISCONNECT)
                ):
                    continue  # an idle connection the server had closed: once more, on a new one
                conn.abort()
                raise
            except BaseException:  # cancelled (the user went away): the variant must see it too
                ex.abort()
                raise
            return ex
        raise AssertionError("unreachable")

    def close(self) -> None:
        for conn in list(self._all) + self._idle:
            conn.abort()
        self._all.clear()
        self._idle.clear()
