"""gateway/upstream.py, point 4: a stream past its first token has its reads parsed and handed
on after the loop pass's other reads and the request tasks it woke, in arrival order, with their
arrival stamps."""

from __future__ import annotations

import asyncio
import time

from gateway.upstream import Deadlines, Endpoint, Exchange, Pool, _Connection
from streaming.result import Outcome

HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
    b"connection: close\r\n\r\n"
)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _Transport:
    def get_extra_info(self, name: str, default=None):
        return default

    def write(self, data: bytes) -> None:
        pass

    def abort(self) -> None:
        pass

    close = pause_reading = resume_reading = abort


async def _passes() -> None:
    """The loop's passes a held-back read waits: the one it came in, and the tasks that woke."""
    for _ in range(2):
        await asyncio.sleep(0)


def _connected(loop: asyncio.AbstractEventLoop) -> tuple[_Connection, Exchange, list]:
    conn = _Connection(loop, Pool(Endpoint.parse("http://127.0.0.1:9"), allow=None, ssl_context=None))
    conn.connection_made(_Transport())  # type: ignore[arg-type]
    ex = Exchange(conn, Deadlines())
    conn.ex = ex
    got: list[tuple[int, bytes]] = []
    conn.data_received(HEAD + _chunk(b"data: first\n\n"))
    ex.set_sink(lambda t, body: got.append((t, body)))
    return conn, ex, got


def test_a_deferred_stream_gets_its_reads_after_the_pass_in_order_with_arrival_stamps():
    async def run() -> None:
        conn, ex, got = _connected(asyncio.get_running_loop())
        assert [b for _, b in got] == [b"data: first\n\n"]  # not deferred: in the read itself
        ex.defer_reads = True
        before = time.perf_counter_ns()
        conn.data_received(_chunk(b"data: a\n\n"))
        conn.data_received(_chunk(b"data: b\n\n"))
        after = time.perf_counter_ns()
        assert len(got) == 1  # held for the end of the pass
        await _passes()
        assert [b for _, b in got[1:]] == [b"data: a\n\n", b"data: b\n\n"]
        assert all(before <= t <= after for t, _ in got[1:]) and got[1][0] <= got[2][0]
        # A read that comes while others wait joins them even if the flag is lifted meanwhile.
        conn.data_received(_chunk(b"data: c\n\n"))
        ex.defer_reads = False
        conn.data_received(_chunk(b"data: d\n\n"))
        assert len(got) == 3
        await _passes()
        assert [b for _, b in got[3:]] == [b"data: c\n\n", b"data: d\n\n"]

    asyncio.run(run())


def test_the_end_of_a_response_held_back_is_delivered_before_the_connection_loss_is():
    async def run() -> None:
        conn, ex, got = _connected(asyncio.get_running_loop())
        ex.defer_reads = True
        conn.data_received(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        conn.connection_lost(None)  # the variant closed right after its last bytes (connection: close)
        assert ex.complete and ex.error is None
        assert [b for _, b in got] == [b"data: first\n\n", b"data: [DONE]\n\n"]
        await _passes()  # the pass's own call finds nothing left
        assert len(got) == 2

    asyncio.run(run())


def test_reads_held_back_for_an_aborted_exchange_are_dropped():
    async def run() -> None:
        conn, ex, got = _connected(asyncio.get_running_loop())
        ex.defer_reads = True
        conn.data_received(_chunk(b"data: a\n\n"))
        ex.abort()  # the user went away
        await _passes()
        assert len(got) == 1 and ex.error is not None and ex.error.outcome is Outcome.CANCELLED

    asyncio.run(run())


def test_a_request_task_woken_in_the_same_pass_runs_before_the_held_back_reads():
    async def run() -> None:
        loop = asyncio.get_running_loop()
        conn, ex, got = _connected(loop)
        ex.defer_reads = True
        conn.data_received(_chunk(b"data: a\n\n"))  # a token of a stream under way ...
        order: list[str] = []
        loop.call_soon(lambda: order.append(f"new request's step, {len(got) - 1} held reads delivered"))
        await _passes()  # ... and a new user's request in the same pass: its step goes first
        assert order == ["new request's step, 0 held reads delivered"] and len(got) == 2

    asyncio.run(run())


def test_bytes_held_back_after_the_responses_end_keep_the_connection_out_of_the_pool():
    async def run() -> None:
        conn, ex, _got = _connected(asyncio.get_running_loop())
        ex.keep_alive = True  # as if the variant had said keep-alive
        ex.defer_reads = True
        conn.data_received(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        conn.feed_deferred()  # the response is complete ...
        assert ex.complete
        conn.data_received(b"HTTP/1.1 200 OK\r\n")  # ... and the variant sends more
        ex.close()  # the request's task is done with it
        assert conn.closed and conn not in conn.pool._idle  # never handed to the next request
        clean, ex2, _ = _connected(asyncio.get_running_loop())
        ex2.keep_alive = True
        clean.data_received(b"0\r\n\r\n")
        ex2.close()
        assert not clean.closed and clean in clean.pool._idle  # a clean end is reused as before

    asyncio.run(run())


def test_a_held_back_read_counts_for_the_stall_deadline_when_it_arrives():
    async def run() -> None:
        conn, ex, got = _connected(asyncio.get_running_loop())
        ex.defer_reads = True
        before = time.perf_counter_ns()
        conn.data_received(_chunk(b"data: a\n\n"))
        assert len(got) == 1  # not parsed yet ...
        assert ex._last_ns >= before  # ... but the gap between arrivals restarts now
        ex.arm(time.perf_counter_ns() + 10**9)  # arming later never moves it back to the headers
        assert ex._last_ns >= before
        ex.abort()

    asyncio.run(run())
