"""A bare TCP relay on uvloop: the floor of any proxy hop written in Python (bench_gateway --floor).

    .venv/bin/python bench/relay.py PORT UPSTREAM_HOST:UPSTREAM_PORT

Each accepted connection gets its own upstream connection; bytes are copied both ways as they
arrive (``data_received`` -> the other side's ``transport.write``), with TCP_NODELAY and the
usual pause/resume flow control. No HTTP parsing, no routing, no measuring, no added header: it
is what a Python process on the event loop pays per read and write and nothing else, so the
gateway's added latency can be split into "a Python hop" and "what the gateway does on it".
Serves until SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys


def _nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Side(asyncio.Protocol):
    """One socket of a pair; ``peer`` is the other one."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.early: list[bytes] = []  # client bytes before the upstream connection is up

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        _nodelay(transport)

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is None or peer.transport is None:
            self.early.append(data)
        else:
            peer.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()

    def pause_writing(self) -> None:  # the other side reads slower than this one is written
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()


async def serve(port: int, host: str, upstream_port: int) -> None:
    loop = asyncio.get_running_loop()

    def accepted() -> _Side:
        client = _Side()

        async def dial() -> None:
            try:
                _, upstream = await loop.create_connection(_Side, host, upstream_port)
            except OSError:
                if client.transport is not None:
                    client.transport.close()
                return
            upstream.peer, client.peer = client, upstream
            for data in client.early:
                upstream.transport.write(data)
            client.early.clear()

        loop.create_task(dial())
        return client

    server = await loop.create_server(accepted, "127.0.0.1", port, backlog=1024)
    stop = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
    async with server:
        await stop


def main(argv: list[str]) -> int:
    if len(argv) != 2 or ":" not in argv[1]:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    host, _, upstream_port = argv[1].rpartition(":")
    import uvloop

    uvloop.run(serve(int(argv[0]), host, int(upstream_port)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
