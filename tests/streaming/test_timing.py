from __future__ import annotations

import dataclasses
import json
import pathlib
import random

import pytest

from stats.quantiles import nearest_rank
from streaming import timing
from streaming.result import Outcome
from streaming.sse import SSEParser
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
    # the report pools these over requests; the per-request statistics still come from the ns gaps
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


# --- the template fast path: exactly json.loads' result, or json.loads itself -------------------

CAPTURES = pathlib.Path(__file__).parents[1] / "data" / "vllm-captures"


def reference() -> StreamTimer:
    """A timer that decodes every event with json.loads (the fast path never learns)."""
    t = StreamTimer(0)
    t._learn = False
    return t


def outcome(timer: StreamTimer, t_ns: int, data: str) -> tuple:
    try:
        return ("returned", timer.event(t_ns, data))
    except StreamProtocolError as e:
        return ("raised", str(e))


def state(timer: StreamTimer) -> tuple:
    return (
        timer._token_times,
        timer._first_event_ns,
        timer._first_content_ns,
        timer._end_ns,
        timer.done,
        dataclasses.asdict(timer.r),
    )


def same_as_json_loads(events: list[str]) -> StreamTimer:
    """Feed both timers the same events: every event's return (or error) and the final state
    must be the same; returns the fast one."""
    fast, ref = StreamTimer(0), reference()
    for i, data in enumerate(events):
        assert outcome(fast, (i + 1) * MS, data) == outcome(ref, (i + 1) * MS, data), data
        assert state(fast) == state(ref), data
    assert dataclasses.asdict(fast.finish(len(events) * MS, Outcome.OK)) == dataclasses.asdict(
        ref.finish(len(events) * MS, Outcome.OK)
    )
    return fast


def capture(name: str) -> list[str]:
    p = SSEParser()
    return [e.data for e in p.feed((CAPTURES / name).read_bytes()) + p.finish()]


@pytest.mark.parametrize("name", ["sse_chat.txt", "sse_completion.txt", "sse_chat_engine_error.txt"])
def test_real_vllm_streams_give_exactly_what_json_loads_gives(name, monkeypatch):
    events = capture(name)
    loads = []
    real = json.loads
    monkeypatch.setattr(timing.json, "loads", lambda s: loads.append(s) or real(s))
    fast = same_as_json_loads(events)
    if name == "sse_chat_engine_error.txt":
        return
    tokens = [e for e in events if '"finish_reason":null' in e and '"role"' not in e]
    assert fast._template is not None
    # decoded: the role event, the first token (and its probe), the last token, usage, on both
    # timers; every other token event only on the reference
    fast_loads = len(loads) - (len(events) - 1)  # the reference decodes every event but [DONE]
    assert fast_loads == len(events) - 1 - (len(tokens) - 1) + 1


def test_the_simulator_streams_take_the_fast_path_and_give_the_same():
    from simulator.framing import Framer

    for api in ("chat", "completions"):
        f = Framer(api, "cmpl-1", 1795992910, "m")
        frames = [f.role()] if api == "chat" else []
        frames += [f.token(text) for text in ["", "a", "é", '"q"', "\\", "\n", "\u2028", "😀"]]
        frames += [f.token("z", "length"), f.usage(7, 9, {"server_ttft_ms": 1.5, "first_content_ns": 3})]
        p = SSEParser()
        events = [e.data for e in p.feed(b"".join(frames) + b"data: [DONE]\n\n") + p.finish()]
        fast = same_as_json_loads(events)
        assert fast._template is not None, api


def _token(text_json: str) -> str:
    return (
        '{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":'
        + text_json
        + ',"logprobs":null,"finish_reason":null,"stop_reason":null}]}'
    )


@pytest.mark.parametrize(
    "middle",
    [
        '""',
        '"a"',
        '"\\u00e9"',
        '"\\ud83d\\ude00"',
        '"\\ud800"',
        '"\u2028"',
        '"😀"',
        '"\\"',
        '"a\\"',
        '"\\q"',
        '"\\u12"',
        '"\\u12g4"',
        '"a\x01"',
        '"a\x7f"',
        '"\t"',
        "null",
        "1",
        '"a" ',
        ' "a"',
        '"a","x":1',
        '"a","text":"b"',
        '"a"}]},{"x":"',
        '"a',
        'a"',
        '"',
        '"a""b"',
        '"\\/\\b\\f\\n\\r\\t\\\\"',
        "'a'",
        '"a"\n',
        "NaN",
        '["a"]',
        '{"a":1}',
        '"a\\\\"',
        '"\\\\\\""',
    ],
)
def test_hostile_events_after_a_learned_template_are_exactly_json_loads(middle):
    assert same_as_json_loads([_token('"first"'), _token(middle), _token('"last"')])._template is not None


def test_random_texts_in_the_template_are_exactly_json_loads():
    rng = random.Random(14)
    alphabet = [
        '"',
        "\\",
        "u",
        "0",
        "d",
        "8",
        "f",
        "a",
        "n",
        "t",
        "/",
        "\x00",
        "\x1f",
        " ",
        ",",
        ":",
        "}",
        "]",
        "é",
    ]
    events = [_token('"first"')]
    for _ in range(3000):
        events.append(_token('"' + "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8))) + '"'))
    fast = same_as_json_loads(events)
    assert fast._template is not None


@pytest.mark.parametrize(
    "first",
    [
        # the text is not the last key's: json.loads keeps the last of duplicate keys
        '{"choices":[{"index":0,"text":"a","text":"b","finish_reason":null}]}',
        '{"choices":[{"index":0,"text":"b","finish_reason":null}],"choices":[{"index":0,"text":"c"}]}',
        # the text's key appears again later, in a value
        '{"choices":[{"index":0,"text":"a","finish_reason":null}],"x":"\\"text\\":\\"q\\""}',
        '{"choices":[{"index":0,"text":"a","finish_reason":null}],"x":{"text":"q"}}',
        # no string where the text is, or NaN (never equal to itself)
        '{"choices":[{"index":0,"text":null,"finish_reason":null}]}',
        '{"choices":[{"index":0,"text":"a","finish_reason":null}],"n":NaN}',
        '{"choices":[{"index":0,"delta":{"content":"a"},"text":"b"}]}',
        '{"choices":[{"index":0,"delta":{"content":"a","content":"b"}}]}',
        '{"choices":[{"index":0,"delta":{"content":null}}]}',
        '{ "choices" : [ { "index" : 0 , "text" : "a" , "finish_reason" : null } ] }',
    ],
)
def test_odd_first_events_learn_no_template_or_a_correct_one(first):
    variants = [first.replace('"a"', m, 1) for m in ('""', '"zz"', '"q"', "null", '"\\u0041"', '"x\x01"')]
    same_as_json_loads([first, *variants, first.replace('"b"', '"y"'), first])


def _fingerprinted(events: list[str], fingerprint: bool = True, outcome: Outcome = Outcome.OK):
    t = StreamTimer(0, fingerprint=fingerprint)
    for i, data in enumerate(events):
        t.event((i + 1) * MS, data)
    return t.finish((len(events) + 1) * MS, outcome)


def test_fingerprints_are_those_of_the_texts_on_the_template_path_and_off_it():
    """Token events after the first take the template path (no json.loads); their texts, escapes
    included, fingerprint exactly as the decoded texts do."""
    from fidelity.fingerprints import output_fp, token_fp

    texts = ["", "He", "llo", ' "quoted"', "\\back", "日本", "\n", "é"]
    r = _fingerprinted([chat(role=True)] + [chat(t) for t in texts] + ["[DONE]"])
    assert r.token_fps == [token_fp(t) for t in texts]
    assert r.output_fp == output_fp(texts) != 0
    assert token_fp("") != 0  # an empty text is not a missing position
    # the same answer cut into other chunks: the same output_fp, other token fingerprints
    other = _fingerprinted([chat("Hello"), chat(' "quoted"\\back日本\né'), "[DONE]"])
    assert other.output_fp == r.output_fp and other.token_fps != r.token_fps
    assert _fingerprinted([chat("Hellp"), "[DONE]"]).output_fp != r.output_fp


def test_no_fingerprints_unless_asked_or_when_the_answer_is_not_whole():
    events = [chat("a"), chat("b"), "[DONE]"]
    off = _fingerprinted(events, fingerprint=False)
    assert (off.output_fp, off.token_fps) == (0, [])
    cut = _fingerprinted(events[:2], outcome=Outcome.DISCONNECT)
    assert (cut.output_fp, cut.token_fps) == (0, [])
