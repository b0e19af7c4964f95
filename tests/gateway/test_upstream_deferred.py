"""The HTTP/1.1 core's held-back reads (streaming/h1.py, point 6) as the gateway uses them
(gateway/upstream.py, point 4): a stream past its first token has its reads parsed and handed
on after the loop pass's other reads and the request tasks it woke, in arrival order, with their
arrival stamps. Reads are handed to the connection as its socket callback would
(``H1Connection.received``), on a socketpair whose far end never writes."""

from __future__ import annotations

import asyncio
import socket
import time

from gateway.upstream import Deadlines, Endpoint, Exchange, Pool
from streaming.h1 import H1Connection
from streaming.result import Outcome

HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
    b"connection: close\r\n\r\n"
)
KEEP_ALIVE_HEAD = HEAD.replace(b"connection: close\r\n", b"")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _passes() -> None:
    """The loop's passes a held-back read waits: the one it came in, and the tasks that woke."""
    for _ in range(2):
        await asyncio.sleep(0)


def _read(conn: H1Connection, data: bytes) -> None:
    conn.received(time.perf_counter_ns(), data)


_peers: list[socket.socket] = []  # the far ends, kept open for the test's length


async def _connected(head: bytes = HEAD) -> tuple[H1Connection, Exchange, list]:
    loop = asyncio.get_running_loop()
    ours, peer = socket.socketpair()
    ours.setblocking(False)
    _peers.append(peer)
    pool = Pool(Endpoint.parse("http://127.0.0.1:9"), allow=None, ssl_context=None)
    conn = H1Connection(ours, pool._idle.append, on_close=pool._forget)
    conn.pool = pool  # for the assertions
    pool._all.add(conn)
    ex = Exchange(loop, Deadlines())
    conn.start(ex, b"")
    got: list[tuple[int, bytes]] = []
    _read(conn, head + _chunk(b"data: first\n\n"))
    await asyncio.sleep(0)  # not deferred: parsed at the end of the pass it was read in
    ex.set_sink(lambda t, body: got.append((t, body)))
    return conn, ex, got


def test_a_deferred_stream_gets_its_reads_after_the_pass_in_order_with_arrival_stamps():
    async def run() -> None:
        conn, ex, got = await _connected()
        assert [b for _, b in got] == [b"data: first\n\n"]  # not deferred: in the pass it was read in
        ex.defer_reads = True
        before = time.perf_counter_ns()
        _read(conn, _chunk(b"data: a\n\n"))
        _read(conn, _chunk(b"data: b\n\n"))
        after = time.perf_counter_ns()
        assert len(got) == 1  # held for the end of the pass
        await _passes()
        assert [b for _, b in got[1:]] == [b"data: a\n\n", b"data: b\n\n"]
        assert all(before <= t <= after for t, _ in got[1:]) and got[1][0] <= got[2][0]
        # A read that comes while others wait joins them even if the flag is lifted meanwhile.
        _read(conn, _chunk(b"data: c\n\n"))
        ex.defer_reads = False
        _read(conn, _chunk(b"data: d\n\n"))
        assert len(got) == 3
        await _passes()
        assert [b for _, b in got[3:]] == [b"data: c\n\n", b"data: d\n\n"]

    asyncio.run(run())


def test_the_end_of_a_response_held_back_is_delivered_before_the_connection_loss_is():
    async def run() -> None:
        conn, ex, got = await _connected()
        ex.defer_reads = True
        _read(conn, _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        conn._lost(None)  # the variant closed right after its last bytes (connection: close)
        assert ex.complete and ex.error is None
        assert [b for _, b in got] == [b"data: first\n\n", b"data: [DONE]\n\n"]
        await _passes()  # the pass's own call finds nothing left
        assert len(got) == 2

    asyncio.run(run())


def test_reads_held_back_for_an_aborted_exchange_are_dropped():
    async def run() -> None:
        conn, ex, got = await _connected()
        ex.defer_reads = True
        _read(conn, _chunk(b"data: a\n\n"))
        ex.abort()  # the user went away
        await _passes()
        assert len(got) == 1 and ex.error is not None and ex.error.outcome is Outcome.CANCELLED

    asyncio.run(run())


def test_a_request_task_woken_in_the_same_pass_runs_before_the_held_back_reads():
    async def run() -> None:
        loop = asyncio.get_running_loop()
        conn, ex, got = await _connected()
        ex.defer_reads = True
        _read(conn, _chunk(b"data: a\n\n"))  # a token of a stream under way ...
        order: list[str] = []
        loop.call_soon(lambda: order.append(f"new request's step, {len(got) - 1} held reads delivered"))
        await _passes()  # ... and a new user's request in the same pass: its step goes first
        assert order == ["new request's step, 0 held reads delivered"] and len(got) == 2

    asyncio.run(run())


def test_bytes_held_back_after_the_responses_end_keep_the_connection_out_of_the_pool():
    async def run() -> None:
        conn, ex, _got = await _connected(KEEP_ALIVE_HEAD)
        ex.defer_reads = True
        _read(conn, _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        conn._drain()  # the response is complete ...
        assert ex.complete
        _read(conn, b"HTTP/1.1 200 OK\r\n")  # ... and the variant sends more
        ex.close()  # the request's task is done with it
        assert conn.closed and conn not in conn.pool._idle  # never handed to the next request
        clean, ex2, _ = await _connected(KEEP_ALIVE_HEAD)
        _read(clean, b"0\r\n\r\n")
        await asyncio.sleep(0)
        assert ex2.complete and ex2.keep_alive
        ex2.close()
        assert not clean.closed and clean in clean.pool._idle  # a clean end is reused as before

    asyncio.run(run())


def test_a_held_back_read_counts_for_the_stall_deadline_when_it_arrives():
    async def run() -> None:
        conn, ex, got = await _connected()
        ex.defer_reads = True
        before = time.perf_counter_ns()
        _read(conn, _chunk(b"data: a\n\n"))
        assert len(got) == 1  # not parsed yet ...
        assert ex._last_read_ns() >= before  # ... but the gap between arrivals restarts now
        ex.arm(time.perf_counter_ns() + 10**9)  # arming later never moves it back to the headers
        assert ex._last_read_ns() >= before
        ex.abort()

    asyncio.run(run())
