"""The lean HTTP/1.1 path's own socket I/O (h1.H1Connection reads and writes its socket itself,
with loop.add_reader): every way a response arrives or stops arriving, against a raw loopback
server whose bytes and timing each test scripts."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from streaming.client import Timeouts
from streaming.h1 import open_connection, request_bytes
from streaming.result import Outcome
from streaming.timed_exchange import TimedExchange
from streaming.timing import StreamTimer

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _token(text: str) -> bytes:
    return _chunk(b'data: {"choices":[{"index":0,"text":"%s","finish_reason":null}]}\n\n' % text.encode())


USAGE = _chunk(b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":3}}\n\n')
DONE = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
RESPONSE = HEAD + _token("a") + _token("b") + _token("c") + USAGE + DONE


class Server:
    """A loopback listener; ``serve(script)`` runs ``script(sock, request)`` in a thread for the
    next connection, after reading one whole request (headers and content-length body)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.requests: list[bytes] = []
        self.threads: list[threading.Thread] = []

    def serve(self, script, *, read_request: bool = True) -> None:
        def run() -> None:
            sock, _ = self.listener.accept()
            with sock:
                request = _read_request(sock) if read_request else b""
                self.requests.append(request)
                script(sock, request)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    def close(self) -> None:
        for t in self.threads:
            t.join(5)
        self.listener.close()


def _read_request(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        body += sock.recv(1 << 20)
    return head + b"\r\n\r\n" + body


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


async def _exchange(port: int, body: bytes = b"{}", rx: bool | None = None, conn=None, timeouts=None):
    """One request on a new connection (or ``conn``); (result, connection, idle list)."""
    loop = asyncio.get_running_loop()
    idle: list = []
    if conn is None:
        conn, _, _ = await open_connection("127.0.0.1", port, idle.append, rx)
    ex = TimedExchange(StreamTimer(time.perf_counter_ns()), timeouts or Timeouts(), loop)
    conn.start(ex, request_bytes(f"127.0.0.1:{port}", "/v1/completions", {}, body))
    return await asyncio.wait_for(ex.future, 10), conn, idle


@pytest.mark.parametrize("rx", [True, False], ids=["kernel stamps", "clock reads"])
def test_a_response_dribbled_a_few_bytes_per_read_parses_as_the_whole(server, rx):
    def dribble(sock, _request):
        for i in range(0, len(RESPONSE), 7):
            sock.sendall(RESPONSE[i : i + 7])
            time.sleep(0.0005)

    server.serve(dribble)

    async def go():
        result, conn, idle = await _exchange(server.port, rx=rx)
        await asyncio.sleep(0.05)  # the chunked terminator after [DONE]
        return result, conn.rx_timestamps, idle == [conn], conn

    result, stamped, released, conn = asyncio.run(go())
    assert result.outcome is Outcome.OK, result.error
    assert stamped is rx
    assert (result.chunks, result.output_tokens) == (3, 3)
    assert result.ttft_ms <= result.e2e_ms and len(result.itl_gaps_us) == 2
    assert released  # message complete and keep-alive: back to the idle list


@pytest.mark.parametrize("rx", [True, False], ids=["kernel stamps", "clock reads"])
def test_stamped_bytes_are_parsed_in_their_read_and_clock_read_bytes_one_pass_later(
    server, stamping_live, rx
):
    sent = threading.Event()

    def whole(sock, _request):
        sock.sendall(RESPONSE)
        sent.set()

    server.serve(whole)

    async def go():
        loop = asyncio.get_running_loop()
        conn, _, _ = await open_connection("127.0.0.1", server.port, lambda c: None, rx)
        loop.remove_reader(conn.sock.fileno())  # the test calls the read callback, not the loop
        ex = TimedExchange(StreamTimer(time.perf_counter_ns()), Timeouts(), loop)
        conn.start(ex, request_bytes("h", "/v1/completions", {}, b"{}"))
        await loop.run_in_executor(None, sent.wait, 5)
        for _ in range(200):  # until a read returned bytes (not EAGAIN)
            conn._on_readable()
            if ex.status or conn.pending:
                break
            await asyncio.sleep(0.005)
        after_read = (ex.status, len(conn.pending))
        await asyncio.sleep(0)  # one loop pass
        after_pass = ex.status
        while not ex.future.done():
            conn._on_readable()
            await asyncio.sleep(0)
        conn.close()
        return after_read, after_pass, ex.future.result()

    after_read, after_pass, result = asyncio.run(go())
    assert result.outcome is Outcome.OK, result.error
    if rx:
        assert after_read == (200, 0), after_read  # parsed inside the read: nothing queued
    else:
        assert after_read == (0, 1)  # queued with its clock read, parsed in the next pass
    assert after_pass == 200


def test_the_server_closing_before_it_responds_is_a_disconnect(server):
    server.serve(lambda sock, _request: None)  # reads the request, closes
    result, conn, _ = asyncio.run(_exchange(server.port))
    assert result.outcome is Outcome.DISCONNECT
    assert "before responding" in result.error
    assert conn.closed and conn.sock.fileno() == -1


def test_the_server_closing_mid_stream_is_a_disconnect_with_the_tokens_so_far(server):
    server.serve(lambda sock, _request: sock.sendall(HEAD + _token("a") + _token("b")))
    result, conn, idle = asyncio.run(_exchange(server.port))
    assert result.outcome is Outcome.DISCONNECT
    assert "before [DONE]" in result.error
    assert result.chunks == 2 and result.ttft_ms is not None
    assert conn.closed and idle == []


def test_bytes_that_are_not_http_end_the_exchange_and_the_connection(server):
    server.serve(lambda sock, _request: sock.sendall(b"SSH-2.0-OpenSSH\r\n\r\n"))
    result, conn, idle = asyncio.run(_exchange(server.port))
    assert result.outcome is Outcome.DISCONNECT
    assert "invalid HTTP response" in result.error
    assert conn.closed and idle == []


def test_a_reset_connection_is_a_disconnect(server):
    def reset(sock, _request):
        sock.sendall(HEAD + _token("a"))
        time.sleep(0.05)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()  # linger 0: RST, the client's read fails with ECONNRESET

    server.serve(reset)
    result, conn, _ = asyncio.run(_exchange(server.port))
    assert result.outcome is Outcome.DISCONNECT
    assert conn.closed


def test_connection_close_ends_the_connection_after_the_response(server):
    head = HEAD.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n")

    def once(sock, _request):
        sock.sendall(head + _token("a") + USAGE + DONE)
        time.sleep(0.2)

    server.serve(once)
    result, conn, idle = asyncio.run(_exchange(server.port))
    assert result.outcome is Outcome.OK
    assert conn.closed and idle == []  # never reused


def test_a_kept_alive_connection_carries_the_next_request(server):
    def twice(sock, request):
        sock.sendall(RESPONSE)
        server.requests.append(_read_request(sock))
        sock.sendall(RESPONSE)

    server.serve(twice)

    async def go():
        first, conn, idle = await _exchange(server.port)
        second, _, _ = await _exchange(server.port, conn=idle.pop())
        conn.close()
        return first, second

    first, second = asyncio.run(go())
    assert first.outcome is second.outcome is Outcome.OK
    assert len(server.requests) == 2


def test_a_request_larger_than_the_send_buffer_is_written_in_full(server):
    body = b'{"prompt":"' + b"x" * (8 << 20) + b'"}'  # 8 MiB: many times the socket buffers

    def slow_reader(sock, _request):
        time.sleep(0.2)  # the client's first send fills the buffers; the rest waits for room
        sock.sendall(RESPONSE)

    server.serve(lambda sock, request: slow_reader(sock, request))

    result, conn, _ = asyncio.run(_exchange(server.port, body=body))
    assert result.outcome is Outcome.OK, result.error
    assert server.requests[0].endswith(body)


def test_closing_the_connection_unregisters_and_closes_its_socket(server):
    def keep_open(sock, _request):
        sock.sendall(RESPONSE)
        time.sleep(0.3)

    server.serve(keep_open)

    async def go():
        result, conn, _ = await _exchange(server.port)
        fd = conn.sock.fileno()
        assert fd >= 0 and not conn.closed
        conn.close()
        conn.close()  # idempotent
        loop = asyncio.get_running_loop()
        return result, conn, loop.remove_reader(fd)

    result, conn, still_registered = asyncio.run(go())
    assert result.outcome is Outcome.OK
    assert conn.sock.fileno() == -1 and not still_registered


# One deadline timer per exchange, re-armed lazily (streaming/h1.py, Deadline): each phase still ends
# at its own deadline, whichever phase armed the timer.


def test_a_first_token_deadline_shorter_than_the_headers_one_still_ends_the_request_on_time(server):
    server.serve(lambda sock, _request: (sock.sendall(HEAD), time.sleep(1.5)))
    t = Timeouts(headers_s=5.0, first_token_s=0.3, stall_s=5.0, total_s=10.0)
    t0 = time.monotonic()
    result, _, _ = asyncio.run(_exchange(server.port, timeouts=t))
    assert result.outcome is Outcome.FIRST_TOKEN_TIMEOUT
    assert 0.29 < time.monotonic() - t0 < 1.2


def test_a_stall_after_the_first_token_ends_at_the_stall_deadline_not_an_earlier_phases(server):
    def one_token(sock, _request):
        sock.sendall(HEAD + _token("a"))
        time.sleep(1.5)

    server.serve(one_token)
    t = Timeouts(headers_s=0.2, first_token_s=5.0, stall_s=0.5, total_s=10.0)
    t0 = time.monotonic()
    result, _, _ = asyncio.run(_exchange(server.port, timeouts=t))
    assert result.outcome is Outcome.STALL, result.error
    assert 0.49 < time.monotonic() - t0 < 1.4
    assert result.chunks == 1


def test_tokens_that_keep_coming_outlive_every_deadline_but_the_total(server):
    def steady(sock, _request):
        sock.sendall(HEAD)
        for i in range(8):
            time.sleep(0.1)
            sock.sendall(_token(str(i)))
        sock.sendall(USAGE + DONE)

    server.serve(steady)
    # 0.8 s of tokens: past headers_s and first_token_s, each gap under stall_s
    t = Timeouts(headers_s=0.3, first_token_s=0.35, stall_s=0.3, total_s=10.0)
    result, _, _ = asyncio.run(_exchange(server.port, timeouts=t))
    assert result.outcome is Outcome.OK, result.error
    assert result.chunks == 8


def test_the_total_deadline_caps_a_steady_stream(server):
    def endless(sock, _request):
        sock.sendall(HEAD)
        try:
            for i in range(40):
                time.sleep(0.05)
                sock.sendall(_token(str(i)))
        except OSError:
            pass  # the client went away at its total deadline

    server.serve(endless)
    t = Timeouts(headers_s=5.0, first_token_s=5.0, stall_s=5.0, total_s=0.5)
    t0 = time.monotonic()
    result, _, _ = asyncio.run(_exchange(server.port, timeouts=t))
    assert result.outcome is Outcome.TOTAL_TIMEOUT
    assert 0.49 < time.monotonic() - t0 < 1.3
