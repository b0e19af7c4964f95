"""Kernel receive timestamps on the lean HTTP/1.1 path (h1.py): a socket read late is stamped
with when its bytes arrived, and every case without a stamp falls back to the clock read."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from streaming import h1
from streaming.client import Timeouts
from streaming.h1 import H1Connection, open_connection, request_bytes
from streaming.result import Outcome
from streaming.rx_clock import rx_stamp_ns, sample_realtime_offset
from streaming.timed_exchange import TimedExchange
from streaming.timing import StreamTimer

# The client's loop is blocked this long after the server wrote: the stamp must not include it.
BLOCK_S = 0.2
RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


BODY = (
    _chunk(b'data: {"choices":[{"index":0,"text":"hi","finish_reason":null}]}\n\n')
    + _chunk(b"data: [DONE]\n\n")
    + b"0\r\n\r\n"
)


async def _stream_once(rx_timestamps: bool | None) -> tuple[int, int, H1Connection]:
    """One exchange against a raw loopback server that writes the whole response while the
    client's loop is blocked. Returns (measured first-content ns, write ns, connection)."""
    loop = asyncio.get_running_loop()
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        port = listener.getsockname()[1]
        idle: list[H1Connection] = []
        conn, _, _ = await open_connection("127.0.0.1", port, idle.append, rx_timestamps)
        server, _ = listener.accept()
    finally:
        listener.close()
    with server:
        await asyncio.sleep(0)  # connection_made has run
        timer = StreamTimer(time.perf_counter_ns())
        ex = TimedExchange(timer, Timeouts(), loop)
        conn.start(ex, request_bytes(f"127.0.0.1:{port}", "/v1/completions", {}, b"{}"))
        await asyncio.sleep(0.01)
        server.recv(65536)
        write_ns = time.perf_counter_ns()
        server.sendall(RESPONSE + BODY)
        time.sleep(BLOCK_S)  # blocks the loop: the bytes wait in the kernel, as in a busy burst
        result = await asyncio.wait_for(ex.future, 5)
        conn.close()
    assert result.outcome is Outcome.OK, result.error
    assert result.ttft_ms is not None
    return result.start_ns + int(result.ttft_ms * 1e6), write_ns, conn


def test_a_late_read_is_stamped_with_the_kernel_arrival_time(stamping_live):
    measured, written, conn = asyncio.run(_stream_once(None))
    assert conn.rx_timestamps, "SO_TIMESTAMPNS should be on by default on Linux x86_64/aarch64"
    assert written <= measured < written + int(BLOCK_S * 1e9 / 2)


def test_turned_off_the_read_is_stamped_with_the_clock_read():
    measured, written, conn = asyncio.run(_stream_once(False))
    assert not conn.rx_timestamps
    assert measured >= written + int(BLOCK_S * 1e9)


def test_the_module_switch_turns_kernel_stamps_off(monkeypatch):
    monkeypatch.setattr(h1, "RX_TIMESTAMPS", False)
    measured, written, conn = asyncio.run(_stream_once(None))
    assert not conn.rx_timestamps
    assert measured >= written + int(BLOCK_S * 1e9)


def test_an_unsupported_platform_falls_back_to_the_clock_read(monkeypatch):
    monkeypatch.setattr(h1, "_RX_STAMPS_SUPPORTED", False)
    measured, written, conn = asyncio.run(_stream_once(True))
    assert not conn.rx_timestamps
    assert measured >= written + int(BLOCK_S * 1e9)


def test_on_uvloop_a_late_read_is_stamped_with_the_kernel_arrival_time_too(stamping_live):
    # The connection reads its own socket (loop.add_reader), so the loop's own I/O code never
    # sees it: uvloop gets the kernel's stamps as the default loop does.
    import uvloop

    measured, written, conn = uvloop.run(_stream_once(True))
    assert conn.rx_timestamps
    assert written <= measured < written + int(BLOCK_S * 1e9 / 2)


def test_the_stamping_socket_is_the_one_the_client_made_and_closes_with_the_connection():
    _, _, conn = asyncio.run(_stream_once(True))
    assert type(conn.sock) is socket.socket  # no asyncio transport, no re-classed socket
    assert conn.sock.fileno() == -1  # closed with the connection


@pytest.mark.parametrize(
    ("rx", "expected"),
    [
        (0, 5_000),  # no stamp in the control messages: the clock read
        (1_004_000, 4_000),  # a stamp: realtime minus the offset
        (1_009_000, 5_000),  # after the read (offset error, clock step): the read
        (1_000_500, 2_000),  # before the request write or an earlier stamp: the floor
    ],
)
def test_a_stamp_is_converted_and_clamped_between_the_floor_and_the_read(rx, expected):
    assert rx_stamp_ns(rx, offset_ns=1_000_000, now_ns=5_000, floor_ns=2_000) == expected


def test_the_realtime_offset_lies_within_its_error_of_an_independent_bracket():
    offset, err = sample_realtime_offset()
    a = time.perf_counter_ns()
    real = time.time_ns()
    b = time.perf_counter_ns()
    # The true offset is in [real - b, real - a]; the estimate is within err of the true one.
    assert err >= 0
    assert real - b - err <= offset <= real - a + err
