"""gateway/stepped_send.py's assumption about uvicorn, checked on the real uvicorn (httptools,
uvloop) the gateway runs on: ``send`` completes at its first step while the user reads, and
suspends (then finishes through ``resume``) once the user stops reading. If a uvicorn upgrade
changes either, this fails and the forwarder must await ``send`` instead."""

from __future__ import annotations

import socket
import threading

from gateway.stepped_send import resume, step
from tests.gateway.conftest import serve

CHUNK = b"x" * 65536


class _App:
    """Steps every send by hand and notes which completed at once."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks
        self.at_once: list[bool] = []
        self.resumed = 0
        self.suspended = threading.Event()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await receive()
        messages = [
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
        ]
        messages += [{"type": "http.response.body", "body": CHUNK, "more_body": True}] * self.chunks
        messages += [{"type": "http.response.body", "body": b"", "more_body": False}]
        for message in messages:
            suspended = step(send, message)
            self.at_once.append(suspended is None)
            if suspended is not None:
                self.suspended.set()
                await resume(*suspended)
                self.resumed += 1


def _request(url: str, before_reading: threading.Event | None = None) -> bytes:
    """GET / and the whole chunked response; with ``before_reading``, nothing is read until it
    is set (the user stops reading: the kernel's buffers fill, then uvicorn's)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        if before_reading is not None:
            assert before_reading.wait(30), "no send suspended while the user did not read"
        data = bytearray()
        while not data.endswith(b"0\r\n\r\n"):
            got = s.recv(1 << 20)
            if not got:
                break
            data += got
        return bytes(data)


def test_sends_complete_at_their_first_step_while_the_user_reads():
    app = _App(chunks=3)
    url, stop = serve(app)
    try:
        body = _request(url)
    finally:
        stop()
    assert body.startswith(b"HTTP/1.1 200") and body.count(CHUNK) == 3
    assert app.at_once == [True] * 5 and app.resumed == 0


def test_a_send_suspends_when_the_user_stops_reading_and_resume_finishes_it():
    # Up to 64 MB to a client that does not read: the kernel's buffers fill, uvicorn pauses
    # writing and a send suspends; then the client reads everything and every send completes.
    app = _App(chunks=1024)
    url, stop = serve(app)
    try:
        body = _request(url, before_reading=app.suspended)
    finally:
        stop()
    assert body.count(CHUNK) == 1024  # every byte arrived, in order
    assert app.resumed >= 1 and not all(app.at_once)
