"""The simulator's /tokenize: vLLM's shape, and the very count a generation then reports."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from replay.prompts import synth_words
from simulator.serve import start_in_thread
from simulator.tokens import prompt_tokens, text_tokens
from streaming.client import VariantClient
from streaming.probe import token_counter


@pytest.fixture(scope="module", params=["bytes4", "small-vocab"])
def sim(request):
    handle = start_in_thread("fast", tokenizer=request.param)
    handle.tokenizer = request.param
    yield handle
    handle.stop()


def test_small_vocab_is_not_one_word_a_token():
    text = synth_words(3, 64)
    assert text_tokens(text, "bytes4") == 64
    assert 80 <= text_tokens(text, "small-vocab") <= 112  # ~1.5 tokens a word, word by word
    assert prompt_tokens("small-vocab", messages=[{"role": "user", "content": text}]) == 7 + text_tokens(
        text, "small-vocab"
    )


def test_tokenize_answers_like_vllm_and_matches_the_usage_count(sim):
    text = synth_words(5, 40)
    with httpx.Client(base_url=sim.url, trust_env=False, timeout=5) as c:
        chat = c.post(
            "/tokenize", json={"model": "abplat-sim", "messages": [{"role": "user", "content": text}]}
        )
        cmpl = c.post("/tokenize", json={"prompt": text}).json()
        assert chat.status_code == 200 and set(chat.json()) == {"count", "max_model_len", "tokens"}
        assert (
            len(chat.json()["tokens"])
            == chat.json()["count"]
            == prompt_tokens(sim.tokenizer, messages=[{"role": "user", "content": text}])
        )
        assert cmpl["count"] == 1 + text_tokens(text, sim.tokenizer)
        wrong = c.post("/tokenize", json={"model": "other", "prompt": "x"})
        assert wrong.status_code == 404 and "does not exist" in wrong.json()["error"]["message"]
        assert c.post("/tokenize", json={"prompt": 3}).status_code == 400
        assert c.get("/tokenize").status_code == 405

    async def go(api):
        async with VariantClient(sim.url, "abplat-sim", api) as v:
            return await v.stream(f"tok-{api}", text, 2)

    assert asyncio.run(go("chat")).prompt_tokens == chat.json()["count"]
    assert asyncio.run(go("completions")).prompt_tokens == cmpl["count"]


def test_probe_counts_on_the_variants_api_and_says_why_not():
    h = start_in_thread("fast", tokenizer="small-vocab")
    try:

        async def go():
            counter, why = await token_counter(h.url + "/v1", "abplat-sim", "chat")
            assert counter is not None and why == ""
            try:
                counts = await counter.count(["the and", synth_words(1, 10)])
            finally:
                await counter.aclose()
            missing, why_model = await token_counter(h.url, "nope", "chat")
            dead, why_dead = await token_counter("http://127.0.0.1:1", "abplat-sim", "chat", timeout_s=1)
            return counts, counter.max_model_len, (missing, why_model), (dead, why_dead)

        counts, max_len, (missing, why_model), (dead, why_dead) = asyncio.run(go())
    finally:
        h.stop()
    assert counts[0] == 7 + 2 and counts[1] == 7 + text_tokens(synth_words(1, 10), "small-vocab")
    assert max_len == 8192
    assert missing is None and "HTTP 404" in why_model
    assert dead is None and "ConnectError" in why_dead


def test_counts_are_kept_per_url_model_and_api_for_their_ttl(sim):
    from streaming import probe

    probe.COUNTS.clear()
    text = synth_words(11, 50)

    async def count(model, api, *texts):
        counter, why = await token_counter(sim.url + "/v1", model, api)
        assert counter is not None, why
        try:
            got = [await counter.count_one(t) for t in texts]
            return got, counter.calls
        finally:
            await counter.aclose()

    first, calls = asyncio.run(count("abplat-sim", "completions", text, text))
    assert first[0] == first[1] == 1 + text_tokens(text, sim.tokenizer)
    assert calls == 2  # the liveness probe, then the text once: the second count is kept
    again, calls = asyncio.run(count("abplat-sim", "completions", text))
    assert again == first[:1] and calls == 1  # another counter, the same process: only the probe
    chat, calls = asyncio.run(count("abplat-sim", "chat", text))
    assert calls == 2 and chat[0] == prompt_tokens(
        sim.tokenizer, messages=[{"role": "user", "content": text}]
    )
    # past the TTL the server is asked again
    now = [0.0]
    cache = probe.CountCache(ttl_s=10.0, clock=lambda: now[0])
    key = cache.key("u", "m", "completions", text)
    cache.put(key, 7, 2048)
    assert cache.get(key) == (7, 2048)
    now[0] = 10.5
    assert cache.get(key) is None and (cache.hits, cache.misses) == (1, 1)
    # the least recently used goes first past the bound
    small = probe.CountCache(entries=2)
    keys = [small.key("u", "m", "chat", f"t{i}") for i in range(3)]
    small.put(keys[0], 1, None)
    small.put(keys[1], 2, None)
    assert small.get(keys[0]) == (1, None)
    small.put(keys[2], 3, None)
    assert small.get(keys[1]) is None and small.get(keys[0]) == (1, None) and small.get(keys[2]) == (3, None)
    probe.COUNTS.clear()
