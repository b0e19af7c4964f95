"""The simulator's answers: keyed on the prompt, sampled as vLLM samples, and departing from the
reference answer at a profile's divergence_rate, with the departure's position as ground truth
(simulator/answers.py, driven through the app in a thread of this process)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import httpx
import pytest

from simulator import answers
from simulator.latency import Profile
from simulator.profiles import PROFILES, get_profile
from simulator.serve import start_in_thread

FP16, AWQ = get_profile("fp16"), get_profile("awq")
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def quick(profile: Profile, **changes) -> Profile:
    """The profile's answers on near-instant steps: its latency fields do not touch its text."""
    return dataclasses.replace(
        profile,
        prefill_ms_per_token=0.002,
        prefill_base_ms=0.2,
        decode_base_ms=0.5,
        decode_ms_per_seq=0.01,
        **changes,
    )


@pytest.fixture(scope="module")
def sims():
    handles = {
        "fp16": start_in_thread(quick(FP16)),
        "awq-same": start_in_thread(quick(AWQ, name="awq-same", divergence_rate=0.0)),
        "awq-always": start_in_thread(quick(AWQ, name="awq-always", divergence_rate=1.0)),
    }
    yield {name: h.url for name, h in handles.items()}
    for h in handles.values():
        h.stop()


def body(path: str, prompt: str, max_tokens: int = 20, **fields) -> dict:
    req = {"model": "abplat-sim", "max_tokens": max_tokens, **fields}
    if path == CHAT:
        req["messages"] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": prompt}]
    else:
        req["prompt"] = prompt
    return req


def ask(url: str, path: str, req: dict, rid: str | None = None) -> tuple[list[str], dict]:
    """A streamed request's token texts (one per token event, empty ones included) and truth."""
    stream = {**req, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"x-request-id": rid} if rid else {}
    r = httpx.post(url + path, json=stream, headers=headers, trust_env=False, timeout=10)
    assert r.status_code == 200, r.text
    texts, truth = [], None
    for event in r.text.split("\n\n"):
        if not event.startswith("data: {"):
            continue
        data = json.loads(event[6:])
        if data.get("usage"):
            truth = data["usage"]["abplat"]
        for choice in data["choices"]:
            if path == CHAT:
                if "role" not in choice["delta"]:  # the role event carries no token
                    texts.append(choice["delta"]["content"])
            else:
                texts.append(choice["text"])
    assert truth is not None
    return texts, truth


# -- through the app ------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_greedy_answers_are_the_same_on_every_variant_that_does_not_diverge(sims, path):
    for i in range(5):
        req = body(path, f"what is {i} plus {i}?", temperature=0)
        ref, ref_truth = ask(sims["fp16"], path, req, rid=f"a{i}")
        same, same_truth = ask(sims["awq-same"], path, req, rid=f"b{i}")
        assert len(ref) == 20 and "".join(ref)
        assert same == ref
        assert ref_truth["diverged_at"] is None and same_truth["diverged_at"] is None


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_diverging_variant_departs_exactly_where_its_truth_says(sims, path):
    positions = set()
    for i in range(8):
        req = body(path, f"tell me about {i}", temperature=0)
        ref, _ = ask(sims["fp16"], path, req)
        got, truth = ask(sims["awq-always"], path, req)
        at = truth["diverged_at"]
        assert isinstance(at, int) and 0 <= at < 20
        assert got[:at] == ref[:at]
        assert got[at] != ref[at] and got[at] != ""
        assert len(got) == len(ref) == 20
        positions.add(at)
    assert len(positions) > 1  # the position is drawn, not fixed


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_whole_response_says_what_the_stream_says(sims, path):
    req = body(path, "once more", temperature=0)
    texts, truth = ask(sims["awq-always"], path, req)
    r = httpx.post(sims["awq-always"] + path, json=req, trust_env=False, timeout=10)
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if path == CHAT else choice["text"]
    assert text == "".join(texts)
    assert r.json()["usage"]["abplat"] == {"diverged_at": truth["diverged_at"]}
    assert truth["diverged_at"] is not None


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_shorter_answer_is_a_prefix_of_a_longer_one(sims, path):
    short, _ = ask(sims["fp16"], path, body(path, "count to ten", max_tokens=5, temperature=0))
    long, _ = ask(sims["fp16"], path, body(path, "count to ten", max_tokens=20, temperature=0))
    assert len(short) == 5 and long[:5] == short


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_sampling_answers_afresh_per_request_unless_a_seed_is_given(sims, path):
    url = sims["fp16"]
    req = body(path, "write a poem")  # no temperature: vLLM samples at 1.0
    first, _ = ask(url, path, req, rid="s1")
    assert ask(url, path, req, rid="s2")[0] != first
    assert ask(url, path, req, rid="s1")[0] == first  # a replayed request id answers alike
    assert ask(url, path, req)[0] != ask(url, path, req)[0]  # ids the server makes up differ too
    seeded = {**req, "seed": 7}
    assert ask(url, path, seeded, rid="s3")[0] == ask(url, path, seeded, rid="s4")[0]
    assert ask(url, path, {**req, "seed": 8}, rid="s3")[0] != ask(url, path, seeded, rid="s3")[0]
    # Sampled at temperature 1.0 is what an absent temperature samples at.
    assert ask(url, path, {**seeded, "temperature": 1.0})[0] == ask(url, path, seeded)[0]
    # Greedy decoding ignores the seed and the id: the answer is the prompt's.
    greedy = ask(url, path, {**seeded, "temperature": 0}, rid="g1")[0]
    assert ask(url, path, {**req, "temperature": 0.0, "seed": 9}, rid="g2")[0] == greedy


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.5),
        ("temperature", "hot"),
        ("temperature", True),
        ("temperature", [1]),
        ("seed", 1.5),
        ("seed", "7"),
        ("seed", False),
        ("seed", 2**64),
    ],
)
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_bad_temperature_or_seed_is_a_400_naming_it(sims, path, field, value):
    req = body(path, "x", **{field: value})
    for stream in (False, True):
        r = httpx.post(sims["fp16"] + path, json={**req, "stream": stream}, trust_env=False, timeout=10)
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["message"].startswith(f"{field} must be") and json.dumps(value) in error["message"]
        assert (error["type"], error["param"], error["code"]) == ("BadRequestError", field, 400)


# -- the pure model -------------------------------------------------------------------------


def keys(n: int) -> list[str]:
    return [answers.prompt_key(prompt=f"prompt number {i}") for i in range(n)]


def within_binomial(hits: int, n: int, p: float, z: float = 4.0) -> bool:
    return abs(hits / n - p) <= z * math.sqrt(p * (1 - p) / n)


def test_the_share_of_diverging_requests_is_the_rate():
    profile = dataclasses.replace(AWQ, divergence_rate=0.25)
    n = 2000
    hits = sum(answers.answer(k, profile, 16).diverged_at is not None for k in keys(n))
    assert within_binomial(hits, n, 0.25)


def test_the_departure_is_uniform_over_the_positions_and_at_one_only():
    profile = dataclasses.replace(AWQ, divergence_rate=1.0)
    n, max_tokens = 4000, 4
    counts = [0] * max_tokens
    for k in keys(n):
        got = answers.answer(k, profile, max_tokens)
        ref = list(itertools.islice(answers.reference(k, profile), max_tokens))
        at = got.diverged_at
        assert got.texts[:at] == tuple(ref[:at]) and got.texts[at] not in ("", ref[at])
        counts[at] += 1
    assert all(within_binomial(c, n, 1 / max_tokens) for c in counts), counts


def test_two_diverging_profiles_diverge_on_independent_requests():
    a = dataclasses.replace(AWQ, divergence_rate=0.5, seed=1)
    b = dataclasses.replace(AWQ, divergence_rate=0.5, seed=2)
    n = 2000
    both = sum(
        answers.diverges_at(k, a, 8) is not None and answers.diverges_at(k, b, 8) is not None for k in keys(n)
    )
    assert within_binomial(both, n, 0.25)


def test_whether_a_request_diverges_does_not_depend_on_max_tokens():
    profile = dataclasses.replace(AWQ, divergence_rate=0.3)
    for k in keys(300):
        assert (answers.diverges_at(k, profile, 1) is None) == (answers.diverges_at(k, profile, 500) is None)


def test_a_request_that_does_not_diverge_gets_exactly_the_reference():
    for k in keys(200):
        got = answers.answer(k, AWQ, 12)
        ref = tuple(itertools.islice(answers.reference(k, FP16), 12))
        assert (got.texts == ref) == (got.diverged_at is None)


def test_the_reference_ignores_the_seed_but_follows_the_text_rates():
    k = answers.prompt_key(prompt="hello")
    ref = list(itertools.islice(answers.reference(k, FP16), 400))
    assert ref == list(itertools.islice(answers.reference(k, dataclasses.replace(FP16, seed=99)), 400))
    assert tuple(ref[:5]) == answers.answer(k, FP16, 5).texts
    # Other rates pick other kinds at some positions; where both pick a word it is the same word.
    fast = list(itertools.islice(answers.reference(k, get_profile("fast")), 400))
    assert "" in fast and any(t in answers.MULTIBYTE for t in fast)
    words = [i for i, t in enumerate(fast) if t.startswith(" ")]
    assert words and all(fast[i] == ref[i] for i in words)


def test_the_departing_token_is_not_empty_even_where_most_tokens_are():
    mostly_empty = dataclasses.replace(AWQ, empty_token_rate=0.9, multibyte_rate=0.1, divergence_rate=1.0)
    for k in keys(200):
        got = answers.answer(k, mostly_empty, 6)
        assert got.texts[got.diverged_at] != ""


def test_prompt_keys_follow_the_prompt_as_sent():
    msgs = [{"role": "user", "content": "hi", "name": "x"}]
    reordered = [{"name": "x", "content": "hi", "role": "user"}]
    assert answers.prompt_key(messages=msgs) == answers.prompt_key(messages=reordered)
    distinct = {
        answers.prompt_key(prompt="1"),
        answers.prompt_key(prompt=[1]),
        answers.prompt_key(messages=[{"role": "user", "content": "1"}]),
        answers.prompt_key(prompt="2"),
    }
    assert len(distinct) == 4
    with pytest.raises(ValueError, match="exactly one"):
        answers.prompt_key()


def test_answer_keys_follow_vllms_sampling():
    p = answers.prompt_key(prompt="x")

    def key(temperature, seed, rid):
        return answers.answer_key(p, temperature=temperature, seed=seed, request_id=rid)

    assert key(0.0, 1, "a") == key(0.0, None, "b") == key(1e-6, 5, "c") == p  # greedy: the prompt's
    assert key(None, 3, "a") == key(None, 3, "b") == key(1.0, 3, "c")  # same seed, same answer
    assert key(None, 3, "a") != key(None, 4, "a") != key(0.7, 4, "a")
    assert key(None, None, "a") != key(None, None, "b")  # no seed: a fresh answer per request
    assert key(None, None, "3") != key(None, 3, "3")


def test_temperature_and_seed_are_checked_like_vllm_checks_them():
    assert answers.check_temperature(None) is None and answers.check_temperature(0) == 0.0
    assert answers.check_seed(None) is None and answers.check_seed(-(2**63)) == -(2**63)
    for bad in (-1, float("nan"), float("inf"), "1", True):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            answers.check_temperature(bad)
    for bad in (2**63, 1.0, "1", True):
        with pytest.raises(ValueError, match="seed must be an integer"):
            answers.check_seed(bad)


def test_the_shipped_rates_and_a_bad_rate_is_named():
    rates = {name: p.divergence_rate for name, p in PROFILES.items()}
    assert rates == {
        "default": 0.0,
        "fp16": 0.0,
        "awq": 0.06,
        "awq-fa2": 0.08,
        "fast": 0.0,
        "saturating": 0.0,
        "chaos": 0.0,
    }
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="'awq': divergence_rate=.* must be within"):
            dataclasses.replace(AWQ, divergence_rate=bad)
