"""streaming/response.py: the reader's phases, their deadlines and what each end means, with an
injected clock (nanoseconds from the request's start)."""

from __future__ import annotations

import httptools
import pytest

from streaming.client import Timeouts
from streaming.response import ERROR_BODY_LIMIT, FIRST_TOKEN, HEADERS, STALL, ResponseReader, timeout_outcome
from streaming.result import Outcome, StreamResult
from streaming.timing import StreamTimer

S = 1_000_000_000
T = Timeouts(connect_s=1, headers_s=2, first_token_s=5, stall_s=3, total_s=20)
ROLE = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
TOKEN = (
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
)


def reader(**kw) -> ResponseReader:
    return ResponseReader(StreamTimer(0, StreamResult(request_id="r")), T, **kw)


def streaming() -> ResponseReader:
    r = reader()
    assert not r.head(1 * S, 200, b"text/event-stream; charset=utf-8")
    return r


def test_each_phase_has_its_own_deadline_and_outcome():
    r = reader()
    assert (r.phase, r.deadline_ns()) == (HEADERS, 2 * S)
    r = streaming()
    assert (r.phase, r.deadline_ns()) == (FIRST_TOKEN, 5 * S)
    assert not r.body(2 * S, ROLE)  # a role chunk is not content: still the first token's phase
    assert r.phase == FIRST_TOKEN
    assert not r.body(4 * S, TOKEN)
    assert (r.phase, r.deadline_ns()) == (STALL, 7 * S)
    assert not r.body(6 * S, TOKEN)
    assert r.deadline_ns() == 9 * S
    assert not r.timed_out(7 * S)  # an event arrived since the deadline was set: not yet
    assert r.timed_out(9 * S) and (r.outcome, r.error) == (Outcome.STALL, "stall timeout after 3s")
    assert r.finish(9 * S).outcome is Outcome.STALL


def test_the_total_caps_every_phase():
    r = streaming()
    r.body(2 * S, TOKEN)
    for k in range(3, 20, 2):
        r.body(k * S, TOKEN)
    assert r.deadline_ns() == 20 * S
    assert r.timed_out(20 * S) and r.outcome is Outcome.TOTAL_TIMEOUT


@pytest.mark.parametrize(
    "phase, outcome",
    [
        (HEADERS, Outcome.HEADERS_TIMEOUT),
        ("error body", Outcome.HEADERS_TIMEOUT),
        (FIRST_TOKEN, Outcome.FIRST_TOKEN_TIMEOUT),
        (STALL, Outcome.STALL),
    ],
)
def test_the_one_table_of_timeouts(phase, outcome):
    assert timeout_outcome(phase, T)[0] is outcome
    assert timeout_outcome(phase, T, total=True)[0] is Outcome.TOTAL_TIMEOUT


def test_an_error_body_is_read_up_to_its_limit_for_the_message():
    r = reader()
    assert not r.head(1 * S, 404, b"application/json")
    assert not r.body(1 * S, b'{"error": "no such model"}')
    assert r.end(2 * S) and (r.outcome, r.error) == (Outcome.HTTP_4XX, 'HTTP 404: {"error": "no such model"}')
    big = reader()
    big.head(1 * S, 502, b"text/html")
    assert big.body(1 * S, b"x" * (ERROR_BODY_LIMIT + 10))  # decided at the limit, not at the end
    assert big.outcome is Outcome.HTTP_5XX and len(big.error) == len("HTTP 502: ") + ERROR_BODY_LIMIT


def test_what_is_not_an_event_stream_is_malformed_unless_a_whole_answer_is_wanted():
    r = reader()
    assert r.head(1 * S, 200, b"application/json")
    assert r.outcome is Outcome.MALFORMED and "expected HTTP 200 text/event-stream" in r.error
    whole = reader(whole_ok=True)
    assert not whole.head(1 * S, 200, b"application/json")
    whole.body(
        2 * S, b'{"choices":[{"finish_reason":"stop"}],"usage":{"completion_tokens":7,"prompt_tokens":3}}'
    )
    assert whole.end(3 * S) and whole.outcome is Outcome.OK
    res = whole.finish(3 * S)
    assert (res.output_tokens, res.prompt_tokens, res.finish_reason) == (7, 3, "stop")
    assert res.ttft_ms == res.e2e_ms == 3000.0  # the whole answer is the first token


def test_the_ends_of_a_stream():
    r = streaming()
    assert r.body(2 * S, TOKEN + b"data: [DONE]\n\n") and r.outcome is Outcome.OK
    assert not streaming().body(2 * S, TOKEN)
    cut = streaming()
    cut.body(2 * S, TOKEN)
    assert cut.end(3 * S) and (cut.outcome, cut.error) == (Outcome.DISCONNECT, "stream ended before [DONE]")
    tail = streaming()  # [DONE] in the last read, without the blank line after it
    tail.body(2 * S, TOKEN + b"data: [DONE]")
    assert tail.end(3 * S) and tail.outcome is Outcome.OK
    assert reader().end(1 * S) and reader().end(1 * S)
    never = reader()
    never.end(1 * S)
    assert (never.outcome, never.error) == (
        Outcome.DISCONNECT,
        "server closed the connection before responding",
    )
    engine = streaming()
    assert (
        engine.body(2 * S, b'data: {"error":{"message":"boom"}}\n\n')
        and engine.outcome is Outcome.ENGINE_ERROR
    )
    bad = streaming()
    assert bad.body(2 * S, b"data: {nope\n\n") and bad.outcome is Outcome.MALFORMED


def test_the_first_decision_stands():
    r = streaming()
    r.body(2 * S, TOKEN + b"data: [DONE]\n\n")
    assert r.timed_out(30 * S) and r.end(31 * S) and r.decide(Outcome.CANCELLED)
    assert r.outcome is Outcome.OK


def test_broken_http_is_a_disconnect_and_an_upgrade_is_malformed():
    r = reader()
    assert r.broken(httptools.HttpParserError("bad")) and r.outcome is Outcome.DISCONNECT
    up = reader()
    assert up.broken(httptools.HttpParserUpgrade("h2c")) and up.outcome is Outcome.MALFORMED
