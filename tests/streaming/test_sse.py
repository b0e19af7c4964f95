from __future__ import annotations

import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streaming.sse import SSEEvent, SSEParser

CAPTURES = pathlib.Path(__file__).parents[1] / "data" / "vllm-captures"


def parse(chunks: list[bytes]) -> tuple[list[SSEEvent], int]:
    p = SSEParser()
    out: list[SSEEvent] = []
    for c in chunks:
        out += p.feed(c)
    out += p.finish()
    return out, p.comments


def data(chunks: list[bytes]) -> list[str]:
    return [e.data for e in parse(chunks)[0]]


def test_a_vllm_chat_capture_parses_to_its_ten_events_ending_in_done():
    raw = (CAPTURES / "sse_chat.txt").read_bytes()
    events = data([raw])
    assert len(events) == 11
    assert events[0].startswith('{"id":"chatcmpl-')
    assert '"choices":[]' in events[-2]
    assert events[-1] == "[DONE]"


def test_lf_crlf_and_lone_cr_line_endings_give_the_same_events():
    lf = b"data: a\n\ndata: b\ndata: c\n\n"
    assert data([lf]) == data([lf.replace(b"\n", b"\r\n")]) == data([lf.replace(b"\n", b"\r")])
    assert data([lf]) == ["a", "b\nc"]


def test_crlf_split_between_cr_and_lf_is_one_line_end_not_two():
    events = data([b"data: a\r", b"\n\r", b"\ndata: b\r\n\r\n"])
    assert events == ["a", "b"]


def test_multibyte_utf8_split_across_chunks_is_reassembled():
    raw = 'data: {"content":"你好😀"}\n\n'.encode()
    cut = raw.index("好".encode()) + 1  # inside the 3-byte character
    assert data([raw[:cut], raw[cut:]]) == ['{"content":"你好😀"}']


def test_comments_and_keepalives_are_counted_not_dispatched():
    events, comments = parse([b": ping\n\n:keep-alive\ndata: x\n\n: ping\n\n"])
    assert [e.data for e in events] == ["x"]
    assert comments == 3


def test_last_event_without_trailing_blank_line_is_dispatched_at_eof():
    assert data([b"data: a\n\ndata: [DONE]"]) == ["a", "[DONE]"]
    assert data([b"data: a\n\ndata: [DONE]\n"]) == ["a", "[DONE]"]


def test_field_rules_follow_the_spec():
    events, _ = parse([b"event: x\nid: 7\ndata:no-space\ndata:  two\nretry: 5\nfoo: bar\n\n"])
    assert events == [SSEEvent("no-space\n two", "x", "7")]
    # a line without a colon is a field name with an empty value
    assert data([b"data\n\n"]) == [""]
    # a blank line with no data dispatches nothing
    assert data([b"event: x\n\n\n\n"]) == []


def test_feed_after_finish_is_an_error():
    p = SSEParser()
    p.finish()
    with pytest.raises(ValueError, match="after finish"):
        p.feed(b"data: x\n\n")


def test_invalid_utf8_is_replaced_not_raised():
    assert data([b"data: \xff\xfe\n\n"]) == ["\ufffd\ufffd"]


# Property: any split of a valid stream parses to the same events. ------------------------

_text = st.text(
    alphabet=st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)),
    max_size=30,
)
_event = st.tuples(st.lists(_text, min_size=1, max_size=3), st.booleans())


@st.composite
def streams(draw: st.DrawFn) -> tuple[bytes, list[str]]:
    eol = draw(st.sampled_from([b"\n", b"\r\n", b"\r"]))
    events = draw(st.lists(_event, min_size=1, max_size=8))
    out = b""
    expected = []
    for lines, comment in events:
        if comment:
            out += b": keep-alive" + eol
        out += b"".join(b"data: " + ln.encode() + eol for ln in lines) + eol
        expected.append("\n".join(lines))
    if draw(st.booleans()):  # sometimes the last blank line is missing at EOF
        out = out[: -len(eol)]
    return out, expected


@settings(max_examples=300, deadline=None)
@given(streams(), st.lists(st.integers(min_value=0, max_value=10_000), max_size=20))
def test_any_split_of_a_valid_stream_parses_to_the_same_events(stream, cuts):
    raw, expected = stream
    points = sorted({c % (len(raw) + 1) for c in cuts})
    chunks = [raw[a:b] for a, b in zip([0, *points], [*points, len(raw)])]
    assert b"".join(chunks) == raw
    assert data(chunks) == expected
    assert data([raw]) == expected


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=1, max_value=7))
def test_a_capture_fed_n_bytes_at_a_time_matches_the_whole(n):
    raw = (CAPTURES / "sse_chat.txt").read_bytes() + "data: 中文😀\n\n".encode()
    assert data([raw[i : i + n] for i in range(0, len(raw), n)]) == data([raw])


def data_only(chunks: list[bytes]) -> list[str]:
    p = SSEParser()
    out: list[str] = []
    for c in chunks:
        out += p.feed_data(c)
    return out + [e.data for e in p.finish()]


@settings(max_examples=300, deadline=None)
@given(streams(), st.lists(st.integers(min_value=0, max_value=10_000), max_size=20))
def test_feed_data_gives_exactly_the_data_feed_gives_in_any_split(stream, cuts):
    # the client's data-only parse (no SSEEvent per event) is the same parse
    raw, expected = stream
    points = sorted({c % (len(raw) + 1) for c in cuts})
    chunks = [raw[a:b] for a, b in zip([0, *points], [*points, len(raw)])]
    assert data_only(chunks) == data(chunks) == expected


def test_feed_data_follows_the_field_rules_too():
    raw = b"data:no-space\ndata:  two\nevent: x\nid: 7\nretry: 5\n: c\ndata\n\ndata: [DONE]\n\n"
    assert data_only([raw]) == data([raw]) == ["no-space\n two\n", "[DONE]"]


def events_of(chunks: list[bytes]) -> list[SSEEvent]:
    p = SSEParser()
    out: list[SSEEvent] = []
    for c in chunks:
        out += p.feed(c)
    return out + p.finish()


@pytest.mark.parametrize("name", ["sse_chat.txt", "sse_completion.txt", "sse_chat_engine_error.txt"])
def test_one_event_per_read_as_the_server_writes_them_parses_as_byte_by_byte(name):
    raw = (CAPTURES / name).read_bytes()
    per_event = [e + b"\n\n" for e in raw.split(b"\n\n") if e]
    assert b"".join(per_event) == raw
    one_byte = [raw[i : i + 1] for i in range(len(raw))]
    assert events_of(per_event) == events_of(one_byte) == events_of([raw])
    assert data_only(per_event) == [e.data for e in events_of(one_byte)]


@pytest.mark.parametrize(
    "chunks",
    [
        [b"event: tok\n", b"data: a\n\n", b"data: b\n\n"],  # the type applies to the next event only
        [b"id: 7\n", b"data: a\n\n", b"data: b\n\n"],  # the id persists
        [b"data: a\n", b"data: b\n\n"],  # a data line pending: joined, not a new event
        [b"data: a\r", b"\ndata: b\n\n"],  # a CR whose LF came in the next read
        [b"data: a", b"data: b\n\n"],  # an unterminated line first: one line "data: adata: b"
        [b"data: a\r\n\r\n", b"data: b\n\n", b"data:c\n\n", b"data: \xff\n\n", b"data: x\ny\n\n"],
        [b"data: a\n\n\n", b"data: [DONE]\n\n"],
    ],
)
def test_whole_event_reads_after_any_state_parse_as_byte_by_byte(chunks):
    raw = b"".join(chunks)
    one_byte = [raw[i : i + 1] for i in range(len(raw))]
    assert events_of(chunks) == events_of(one_byte)
    assert data_only(chunks) == [e.data for e in events_of(one_byte)]
