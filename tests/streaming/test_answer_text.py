"""An answer's text, kept where the experiment allows it: joined from the chunks the timer already
keeps for the fingerprints, only for a whole answer, and capped at a stated size without ever
cutting a character in two."""

from __future__ import annotations

import json

import pytest

from fidelity.fingerprints import output_fp
from streaming.client import VariantClient
from streaming.result import ANSWER_TEXT_MAX_BYTES, Outcome, capped_answer
from streaming.timing import StreamTimer

MS = 1_000_000


def chat(content: str | None = None, role: bool = False) -> str:
    delta: dict = {"role": "assistant", "content": ""} if role else {"content": content}
    return json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})


def completion(text: str) -> str:
    return json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": None}]})


def streamed(events: list[str], outcome: Outcome = Outcome.OK, **kw):
    t = StreamTimer(0, **kw)
    for i, data in enumerate(events):
        t.event((i + 1) * MS, data)
    return t.finish((len(events) + 1) * MS, outcome)


def test_the_text_is_the_answers_chunks_joined_on_and_off_the_template_path():
    # after the first plain token event the rest take the template path (no json.loads):
    # escapes, quotes and unicode come out as json.loads reads them
    texts = ["", "He", "llo", ' "quoted"', "\\back", "日本", "\n", "é", "\u2028"]
    r = streamed([chat(role=True), *(chat(t) for t in texts), "[DONE]"], fingerprint=True, keep_text=True)
    assert r.answer_text == "".join(texts)
    assert r.output_fp == output_fp([r.answer_text])  # the text the fingerprint is of
    done = streamed([completion("def f"), completion("(x):"), "[DONE]"], fingerprint=True, keep_text=True)
    assert done.answer_text == "def f(x):"


def test_no_text_unless_asked_and_none_of_an_answer_that_is_not_whole():
    events = [chat("a"), chat("b"), "[DONE]"]
    fingerprinted = streamed(events, fingerprint=True)
    assert fingerprinted.output_fp != 0 and fingerprinted.answer_text == ""
    assert streamed(events).answer_text == ""
    cut = streamed(events[:2], Outcome.DISCONNECT, fingerprint=True, keep_text=True)
    assert (cut.answer_text, cut.output_fp) == ("", 0)
    with pytest.raises(ValueError, match="keep_text: the text is joined from the chunks fingerprint keeps"):
        StreamTimer(0, keep_text=True)
    with pytest.raises(ValueError, match=r"keep_text: .* only with their fingerprints \(fingerprint=True\)"):
        VariantClient("http://127.0.0.1:9/v1", "m", keep_text=True)


def test_a_long_answer_is_capped_at_the_stated_size_never_inside_a_character():
    assert ANSWER_TEXT_MAX_BYTES == 16 * 1024
    # 2-byte characters after an odd number of ASCII bytes: the cap falls inside the last one
    text = "x" + "é" * ANSWER_TEXT_MAX_BYTES
    kept = capped_answer(text)
    assert len(kept.encode()) == ANSWER_TEXT_MAX_BYTES - 1 and text.startswith(kept)
    r = streamed([chat(text[:5000]), chat(text[5000:]), "[DONE]"], fingerprint=True, keep_text=True)
    assert r.answer_text == kept and r.output_fp == output_fp([text])  # the fingerprint is of all of it
    # every place a cap can fall in a 4-byte character, and ASCII, which is cut by characters
    for limit in range(8, 13):
        got = capped_answer("abcdefgh🙂🙂", limit)
        assert got == "abcdefgh" + "🙂" * ((limit - 8) // 4) and len(got.encode()) <= limit
    assert capped_answer("a" * 100, 10) == "a" * 10 and capped_answer("日本", 6) == "日本"
    assert capped_answer("", 4) == ""


def test_a_lone_surrogate_is_stored_as_a_question_mark():
    # JSON may escape half of a surrogate pair; it is no character and UTF-8 cannot hold it
    half = '{"choices":[{"index":0,"delta":{"content":"\\ud800b"}}]}'
    r = streamed([chat("a"), half, "[DONE]"], fingerprint=True, keep_text=True)
    assert r.answer_text == "a?b"
    assert capped_answer("\ud83d\ude42 and \udc00", 9) == "?? and ?"
