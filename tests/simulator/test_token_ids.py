"""The simulator's token ids (simulator/tokens.py): a prompt's and an answer's ids, as
``return_token_ids`` returns them and as a prompt given as ids is read, on vLLM's fields."""

from __future__ import annotations

import json

import httpx
import pytest

from fidelity.scoring import answer_request, parse_answer
from simulator import answers, tokens
from simulator.serve import start_in_thread

TEXTS = [
    "",
    "   ",
    "x",
    "The quick brown fox",
    "def main():\n    return 1\n",
    "你好世界 这是一个测试 😀",
    "the model token and a word",
]
MODEL = "abplat-sim"


@pytest.fixture(scope="module", params=tokens.TOKENIZERS)
def sim(request):
    handle = start_in_thread("fast", tokenizer=request.param)
    handle.tokenizer = request.param
    yield handle
    handle.stop()


def post(sim, path: str, body: dict) -> httpx.Response:
    return httpx.post(sim.url + path, json={"model": MODEL, **body}, trust_env=False, timeout=10)


# -- the pure tokenizer ---------------------------------------------------------------------


@pytest.mark.parametrize("rule", tokens.TOKENIZERS)
def test_a_prompts_ids_are_as_many_as_its_count_and_never_answer_tokens(rule):
    for text in TEXTS:
        ids = tokens.prompt_ids(rule, prompt=text)
        assert ids == tokens.prompt_ids(rule, prompt=text)  # the same text, the same ids
        assert len(ids) == tokens.prompt_tokens(rule, prompt=text)
        assert ids[0] == tokens.BOS_ID and not any(tokens.is_answer_id(t) for t in ids)
        assert all(0 <= t < tokens.VOCAB_SIZE for t in ids)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": TEXTS[4]}, {"role": "x"}]
    chat = tokens.prompt_ids(rule, messages=msgs)
    assert len(chat) == tokens.prompt_tokens(rule, messages=msgs)
    assert [tokens.decode(t) for t in chat[:3]] == ["<|im_start|>", "system", "\n"]
    assert [tokens.decode(t) for t in chat[-3:]] == ["<|im_start|>", "assistant", "\n"]
    ends = [i for i, t in enumerate(chat) if t == tokens.IM_END_ID]
    assert [tokens.decode(chat[i + 2]) for i in ends[:2]] == ["user", "<unk>"]  # an unknown role


def test_ids_decode_back_to_their_tokens():
    for text in TEXTS:  # bytes4: exactly the text, byte pieces joined before decoding
        assert tokens.decode_ids(tokens.text_ids(text, "bytes4")) == text
    # small-vocab: the words, each after one space (whitespace runs come back as one space)
    assert tokens.decode_ids(tokens.text_ids("def main():\n    return 1\n", "small-vocab")) == (
        "def main(): return 1"
    )
    assert tokens.decode_ids(tokens.text_ids(" 你好世界 the", "small-vocab")) == " 你好世界 the"
    for i, text in enumerate(answers.VOCABULARY):
        assert (
            tokens.answer_id(text) == tokens.ANSWER_BASE + i and tokens.decode(tokens.ANSWER_BASE + i) == text
        )
    assert tokens.decode(tokens.VOCAB_SIZE - 1) is not None
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokens.decode(tokens.VOCAB_SIZE)
    with pytest.raises(KeyError, match="not a token the simulated model generates"):
        tokens.answer_id("hello")


def test_prefix_keys_are_the_prompt_keys_of_each_prefix():
    ids = tokens.prompt_ids("bytes4", prompt=TEXTS[5]) + [tokens.answer_id(" the"), 0, 123456789]
    keys = answers.prefix_keys(ids)
    assert keys == [answers.prompt_key(prompt=ids[:s]) for s in range(len(ids) + 1)]


# -- through the app ------------------------------------------------------------------------


def test_return_token_ids_gives_the_prompts_and_the_answers_ids(sim):
    for text in TEXTS[2:]:
        r = post(sim, "/v1/completions", answer_request(MODEL, text, 12))
        assert r.status_code == 200, r.text
        got = parse_answer(r.json())
        assert list(got.prompt_ids) == tokens.prompt_ids(sim.tokenizer, prompt=text)
        assert r.json()["usage"]["prompt_tokens"] == len(got.prompt_ids)
        stream = post(sim, "/v1/completions", {**answer_request(MODEL, text, 12), "stream": True})
        texts = [json.loads(e[6:])["choices"][0]["text"] for e in stream.text.split("\n\n")[:-2]]
        assert list(got.answer_ids) == [tokens.answer_id(t) for t in texts]  # one id a token event
        assert "".join(tokens.decode(t) for t in got.answer_ids) == r.json()["choices"][0]["text"]
        # /tokenize names the same ids, and a prompt given as its ids answers as its text does
        assert post(sim, "/tokenize", {"prompt": text}).json()["tokens"] == list(got.prompt_ids)
        again = parse_answer(post(sim, "/v1/completions", answer_request(MODEL, got.prompt_ids, 12)).json())
        assert again == got


def test_without_return_token_ids_the_fields_are_null(sim):
    choice = post(sim, "/v1/completions", {"prompt": "x", "max_tokens": 2}).json()["choices"][0]
    assert (choice["token_ids"], choice["prompt_token_ids"], choice["prompt_logprobs"]) == (None, None, None)


def test_chat_returns_token_ids_where_vllm_puts_them(sim):
    msgs = [{"role": "user", "content": "hello there"}]
    body = {"messages": msgs, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    whole = post(sim, "/v1/chat/completions", body).json()
    # vLLM's chat response: the prompt's ids beside the choices, the answer's in the choice
    assert whole["prompt_token_ids"] == tokens.prompt_ids(sim.tokenizer, messages=msgs)
    answer = whole["choices"][0]["token_ids"]
    assert "".join(tokens.decode(t) for t in answer) == whole["choices"][0]["message"]["content"]
    stream = post(sim, "/v1/chat/completions", {**body, "stream": True})
    events = [json.loads(e[6:]) for e in stream.text.split("\n\n") if e.startswith("data: {")]
    assert events[0]["prompt_token_ids"] == whole["prompt_token_ids"]  # the role event, once
    assert "prompt_token_ids" not in events[1]
    assert [t for e in events[1:] for t in e["choices"][0]["token_ids"]] == answer


def test_a_completion_stream_sends_the_prompts_ids_in_its_first_event(sim):
    body = {**answer_request(MODEL, "count to three", 5), "stream": True}
    events = [
        json.loads(e[6:])["choices"][0] for e in post(sim, "/v1/completions", body).text.split("\n\n")[:-2]
    ]
    assert events[0]["prompt_token_ids"] == tokens.prompt_ids(sim.tokenizer, prompt="count to three")
    assert all(e["prompt_token_ids"] is None for e in events[1:])
    assert [e["token_ids"] for e in events] == [[tokens.answer_id(e["text"])] for e in events]


@pytest.mark.parametrize(
    "prompt, status, error",
    [
        # vLLM 0.32's bodies: its renderer's check (renderers/base.py) and its input processor's
        ([1, tokens.VOCAB_SIZE], 400, (f"Token id {tokens.VOCAB_SIZE} is out of", "BadRequestError", None)),
        ([], 400, ("The decoder prompt cannot be empty", "BadRequestError", None)),
        # and what its request model (pydantic) says first: type "Bad Request", param the location
        ([1, -1], 400, ("Input should be greater than or equal to 0", "Bad Request", "body.prompt.1")),
        ([1, "a"], 400, ("unable to parse string as an integer", "Bad Request", "body.prompt.1")),
        ([2.5], 400, ("got a number with a fractional part", "Bad Request", "body.prompt.0")),
        ([None], 400, ("Input should be a valid integer", "Bad Request", "body.prompt.0")),
        ([[1, 2]], 400, ("not a batch", "BadRequestError", None)),
        (3, 400, ("a string or a list of token ids is required", "BadRequestError", None)),
    ],
)
def test_bad_token_ids_get_vllms_errors(sim, prompt, status, error):
    r = post(sim, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert r.status_code == status
    body = r.json()["error"]
    assert error[0] in body["message"] and (body["type"], body["param"], body["code"]) == (*error[1:], status)


def test_lax_ids_and_flags_pass_as_pydantic_reads_them(sim):
    body = answer_request(MODEL, [1, 2, 3], 3)
    strict = post(sim, "/v1/completions", body).json()
    lax = post(sim, "/v1/completions", {**body, "prompt": [True, 2.0, "3"], "return_token_ids": "yes"})
    assert lax.json()["choices"][0]["token_ids"] == strict["choices"][0]["token_ids"]
    bad = post(sim, "/v1/completions", {"prompt": "x", "return_token_ids": "maybe"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "body.return_token_ids"
