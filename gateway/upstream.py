"""The gateway's upstream: forward a request to a variant over the HTTP/1.1 core, hand back
its bytes.

The connections, their framing, stamps, deadlines' timer and keep-alive pool are the core's
(streaming/h1.py), the same the replay measures with; this module is the gateway's exchange on
it (the sink that forwards, then measures: gateway/forwarder.py) and the request's send:

1. Every read is stamped on arrival (the kernel's receive stamp on plain http, the clock read
   over TLS: the replay's clock either way) and handed to the exchange: queued until the
   forwarder takes over the body (``set_sink``), then straight into it, inside the read
   callback, with no task wake-up.
2. Deadlines: connect and response headers under ``asyncio.timeout``; after the headers one
   lazily re-armed ``Deadline`` per exchange covers the stall deadline (gap between reads,
   counted from their arrival whether or not they were held back) and the total one.
3. Flow control: past ``HIGH_WATER`` queued bytes (a slow user) reading from the variant pauses.
4. First tokens first: once a stream's first content has gone out, its reads wait for the end
   of the loop pass (the core's ``defer_reads``), so another stream's first token, the TTFT of
   the SLA, waits for the other first tokens of the burst only.
5. Egress (streaming/egress.py): with an allowlist, every new connection resolves the host
   itself, checks every address and dials only checked ones; TLS still verifies the
   certificate against the URL's host (SNI).
6. Keep-alive: a reused connection that closes before any byte of the response is retried once
   on a new connection (the server had closed it idle: it never saw the request).

HTTP/2 variants are spoken to over HTTP/1.1 here (both serve the same OpenAI API).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass

from streaming import h1
from streaming.egress import Allowlist, EgressRefused
from streaming.endpoint import Endpoint
from streaming.h1 import Deadline, request_bytes
from streaming.response import HEADERS, STALL, broken_outcome, timeout_outcome
from streaming.result import Outcome

_perf = time.perf_counter_ns
HIGH_WATER = 1 << 20


class UpstreamError(Exception):
    """The variant gave no response: the outcome class and a message safe to show."""

    def __init__(self, outcome: Outcome, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message


@dataclass(frozen=True, slots=True)
class Deadlines:
    """Seconds. After the headers the gateway has one gap deadline, between reads: before the
    first token it is the first token's (streaming/response.py names the phase it ran out in)."""

    connect_s: float = 5.0
    headers_s: float = 60.0
    stall_s: float = 60.0
    total_s: float = 600.0

    @property
    def first_token_s(self) -> float:
        return self.stall_s


class Exchange(h1.Exchange):
    """One request on one connection, as the gateway's request task sees it."""

    __slots__ = (
        "loop",
        "complete",
        "error",
        "sent_ns",
        "connected",
        "connect_started_ns",
        "connect_done_ns",
        "headers_ns",
        "_chunks",
        "_queued",
        "_waiter",
        "_headers_fut",
        "_deadline",
        "_total_deadline_ns",
        "_stall_ns",
        "_deadlines",
        "server_closed",
        "_paused",
        "_sink",
        "on_head",
        "on_end",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, deadlines: Deadlines) -> None:
        super().__init__()
        self.loop = loop
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
        self._headers_fut: asyncio.Future = loop.create_future()
        self._deadline = Deadline(loop, self._on_deadline)
        self._total_deadline_ns = 0
        self._deadlines = deadlines
        self.server_closed = False  # the variant closed the connection before the body ended
        self._stall_ns = int(deadlines.stall_s * 1e9)
        self._paused = False
        self._sink: Callable[[int, bytes], None] | None = None
        # Called in the read callback when the headers are complete (before any body byte is
        # handed on), so the response can start without waiting for the request's task.
        self.on_head: Callable[[Exchange], None] | None = None
        # Called in the read callback when the body is complete (after its last on_body).
        self.on_end: Callable[[], None] | None = None

    @property
    def defer_reads(self) -> bool:
        """Whether this stream's reads wait for the end of the loop pass (point 4); set by the
        forwarder once the stream's first content went out."""
        return self.conn is not None and self.conn.defer_reads

    @defer_reads.setter
    def defer_reads(self, value: bool) -> None:
        if self.conn is not None and self.conn.exchange is self:
            self.conn.defer_reads = value

    # called by the connection (the core's callbacks) ------------------------------------------
    def response_head(self) -> None:
        self.headers_ns = self.now
        if self.on_head is not None:
            self.on_head(self)
        if not self._headers_fut.done():
            self._headers_fut.set_result(None)

    def on_body(self, body: bytes) -> None:
        sink = self._sink
        if sink is not None:
            sink(self.now, body)  # straight on, inside the read callback: no task wake-up
            return
        self._chunks.append((self.now, body))
        self._queued += len(body)
        if self._queued > HIGH_WATER and not self._paused:
            self._paused = True
            self.conn.pause()  # type: ignore[union-attr]
        self._wake()

    def response_end(self) -> None:
        self.complete = True
        if self.on_end is not None:
            self.on_end()
        self._wake()

    def lost(self, now: int, exc: BaseException | None) -> None:
        # What the bytes so far mean (the end of a stream without [DONE], or with it in its
        # last read) is the reader's to say; here: no more bytes will come.
        if not self.complete and self.error is None:
            self.server_closed = True
            self.fail(UpstreamError(Outcome.DISCONNECT, "server closed the connection before responding"))

    def broken(self, now: int, exc: Exception) -> None:
        self.fail(UpstreamError(*broken_outcome(exc)))

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
            self.fail(UpstreamError(*timeout_outcome(HEADERS, self._deadlines)))
        if self.error is not None and not self.headers_ns:
            raise self.error

    def _last_read_ns(self) -> int:
        """The latest arrival of this response's bytes (held back or not): the stall clock."""
        conn = self.conn
        last = max(conn.last_read_ns if conn is not None else 0, self.headers_ns)
        return last or _perf()

    def arm(self, total_deadline_ns: int) -> None:
        """Start the stall and total deadlines (after the headers)."""
        self._total_deadline_ns = total_deadline_ns
        self._deadline.set(min(self._last_read_ns() + self._stall_ns, total_deadline_ns))

    def _on_deadline(self, now: int) -> None:
        if self.complete or self.error is not None:
            return
        last = self._last_read_ns()
        if now >= self._total_deadline_ns:
            self.fail(UpstreamError(*timeout_outcome(STALL, self._deadlines, total=True)))
            self._drop()
        elif now - last >= self._stall_ns:
            # the phase (first token or stall) is the reader's: gateway/attempts.py asks it
            self.fail(UpstreamError(*timeout_outcome(STALL, self._deadlines)))
            self._drop()
        else:
            self._deadline.set(min(last + self._stall_ns, self._total_deadline_ns))

    def set_sink(self, sink: Callable[[int, bytes], None]) -> None:
        """From now on every read goes to ``sink(t_ns, body)`` as it arrives (after what had
        queued); ``finished()`` waits for the end. The sink must not raise."""
        queued, self._chunks, self._queued = self._chunks, [], 0
        for t_ns, body in queued:
            sink(t_ns, body)
        self._sink = sink
        if self._paused:
            self._paused = False
            self.conn.resume()  # type: ignore[union-attr]

    async def finished(self) -> None:
        """Until the body ended or failed (``error`` says which)."""
        while not (self.complete or self.error is not None):
            self._waiter = self.loop.create_future()
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
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        out = self._chunks
        self._chunks = []
        self._queued = 0
        if self._paused:
            self._paused = False
            self.conn.resume()  # type: ignore[union-attr]
        return out

    def close(self) -> None:
        """Done with the response: the connection goes back to the pool if it is reusable
        (complete, kept alive, nothing after the response's end). The callbacks are dropped:
        they are the forwarder's, which holds this exchange, and a cycle left behind per
        request is work for the cyclic collector, whose passes pause the event loop
        (bench/RESULTS.md, "Gateway overhead")."""
        self._deadline.close()
        conn = self.conn
        if conn is not None and conn.exchange is self:
            if self.complete and self.error is None:
                conn.finish(self)
            else:
                conn.close()
        self._sink = self.on_head = self.on_end = None

    def abort(self) -> None:
        """The user went away or the request is abandoned: drop the connection."""
        self.fail(UpstreamError(Outcome.CANCELLED, "cancelled"))
        self._deadline.close()
        self._drop()

    def _drop(self) -> None:
        conn = self.conn
        if conn is not None and conn.exchange is self:
            conn.close()


class Pool(h1.Pool):
    """The core's pool of connections to one variant's endpoint, for one event loop, with the
    gateway's send."""

    def __init__(
        self, endpoint: Endpoint, *, allow: Allowlist | None, ssl_context: ssl.SSLContext | None
    ) -> None:
        super().__init__(endpoint.host, endpoint.port, allow=allow, ssl_context=ssl_context)
        self.endpoint = endpoint

    async def _connect(self, deadlines: Deadlines) -> tuple[h1.H1Connection, int, int]:
        ep = self.endpoint
        try:
            async with asyncio.timeout(deadlines.connect_s):
                return await self.open()
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
            conn = self.take(loop)
            reused = conn is not None
            c0 = c1 = 0
            if conn is None:
                conn, c0, c1 = await self._connect(deadlines)
            ex = Exchange(loop, deadlines)
            ex.connected = not reused
            ex.connect_started_ns, ex.connect_done_ns = c0, c1
            ex.on_head = on_head
            ex.sent_ns = _perf()
            conn.start(ex, request, ex.sent_ns)
            try:
                await ex.wait_headers(deadlines.headers_s)
            except UpstreamError:
                if (
                    reused
                    and attempt == 1
                    and conn.last_read_ns < ex.sent_ns  # not a byte of this response came
                    and ex.error is not None
                    and (ex.error.outcome is Outcome.DISCONNECT)
                ):
                    continue  # an idle connection the server had closed: once more, on a new one
                conn.close()
                raise
            except BaseException:  # cancelled (the user went away): the variant must see it too
                ex.abort()
                raise
            return ex
        raise AssertionError("unreachable")
