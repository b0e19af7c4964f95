"""The same bytes from a variant end the same way for the replay (its HTTP/1.1 core and its
httpx path) and for the live gateway: one reader (streaming/response.py) says what they mean.

A server in a thread answers every request with the canned bytes its prompt names: a good
stream, an end without [DONE], an engine error, an event that is not JSON, error statuses, a
whole answer to a streamed request, a connection closed before or during the response, bytes
that are not HTTP."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import httpx
import pytest

from streaming.client import VariantClient
from streaming.result import Outcome

from .conftest import KEY


def _chunked(*parts: bytes, end: bool = True) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)
    return body + (b"0\r\n\r\n" if end else b"")


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
ROLE = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'


def _token(text: str) -> bytes:
    return (
        b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n'
        % text.encode()
    )


DONE = b"data: [DONE]\n\n"

# prompt -> (the bytes the server writes, whether it then closes the connection, the outcome)
SCENARIOS: dict[str, tuple[bytes, bool, Outcome]] = {
    "ok": (SSE_HEAD + _chunked(ROLE, _token("a"), _token("b") + DONE), False, Outcome.OK),
    "done-then-close": (SSE_HEAD + _chunked(ROLE, _token("a") + DONE, end=False), True, Outcome.OK),
    "no-done": (SSE_HEAD + _chunked(ROLE, _token("a")), False, Outcome.DISCONNECT),
    "cut-mid-stream": (SSE_HEAD + _chunked(ROLE, _token("a"), end=False), True, Outcome.DISCONNECT),
    "engine-error": (
        SSE_HEAD + _chunked(ROLE, b'data: {"error":{"message":"engine died","code":500}}\n\n'),
        False,
        Outcome.ENGINE_ERROR,
    ),
    "malformed": (SSE_HEAD + _chunked(ROLE, b"data: {not json\n\n", DONE), False, Outcome.MALFORMED),
    "http-404": (
        b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: 40\r\n\r\n"
        b'{"error":"The model does not exist.   "}',
        False,
        Outcome.HTTP_4XX,
    ),
    "http-503": (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: 8\r\n\r\noverload",
        False,
        Outcome.HTTP_5XX,
    ),
    "whole-answer": (
        b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 14\r\n\r\n{"choices":[]}',
        False,
        Outcome.MALFORMED,
    ),
    "closed-before-headers": (b"", True, Outcome.DISCONNECT),
    "not-http": (b"HELLO THERE\r\n\r\n", True, Outcome.DISCONNECT),
}


class CannedServer:
    """Answers each request with SCENARIOS[its prompt]."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        """Requests on one keep-alive connection until the client closes it or a scenario does."""
        with conn:
            data = b""
            while True:
                while b"\r\n\r\n" not in data:
                    more = conn.recv(65536)
                    if not more:
                        return
                    data += more
                head, _, data = data.partition(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                while len(data) < length:
                    data += conn.recv(65536)
                body, data = data[:length], data[length:]
                raw, close, _ = SCENARIOS[json.loads(body)["messages"][0]["content"]]
                conn.sendall(raw)
                if close:
                    return

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def canned():
    server = CannedServer()
    yield server
    server.close()


def _replay(url: str, transport: str) -> dict[str, tuple[Outcome, str]]:
    async def go():
        out = {}
        async with VariantClient(url + "/v1", "m", "chat", transport=transport) as client:
            for name in SCENARIOS:
                r = await client.stream(f"replay-{transport}-{name}", name, 8)
                out[name] = (r.outcome, r.error)
        return out

    return asyncio.run(go())


@pytest.mark.django_db
def test_the_replay_on_either_stack_and_the_gateway_end_the_same_bytes_the_same_way(
    canned, running_with, make_gateway
):
    core = _replay(canned.url, "h1")
    via_httpx = _replay(canned.url, "httpx")

    def to_canned(doc):
        for v in doc["variants"]:
            v["endpoint"] = canned.url + "/v1"

    experiment = running_with(to_canned)
    served = make_gateway()  # no retry on the control: one attempt a request
    gateway: dict[str, tuple[Outcome, str]] = {}
    with httpx.Client(base_url=served.url, trust_env=False, timeout=10) as http:
        for k, name in enumerate(SCENARIOS):
            http.post(
                "/v1/chat/completions",
                headers={"authorization": f"Bearer {KEY}"},
                json={
                    "model": experiment.key,
                    "stream": True,
                    "user": f"u{k}",
                    "messages": [{"role": "user", "content": name}],
                },
            )
            record = served.recorder.wait_for(k + 1)[-1]
            gateway[name] = (record["result"].outcome, record["result"].error)

    expected = {name: outcome for name, (_, _, outcome) in SCENARIOS.items()}
    assert {n: o for n, (o, _) in core.items()} == expected
    assert {n: o for n, (o, _) in via_httpx.items()} == expected
    assert {n: o for n, (o, _) in gateway.items()} == expected
    # on the same stack the messages agree too; an error body's message on every path
    assert gateway == core
    for name in ("http-404", "http-503", "engine-error", "malformed", "whole-answer"):
        assert via_httpx[name] == core[name], name
    assert core["http-404"][1] == 'HTTP 404: {"error":"The model does not exist.   "}'.strip()
    assert core["no-done"][1] == "stream ended before [DONE]"
