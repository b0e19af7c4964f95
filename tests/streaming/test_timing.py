from __future__ import annotations

import json

import pytest

from stats.quantiles import nearest_rank
from streaming.result import Outcome
from streaming.timing import StreamProtocolError, StreamTimer

MS = 1_000_000


def chat(content: str | None = None, role: bool = False, finish: str | None = None) -> str:
    delta: dict = {"role": "assistant", "content": ""} if role else {"content": content}
    return json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def usage(completion: int, prompt: int = 5, truth: dict | None = None) -> str:
    u = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if truth:
        u["abplat"] = truth
    return json.dumps({"choices": [], "usage": u})


def test_three_ttft_definitions_and_itl_from_fake_times():
    t = StreamTimer(start_ns=1_000 * MS)
    t.headers(1_010 * MS, 200)
    t.body_bytes(1_020 * MS)
    assert t.event(1_020 * MS, chat(role=True)) == StreamTimer.MORE
    t.event(1_030 * MS, chat(""))  # a token that decodes to empty text
    t.event(1_040 * MS, chat("a"))
    t.event(1_045 * MS, chat("b"))
    t.event(1_065 * MS, chat("c", finish="length"))
    t.event(1_066 * MS, usage(4, truth={"server_ttft_ms": 39.5, "first_content_ns": 5}))
    assert t.event(1_067 * MS, "[DONE]") == StreamTimer.DONE
    r = t.finish(1_070 * MS, Outcome.OK)
    assert r.ttfb_ms == 10 and r.first_byte_ms == 20
    assert r.ttft_event_ms == 20  # vLLM: the role event has non-empty choices
    assert r.ttft_ms == 40  # first non-empty content
    assert r.chunks == 4  # the role event is not a token
    assert r.output_tokens == 4 and r.usage_reported and r.prompt_tokens == 5
    assert (r.itl_mean_ms, r.itl_max_ms) == (35 / 3, 20)
    assert (r.itl_p50_ms, r.itl_p99_ms) == (10, 20)  # gaps 5, 10, 20: ranks ceil(1.5), ceil(2.97)
    assert r.tpot_ms == pytest.approx((65 - 40) / 3)
    assert r.e2e_ms == 67  # [DONE], not finish()'s time
    assert r.finish_reason == "length"
    assert r.server_ttft_ms == 39.5 and r.server_first_content_ns == 5


def test_without_usage_the_token_count_falls_back_to_chunks():
    t = StreamTimer(0)
    for i, c in enumerate("abc"):
        t.event((i + 1) * MS, chat(c))
    t.event(4 * MS, "[DONE]")
    r = t.finish(5 * MS, Outcome.OK)
    assert r.output_tokens == 3 and not r.usage_reported


def test_completions_events_count_text_and_finish_reason():
    t = StreamTimer(0)
    ev = {"choices": [{"index": 0, "text": "x", "finish_reason": "stop"}]}
    t.event(3 * MS, json.dumps(ev))
    r = t.finish(4 * MS, Outcome.OK)
    assert r.ttft_ms == r.ttft_event_ms == 3 and r.finish_reason == "stop"


def test_in_stream_error_is_reported_with_its_message():
    t = StreamTimer(0)
    err = '{"error": {"message": "EngineCore died", "type": "InternalServerError", "code": 500}}'
    assert t.event(2 * MS, err) == StreamTimer.ENGINE_ERROR
    r = t.finish(3 * MS, Outcome.ENGINE_ERROR)
    assert "EngineCore died" in r.error and "500" in r.error and r.e2e_ms == 2


@pytest.mark.parametrize(
    "data, message",
    [
        ('{"choices": [{"delta": ', "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"id": "x"}', "no 'choices'"),
        ('{"choices": [{"index": 0}]}', "neither 'delta' nor 'text'"),
        ('{"choices": [], "usage": {"completion_tokens": "many"}}', "not integers"),
        ('{"choices": [{"delta": {"content": 5}}]}', "not a string"),
    ],
)
def test_malformed_events_raise_a_protocol_error_naming_the_problem(data, message):
    with pytest.raises(StreamProtocolError, match=message):
        StreamTimer(0).event(MS, data)


def test_itl_quantiles_are_exact_order_statistics_and_bad_input_is_rejected():
    # The project's one quantile convention (nearest rank): x_(ceil(q * n)), never interpolated.
    t = StreamTimer(0)
    for i, at_ms in enumerate((10, 14, 17, 19, 20)):  # gaps 4, 3, 2, 1 ms, out of order
        t.event(at_ms * MS, chat("abcde"[i]))
    r = t.finish(21 * MS, Outcome.OK)
    assert (r.itl_p50_ms, r.itl_p99_ms, r.itl_max_ms) == (2.0, 4.0, 4.0)  # interpolating: 2.5, 3.97
    assert nearest_rank([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert nearest_rank([1.0, 2.0, 3.0, 4.0], 0.99) == 4.0
    with pytest.raises(ValueError, match="no values"):
        nearest_rank([], 0.5)
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        nearest_rank([1.0], 1.01)


def test_every_gap_is_kept_in_arrival_order_in_whole_microseconds_rounded_half_up():
    # issue 14: the report pools these over requests; the per-request statistics stay as they were
    t = StreamTimer(0)
    t.event(1 * MS, chat(role=True))  # the role event is not a token: no gap before the first
    at = [10 * MS, 10 * MS + 12_499, 10 * MS + 24_999, 10 * MS + 25_000, 15 * MS, 15 * MS + 1_500]
    for i, t_ns in enumerate(at):
        t.event(t_ns, chat("abcdef"[i]))
    t.event(16 * MS, usage(6))
    r = t.finish(17 * MS, Outcome.OK)
    # gaps in ns: 12_499, 12_500, 1, 4_975_000, 1_500 -> 12, 13 (half up), 0, 4975, 2 us
    assert r.itl_gaps_us == [12, 13, 0, 4975, 2]
    assert len(r.itl_gaps_us) == r.output_tokens - 1 == r.chunks - 1
    assert r.itl_max_ms == 4.975 and r.itl_p50_ms == 0.012499  # still from the ns gaps, sorted


def test_a_single_token_has_no_gap_and_a_clock_step_back_counts_as_zero():
    t = StreamTimer(0)
    t.event(5 * MS, chat("a"))
    assert t.finish(6 * MS, Outcome.OK).itl_gaps_us == []
    t = StreamTimer(0)
    t.event(5 * MS, chat("a"))
    t.event(5 * MS - 2_000, chat("b"))  # an earlier stamp than the one before (never negative)
    assert t.finish(6 * MS, Outcome.OK).itl_gaps_us == [0]
