"""uvicorn's httptools protocol with a deadline and a size bound on a request's headers.

uvicorn bounds the wait for a next request on a kept-alive connection (its keep-alive timeout)
and the gateway bounds the body (ABPLAT_GATEWAY_BODY_TIMEOUT_S, MAX_BODY_BYTES), but nothing
bounds the headers: a client sending one header line every few seconds holds its connection,
and one of uvicorn's `limit_concurrency` places, for as long as it likes, and an unfinished
header value grows in httptools' buffer without limit. This protocol adds, per request:

1. a deadline (GATEWAY_CLIENT_HEADERS_TIMEOUT_S) from the connection's opening (its first
   request) or from the first byte of a request (the next ones: the idle time before it is
   uvicorn's keep-alive timeout) to the end of its headers; past it the connection is closed,
   with a 408 when a request had begun and no response is under way;
2. a bound (GATEWAY_MAX_HEADER_BYTES) on the bytes from a request's first byte to the end of its
   headers: the parser is fed at most that many bytes of an unfinished header block, and past it
   the answer is a 431 and the connection is closed, nothing more read.

It relies on uvicorn's parser callbacks (connection_made, data_received, on_message_begin,
on_headers_complete, on_body, on_message_complete, connection_lost) keeping their meaning;
tests/gateway/test_hostile_clients.py fails when they do not.
"""

from __future__ import annotations

import asyncio

from django.conf import settings
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """Passed as ``http=`` to uvicorn.Config (by class, so that worker processes import it)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s: float = settings.GATEWAY_CLIENT_HEADERS_TIMEOUT_S
        self.max_header_bytes: int = settings.GATEWAY_MAX_HEADER_BYTES
        self._header_timer: asyncio.TimerHandle | None = None
        self._awaiting_headers = True  # from a request's first byte (or the connection's opening)
        self._request_begun = False
        self._header_bytes = 0  # fed to the parser since the current request's first byte
        self._headers_seen = 0  # header blocks completed on this connection
        self._refused = False

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if not self._awaiting_headers:
            super().data_received(data)
            return
        room = self.max_header_bytes - self._header_bytes
        if room <= 0:
            self._refuse(431, f"request headers over {self.max_header_bytes} bytes")
            return
        seen = self._headers_seen
        view = memoryview(data)
        super().data_received(view[:room])
        if self._refused or self.transport.is_closing():
            return
        if self._headers_seen == seen:
            self._header_bytes += min(len(data), room)
            if len(data) > room:
                self._refuse(431, f"request headers over {self.max_header_bytes} bytes")
            return
        # The headers ended within this read: what follows is the body, or the next request's
        # bytes (counted against its own bound, where this call starts over).
        if self._awaiting_headers:
            self._header_bytes = 0
        if len(data) > room:
            self.data_received(view[room:])

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._awaiting_headers = self._request_begun = True
        self._arm_header_deadline()

    def on_headers_complete(self) -> None:
        self._disarm_header_deadline()
        self._awaiting_headers = self._request_begun = False
        self._header_bytes = 0
        self._headers_seen += 1
        if self._refused:
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()
        self._awaiting_headers = True  # what comes next is the next request's

    # ---- the deadline and the refusal ----

    def _arm_header_deadline(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self._request_begun:
            self._refuse(408, f"the request headers did not arrive within {self.header_timeout_s:g} s")
        else:
            self._refuse(None, "")  # nothing was asked: close without an answer

    def _refuse(self, status: int | None, message: str) -> None:
        """Answer ``status`` (when no response is under way on this connection) and close."""
        self._refused = True
        self._disarm_header_deadline()
        if self.transport.is_closing():
            return
        idle = self.cycle is None or self.cycle.response_complete
        if status is not None and idle:
            body = message.encode()
            head = (
                b"content-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            )
            self.transport.write(STATUS_LINE[status] + head % len(body) + body)
        elif self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the running response ends with the connection
        self.transport.close()
