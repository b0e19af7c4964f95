"""The per-chunk path: a variant's response forwarded to the user as it arrives, measured after.

``Forwarder`` runs inside the upstream connection's read callbacks (gateway/upstream.py) and
hands every read, once forwarded, to the request's ResponseReader (streaming/response.py: what
the response means, as for the replay); ``read_error`` reads an error the user is not shown.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from gateway.http import Send
from gateway.stepped_send import resume, step
from gateway.upstream import Exchange
from streaming.response import ResponseReader, timeout_outcome
from streaming.result import Outcome

_perf = time.perf_counter_ns
# Response headers not passed on: hop-by-hop (RFC 9110 7.6.1) and the framing uvicorn redoes.
HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"proxy-authenticate",
        b"proxy-connection",
        b"x-abplat-variant",
        b"x-request-id",
        b"traceparent",
    }
)


class Forwarder:
    """The per-chunk path, run inside the upstream connection's read callback
    (gateway/upstream.py: ``Exchange.on_head``, ``Exchange.set_sink``), so no byte waits for
    the request's task to wake up:

    1. The variant's headers complete: the response starts at once with them (hop-by-hop ones
       dropped, ours added), unless it is a 5xx that the control may still answer.
    2. Each read: forwarded first. uvicorn's ``send`` only awaits when the user's socket is
       write-paused (a slow reader); otherwise it writes and returns at its first step. So the
       coroutine is stepped here, at once; only when it does suspend is it finished in a task,
       with reading from the variant paused and later reads joined into one write after it.
    3. Then measured, after every read of this loop pass is forwarded: the read's arrival
       stamp (the kernel's or the connection's clock read, streaming/h1.py) and its bytes are
       kept, and one ``call_soon`` per pass feeds them to the request's ResponseReader (which
       feeds the StreamTimer). An engine emits a token for every running request in one
       step, so reads come in bursts of one per stream: the
       last stream's bytes wait for the burst's forwarding only, not for its measuring too.
       ``measure()`` catches up at once; whoever reads the figures calls it first. Once the
       first content is measured, the exchange defers this stream's reads to the end of the
       pass (gateway/upstream.py, point 4): other streams' first tokens go out before them.
    """

    __slots__ = (
        "send",
        "reader",
        "added",
        "take_5xx",
        "ex",
        "started",
        "forward_ns",
        "chunks",
        "send_error",
        "closed",
        "before_end",
        "_pending",
        "_backlog",
        "_close_after",
        "state",
        "_unmeasured",
        "_measure_due",
    )

    def __init__(
        self,
        send: Send,
        reader: ResponseReader,
        added: list[tuple[bytes, bytes]],
        *,
        take_5xx: bool,
        state: dict,
    ) -> None:
        self.send = send
        self.state = state  # the request's: "done" tells the disconnect watcher the end is ours
        self.reader = reader  # what the response means (streaming/response.py), fed after forwarding
        self.added = added
        self.take_5xx = take_5xx
        self.ex: Exchange | None = None
        self.started = False
        self.forward_ns = 0
        self.chunks = 0
        self.send_error: BaseException | None = None
        self.closed = False  # the response's last message is handed to uvicorn
        self.before_end: Callable[[], None] | None = None  # called just before the response's end
        self._pending: asyncio.Task | None = None
        self._backlog: list[bytes] = []
        self._close_after = False
        self._unmeasured: list[tuple[int, bytes]] = []  # reads forwarded, not yet measured
        self._measure_due: asyncio.Handle | None = None

    def read_head(self, ex: Exchange) -> None:
        """The response's status and content type into the reader, once (at the headers' stamp)."""
        if not self.reader.status:
            ctype = next((v for k, v in ex.headers if k == b"content-type"), b"")
            self.reader.head(ex.headers_ns, ex.status, ctype)

    def on_head(self, ex: Exchange, force: bool = False) -> None:
        if self.started or (ex.status >= 500 and not self.take_5xx and not force):
            return
        t0 = _perf()
        self.ex = ex
        self.started = True
        try:
            headers = [(k, v) for k, v in ex.headers if k not in HOP]
            headers += self.added
            self.read_head(ex)
            self._step({"type": "http.response.start", "status": ex.status, "headers": headers})
        except Exception as exc:  # never into the protocol callback
            self.send_error = exc
            ex.abort()
            return
        ex.set_sink(self)
        ex.on_end = self.end
        self.forward_ns += _perf() - t0

    def end(self) -> None:
        """The variant's body is complete: end the user's response now (the client may reuse
        its connection at once), not when the request's task wakes up."""
        if self.send_error is not None or self.closed:
            return
        if self._pending is not None:
            self._close_after = True
            return
        self.closed = True
        hook, self.before_end = self.before_end, None  # once; and no cycle left through it
        if hook is not None:
            hook()  # the sample first (gateway.attempts), then the end the user sees
        # uvicorn answers the watcher's receive() with http.disconnect once the response is
        # complete: that one is not the user going away.
        self.state["done"] = True
        self._step({"type": "http.response.body", "body": b"", "more_body": False})

    def __call__(self, t_ns: int, data: bytes) -> None:
        # 2. forward
        if self._pending is not None:
            self._backlog.append(data)
        elif self.send_error is None:
            self._step({"type": "http.response.body", "body": data, "more_body": True})
        self.forward_ns += _perf() - t_ns
        self.chunks += 1
        # 3. measure, once this loop pass has forwarded every read it has
        self._unmeasured.append((t_ns, data))
        if self._measure_due is None:
            assert self.ex is not None
            self._measure_due = self.ex.conn.loop.call_soon(self.measure)

    def measure(self) -> None:
        """Every read forwarded so far into the parser and the timer, in arrival order."""
        if self._measure_due is not None:
            self._measure_due.cancel()
            self._measure_due = None
        reads, self._unmeasured = self._unmeasured, []
        reader = self.reader
        for t_ns, data in reads:
            reader.body(t_ns, data)
        ex = self.ex
        if ex is not None and not ex.defer_reads and reader.timer.first_content_seen:
            ex.defer_reads = True  # the user has the first token: its next reads may wait their turn

    def _step(self, message: dict) -> None:
        try:
            suspended = step(self.send, message)
        except Exception as exc:  # uvicorn refused the message: stop forwarding, end the request
            self.send_error = exc
            assert self.ex is not None
            self.ex.abort()
            return
        if suspended is None:
            return
        # The user's socket is write-paused: finish this send in a task, hold the variant.
        assert self.ex is not None
        self.ex.conn.pause()
        self._pending = asyncio.ensure_future(resume(*suspended))
        self._pending.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task) -> None:
        self._pending = None
        if task.cancelled():
            return
        exc = task.exception()
        assert self.ex is not None
        if exc is not None:
            self.send_error = exc
            self.ex.abort()
            return
        if self._backlog:
            data = b"".join(self._backlog)
            self._backlog.clear()
            self._step({"type": "http.response.body", "body": data, "more_body": True})
        if self._pending is None and self._close_after:
            self._close_after = False
            self.end()
        if self._pending is None:
            self.ex.conn.resume()

    async def flushed(self) -> None:
        """Until every forwarded byte is handed to uvicorn (a paused send, its backlog)."""
        while self._pending is not None:
            try:
                await asyncio.shield(self._pending)
            except asyncio.CancelledError:
                if self._pending is not None:
                    self._pending.cancel()
                raise
            except Exception:
                return


async def read_error(ex: Exchange, reader: ResponseReader) -> None:
    """An error response not forwarded (the control may still answer): its body into the
    reader, until the reader has the message or the body ends."""
    while not reader.done:
        batch = await ex.chunks()
        if not batch:
            reader.end(_perf())
            return
        for t_ns, data in batch:
            reader.body(t_ns, data)


def settle(reader: ResponseReader, ex: Exchange, now: int) -> None:
    """The body's reads are all in the reader: decide what the response was at ``now``, from
    what the exchange says ended it (its end, the variant closing, a deadline in the reader's
    phase, or another failure)."""
    failed = ex.error
    if failed is None or ex.server_closed:
        reader.end(now)  # the body ended, or the variant closed the connection: what it says
    elif failed.outcome in (Outcome.STALL, Outcome.TOTAL_TIMEOUT):
        # the gap deadline ran out in the reader's phase (before the first token or after)
        total = failed.outcome is Outcome.TOTAL_TIMEOUT
        reader.decide(*timeout_outcome(reader.phase, reader.timeouts, total=total))
    else:
        reader.decide(failed.outcome, failed.message)
