"""What a variant's response means: the one reader of a response, whoever carries its bytes.

The replay's HTTP/1.1 core (streaming/timed_exchange.py), its httpx path for HTTP/2
(streaming/client.py) and the live gateway (gateway/forwarder.py, gateway/attempts.py) hand the
response to a ``ResponseReader`` as it arrives: its status and content type, each read of the
body with its arrival time, and how it ended (the message complete, the connection lost, the
HTTP broken, a phase's deadline passed). The reader feeds the SSE events to the request's
``StreamTimer`` and decides the ``Outcome`` and its message, so the same bytes end the same way
on every path:

- a status of 400 or more: its body is read up to ``ERROR_BODY_LIMIT`` bytes for the message
  (``HTTP 404: {...}``), HTTP_4XX or HTTP_5XX;
- anything but 200 ``text/event-stream``: MALFORMED, unless the caller takes a whole (not
  streamed) answer (the gateway, for a user's ``stream: false``): its usage is read from the
  JSON, and its first token is the whole answer;
- ``data: [DONE]``: OK; vLLM's in-stream error event: ENGINE_ERROR; an event that is not the
  expected JSON: MALFORMED; the body ending before ``[DONE]``: DISCONNECT;
- a phase's deadline (``timeout_outcome``): no headers in time (HEADERS_TIMEOUT, the error
  body's time counts as the headers'), no first content in time (FIRST_TOKEN_TIMEOUT), a gap
  after the first content (STALL), the request's total (TOTAL_TIMEOUT).

Pure: no network, no event loop. The caller owns the clock, the deadlines' timer and the
connection; ``deadline_ns`` tells it when the current phase runs out.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import httptools

from streaming.result import Outcome, StreamResult
from streaming.sse import SSEParser
from streaming.timing import StreamProtocolError, StreamTimer

ERROR_BODY_LIMIT = 2048  # bytes of an error body kept for the message
WHOLE_BODY_LIMIT = 1 << 20  # a whole (not streamed) answer is parsed for its usage up to this size

# The phases of a response, in order; each has its own deadline.
HEADERS = "headers"
ERROR_BODY = "error body"
FIRST_TOKEN = "first token"
STALL = "stall"
WHOLE_BODY = "whole body"


class PhaseTimeouts(Protocol):
    """Seconds: headers, first token and total count from the request's start; stall is the
    longest gap allowed between two events once the first content has arrived."""

    headers_s: float
    first_token_s: float
    stall_s: float
    total_s: float


def timeout_outcome(phase: str, timeouts: PhaseTimeouts, *, total: bool = False) -> tuple[Outcome, str]:
    """The outcome and message of a deadline passed in ``phase`` (``total``: the request's own
    deadline, whatever the phase)."""
    if total:
        return Outcome.TOTAL_TIMEOUT, f"total timeout {timeouts.total_s}s"
    if phase == STALL:
        return Outcome.STALL, f"stall timeout after {timeouts.stall_s}s"
    if phase in (FIRST_TOKEN, WHOLE_BODY):
        return Outcome.FIRST_TOKEN_TIMEOUT, f"first token timeout after {timeouts.first_token_s}s"
    return Outcome.HEADERS_TIMEOUT, f"{phase} timeout after {timeouts.headers_s}s"


def http_error(status: int, body: bytes) -> tuple[Outcome, str]:
    detail = bytes(body[:ERROR_BODY_LIMIT]).decode("utf-8", "replace").strip()
    return (Outcome.HTTP_4XX if status < 500 else Outcome.HTTP_5XX), f"HTTP {status}: {detail}"


def broken_outcome(exc: BaseException) -> tuple[Outcome, str]:
    """A response the HTTP parser could not read: an upgrade, an SSE event our timer refused
    while the parser ran, or bytes that are not HTTP."""
    if isinstance(exc, httptools.HttpParserUpgrade):
        return Outcome.MALFORMED, "server tried to upgrade the connection"
    cause = exc.__context__
    if isinstance(cause, StreamProtocolError):
        return Outcome.MALFORMED, str(cause)
    return Outcome.DISCONNECT, f"invalid HTTP response: {exc}"


class ResponseReader:
    """One response, read as it arrives. Every ``head``/``body``/``end``/``timed_out`` returns
    True once the outcome is decided (``outcome``, ``error``); later calls change nothing."""

    __slots__ = (
        "timer",
        "timeouts",
        "whole_ok",
        "phase",
        "status",
        "sse",
        "kept",
        "body_started",
        "last_event_ns",
        "outcome",
        "error",
    )

    def __init__(self, timer: StreamTimer, timeouts: PhaseTimeouts, *, whole_ok: bool = False) -> None:
        self.timer = timer
        self.timeouts = timeouts
        self.whole_ok = whole_ok  # a 2xx that is not an event stream is a whole answer, not MALFORMED
        self.phase = HEADERS
        self.status = 0
        self.sse: SSEParser | None = None
        self.kept = bytearray()  # an error body, or a whole answer
        self.body_started = False
        self.last_event_ns = 0
        self.outcome: Outcome | None = None
        self.error = ""

    @property
    def done(self) -> bool:
        return self.outcome is not None

    @property
    def streamed(self) -> bool:
        return self.sse is not None

    def decide(self, outcome: Outcome, error: str = "") -> bool:
        if self.outcome is None:
            self.outcome, self.error = outcome, error
        return True

    def finish(self, now: int) -> StreamResult:
        """The timer's record at ``now`` with the decided outcome (DISCONNECT if none was)."""
        if self.outcome is None:
            self.end(now)
        assert self.outcome is not None
        result = self.timer.finish(now, self.outcome, self.error)
        if not self.streamed and self.outcome is Outcome.OK:
            result.ttft_ms = result.ttft_event_ms = result.e2e_ms  # the whole answer is the first token
        return result

    # deadlines ---------------------------------------------------------------------------------
    def deadline_ns(self) -> int:
        """When the current phase runs out (never after the request's total)."""
        t, start = self.timeouts, self.timer.start_ns
        if self.phase == STALL:
            due = self.last_event_ns + int(t.stall_s * 1e9)
        elif self.phase in (FIRST_TOKEN, WHOLE_BODY):
            due = start + int(t.first_token_s * 1e9)
        else:
            due = start + int(t.headers_s * 1e9)
        return min(due, start + int(t.total_s * 1e9))

    def timed_out(self, now: int) -> bool:
        """A deadline fired at ``now``: decided if the current phase (or the total) ran out; False
        if events arrived since it was set (the caller sets ``deadline_ns()`` again)."""
        if self.done:
            return True
        total_ns = self.timer.start_ns + int(self.timeouts.total_s * 1e9)
        if now >= total_ns - 1_000_000:
            return self.decide(*timeout_outcome(self.phase, self.timeouts, total=True))
        if now < self.deadline_ns():
            return False
        return self.decide(*timeout_outcome(self.phase, self.timeouts))

    # the response as it arrives ------------------------------------------------------------------
    def head(self, now: int, status: int, content_type: bytes | str) -> bool:
        if self.done:
            return True
        ctype = content_type.decode("latin-1") if isinstance(content_type, bytes) else content_type
        self.status = status
        self.timer.headers(now, status)
        if status >= 400:
            self.phase = ERROR_BODY
            return False
        if status == 200 and ctype.startswith("text/event-stream"):
            self.sse = SSEParser()
            self.phase = FIRST_TOKEN
            return False
        if self.whole_ok and 200 <= status < 300:
            self.phase = WHOLE_BODY
            return False
        return self.decide(Outcome.MALFORMED, f"expected HTTP 200 text/event-stream, got {status} {ctype!r}")

    def body(self, now: int, data: bytes) -> bool:
        """One read of the body, arrived at ``now``."""
        sse = self.sse
        if sse is not None and self.body_started and self.outcome is None:  # a stream under way
            events = sse.feed_data(data)
            return self._events(events, now) if events else False
        if self.outcome is not None:
            return True
        if self.phase == HEADERS:
            raise RuntimeError("ResponseReader.body before head")
        if self.phase == ERROR_BODY:
            self.kept += data
            if len(self.kept) >= ERROR_BODY_LIMIT:
                return self.decide(*http_error(self.status, self.kept))
            return False
        if not self.body_started:
            self.body_started = True
            self.timer.body_bytes(now)
        if sse is None:
            if len(self.kept) < WHOLE_BODY_LIMIT:
                self.kept += data
            return False
        events = sse.feed_data(data)
        return self._events(events, now) if events else False

    def end(self, now: int) -> bool:
        """The body ended (the message complete, or the connection closed) at ``now``."""
        if self.done:
            return True
        if self.phase == HEADERS:
            return self.decide(Outcome.DISCONNECT, "server closed the connection before responding")
        if self.phase == ERROR_BODY:
            return self.decide(*http_error(self.status, self.kept))
        if self.sse is None:
            return self.decide(*whole_answer(self.timer, bytes(self.kept)))
        try:
            events = self.sse.finish()
        except StreamProtocolError as exc:
            return self.decide(Outcome.MALFORMED, str(exc))
        if events and self._events([ev.data for ev in events], now):
            return True
        return self.decide(Outcome.DISCONNECT, "stream ended before [DONE]")

    def broken(self, exc: BaseException) -> bool:
        """The HTTP parser refused the response (see ``broken_outcome``)."""
        return self.decide(*broken_outcome(exc))

    def _events(self, events: list[str], now: int) -> bool:
        timer = self.timer
        try:
            for data in events:
                status = timer.event(now, data)
                if status:
                    return self.decide(Outcome.OK if status == StreamTimer.DONE else Outcome.ENGINE_ERROR)
        except StreamProtocolError as exc:
            return self.decide(Outcome.MALFORMED, str(exc))
        self.last_event_ns = now
        if self.phase is FIRST_TOKEN and timer.first_content_seen:
            self.phase = STALL
        return False


def whole_answer(timer: StreamTimer, body: bytes) -> tuple[Outcome, str]:
    """A whole (not streamed) 2xx answer: its usage and finish reason into the timer's result."""
    try:
        obj: Any = json.loads(body)
    except ValueError:
        return Outcome.MALFORMED, "the response is not JSON"
    if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list):
        return Outcome.MALFORMED, "the response has no 'choices' list"
    r = timer.r
    usage = obj.get("usage")
    if isinstance(usage, dict):
        try:
            r.output_tokens = int(usage.get("completion_tokens") or 0)
            r.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            r.usage_reported = True
        except (TypeError, ValueError):
            return Outcome.MALFORMED, "usage counts are not integers"
    choices = obj["choices"]
    if choices and isinstance(choices[0], dict) and choices[0].get("finish_reason"):
        r.finish_reason = str(choices[0]["finish_reason"])
    return Outcome.OK, ""
