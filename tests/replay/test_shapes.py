"""Request shapes: chat messages go to chat variants, prompts to completions
variants; a mismatch is converted only by a documented rule the user chose, or refused before
anything is sent, naming the lines and the variants."""

import pytest

from replay import shapes
from replay.sources import TraceRequest

CHAT_MSGS = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"})


def req(seq, *, messages=None, prompt=None, line=None):
    return TraceRequest(
        seq=seq,
        offset_s=0.0,
        user_id="u",
        prompt_tokens=0 if messages or prompt else 12,
        max_tokens=4,
        messages=messages,
        prompt=prompt,
        line=line or seq + 1,
    )


def test_chat_messages_to_a_completions_variant_are_refused_naming_lines_and_variants():
    reqs = [req(i, messages=CHAT_MSGS, line=2 * i + 1) for i in range(8)] + [req(8, prompt="x")]
    with pytest.raises(shapes.ShapeError) as info:
        shapes.check(reqs, {"fp16": "chat", "awq-fa2": "completions"}, wrap_prompt=True)
    message = str(info.value)
    assert "8 line(s) (1, 3, 5, 7, 9 and 3 more) give chat `messages`" in message
    assert "variant(s) awq-fa2 take completions" in message and "--render-chat plain" in message
    assert "nothing was sent" in message and "fp16" not in message


def test_prompt_lines_to_a_chat_variant_are_refused_unless_wrapping_is_asked_for():
    reqs = [req(0, prompt="hello"), req(1, messages=CHAT_MSGS)]
    with pytest.raises(shapes.ShapeError, match=r"1 line\(s\) \(1\) give a completions `prompt`.*fp16"):
        shapes.check(reqs, {"fp16": "chat"})
    shapes.check(reqs, {"fp16": "chat"}, wrap_prompt=True)
    assert shapes.payload(reqs[0], None, "chat", wrap_prompt=True) == [{"role": "user", "content": "hello"}]
    with pytest.raises(shapes.ShapeError):
        shapes.payload(reqs[0], None, "chat")


def test_both_mismatches_are_named_at_once():
    reqs = [req(0, prompt="p"), req(1, messages=CHAT_MSGS)]
    with pytest.raises(shapes.ShapeError) as info:
        shapes.check(reqs, {"a": "chat", "b": "completions"})
    assert "give chat `messages`" in str(info.value) and "give a completions `prompt`" in str(info.value)


def test_plain_rendering_is_the_documented_template():
    assert shapes.render_plain(CHAT_MSGS) == "system: Be brief.\n\nuser: Hi\n\nassistant:"
    r = req(0, messages=CHAT_MSGS)
    shapes.check([r], {"c": "completions"}, render_chat="plain")
    assert shapes.payload(r, None, "completions", render_chat="plain") == shapes.render_plain(CHAT_MSGS)
    assert shapes.payload(r, None, "chat", render_chat="plain") == [dict(m) for m in CHAT_MSGS]


def test_synthetic_prompts_fit_both_apis():
    r = req(0)
    shapes.check([r], {"a": "chat", "b": "completions"})
    assert shapes.payload(r, "the and", "completions") == "the and"
    assert shapes.payload(r, "the and", "chat") == [{"role": "user", "content": "the and"}]


def test_bad_options_named():
    with pytest.raises(ValueError, match="render_chat must be one of"):
        shapes.check([], {"a": "chat"}, render_chat="jinja")
    with pytest.raises(ValueError, match="unknown api"):
        shapes.check([], {"a": "embeddings"})
