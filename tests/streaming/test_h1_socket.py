"""The lean HTTP/1.1 path opens its own TCP socket (h1.open_connection): names are resolved,
IPv6 works, every address is tried in order, and a failed attempt never leaks its socket."""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import threading
import time
import warnings

import pytest

from simulator.serve import DEFAULT_MODEL, build_server
from streaming import h1
from streaming.client import Timeouts, VariantClient
from streaming.result import Outcome, StreamCancelled


@pytest.fixture(scope="module")
def fast_v6():
    """The same simulator, listening on the IPv6 loopback only."""
    server = build_server("fast")
    server.config.loop = "asyncio"
    sock = socket.create_server(("::1", 0), family=socket.AF_INET6)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "simulator on ::1 did not start"
        time.sleep(0.01)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def _open_sockets() -> dict[int, str]:
    """This process's open sockets: fd -> "socket:[inode]"."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except FileNotFoundError:  # the fd listdir itself used, already closed
            continue
        if target.startswith("socket:"):
            out[int(name)] = target
    return out


def _refused_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))  # bound, never listening: connects are refused
    return s, s.getsockname()[1]


def _resolve_to(loop: asyncio.AbstractEventLoop, *hosts: str) -> None:
    """Make this loop's getaddrinfo answer every name with ``hosts``, in that order."""

    async def getaddrinfo(host, port, **kw):
        out = []
        for h in hosts:
            fam = socket.AF_INET6 if ":" in h else socket.AF_INET
            addr = (h, port, 0, 0) if fam == socket.AF_INET6 else (h, port)
            out.append((fam, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", addr))
        return out

    loop.getaddrinfo = getaddrinfo  # type: ignore[method-assign]


async def _one(url: str, rid: str = "r", **kw):
    async with VariantClient(url, DEFAULT_MODEL, "completions", transport="h1", **kw) as c:
        return await c.stream(rid, "hi", 5)


def _assert_ok(r) -> None:
    assert r.outcome is Outcome.OK, r.error
    assert r.output_tokens == 5 and r.new_connection and r.connect_ms is not None
    assert r.connect_ms < r.ttfb_ms  # the handshake lies inside the wait for the headers
    assert r.start_ns + r.ttft_ms * 1e6 >= r.server_first_content_ns


def test_a_dns_name_is_resolved_with_getaddrinfo(fast):
    port = fast.url.rsplit(":", 1)[1]
    _assert_ok(asyncio.run(_one(f"http://localhost:{port}")))


def test_an_ipv6_literal_connects_over_ipv6(fast_v6):
    _assert_ok(asyncio.run(_one(f"http://[::1]:{fast_v6}")))


def test_a_name_resolving_to_ipv6_connects_over_ipv6(fast_v6):
    async def go():
        _resolve_to(asyncio.get_running_loop(), "::1")
        return await _one(f"http://variant.test:{fast_v6}")

    _assert_ok(asyncio.run(go()))


def test_addresses_are_tried_in_order_until_one_accepts(fast):
    port = int(fast.url.rsplit(":", 1)[1])  # nothing listens on [::1]:port: refused first

    async def go():
        _resolve_to(asyncio.get_running_loop(), "::1", "127.0.0.1")
        return await _one(f"http://variant.test:{port}")

    _assert_ok(asyncio.run(go()))


def test_the_socket_is_nodelay_and_stamps_reads(fast):
    port = int(fast.url.rsplit(":", 1)[1])

    async def go():
        conn, c0, c1 = await h1.open_connection("127.0.0.1", port, lambda c: None, True)
        try:
            sock = conn.sock
            return (
                c0 < c1,
                sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY),
                sock.getsockopt(socket.SOL_SOCKET, h1._SO_TIMESTAMPNS),
                conn.rx_timestamps,
            )
        finally:
            conn.close()

    ordered, nodelay, stamps, rx = asyncio.run(go())
    assert ordered and nodelay and stamps and rx


def test_failed_connects_close_every_socket_they_open():
    refused, port = _refused_port()
    # A listener that never accepts, its queue filled: further SYNs are dropped (timeouts).
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    full_port = full.getsockname()[1]
    fillers = [socket.socket() for _ in range(4)]
    for f in fillers:
        f.setblocking(False)
        f.connect_ex(("127.0.0.1", full_port))

    async def go() -> tuple[dict[int, str], dict[int, str], list[Outcome]]:
        _resolve_to(asyncio.get_running_loop(), "::1", "127.0.0.1")
        outcomes = []
        short = Timeouts(connect_s=0.05)
        async with (
            VariantClient(f"http://127.0.0.1:{port}", "m") as one,
            VariantClient(f"http://variant.test:{port}", "m") as two,  # two sockets per try
            VariantClient(f"http://127.0.0.1:{full_port}", "m", timeouts=short) as slow,
            VariantClient(f"http://127.0.0.1:{full_port}", "m") as hung,
        ):
            await one.stream("warm-up", "hi", 1)
            before = _open_sockets()
            for i in range(200):
                outcomes.append((await one.stream(f"a{i}", "hi", 1)).outcome)
            for i in range(50):
                outcomes.append((await two.stream(f"b{i}", "hi", 1)).outcome)
            for i in range(5):
                outcomes.append((await slow.stream(f"c{i}", "hi", 1)).outcome)
            for i in range(5):  # cancelled while the SYN waits
                task = asyncio.create_task(hung.stream(f"d{i}", "hi", 1))
                await asyncio.sleep(0.01)
                task.cancel()
                with pytest.raises(StreamCancelled) as info:
                    await task
                outcomes.append(info.value.result.outcome)
            after = _open_sockets()
        return before, after, outcomes

    # An earlier test's garbage (a socket it left to the collector) is collected now, not inside
    # the window below, where only this test's sockets may warn.
    gc.collect()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            before, after, outcomes = asyncio.run(go())
            gc.collect()
    finally:
        for f in fillers:
            f.close()
        full.close()
        refused.close()
    expected = [Outcome.CONNECT_ERROR] * 250 + [Outcome.CONNECT_TIMEOUT] * 5 + [Outcome.CANCELLED] * 5
    assert outcomes == expected
    # Every socket open after the failures was already open before them (same fd, same inode).
    # Sockets other code closes meanwhile (an earlier test's server winding down) do not matter.
    leaked = {fd: target for fd, target in after.items() if before.get(fd) != target}
    assert not leaked
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
