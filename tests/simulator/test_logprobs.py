"""The simulated model's next-token distributions (simulator/logprobs.py) and vLLM's
``prompt_logprobs`` on them: teacher-forced scoring (fidelity/scoring.py) of the simulator gives
exactly the model's KL, the reference scores itself at KL 0, and a bad request gets vLLM's
error."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib
import statistics

import httpx
import pytest

from fidelity.compare import TRUNCATION, truncated_kl
from fidelity.scoring import answer_request, parse_answer, parse_scoring, score, scoring_request
from simulator import answers, logprobs, tokens
from simulator.cli import validated
from simulator.latency import Profile
from simulator.profiles import PROFILES, get_profile
from simulator.serve import start_in_thread

FP16, AWQ, AWQ_FA2 = get_profile("fp16"), get_profile("awq"), get_profile("awq-fa2")
MODEL, K, TOKENS = "abplat-sim", 20, 16
# Prose, code, CJK and emoji: prompts of one, few and many pieces.
PROMPTS = [
    "Once upon a time",
    "for i in range(10):\n",
    "Tell me about 7.",
    "模型延迟 😀",
    "x",
    "SELECT * FROM t",
]
CAPTURES = pathlib.Path(__file__).parents[1] / "data" / "vllm-captures"


def quick(profile: Profile) -> Profile:
    """The profile's text and numbers on near-instant steps."""
    return dataclasses.replace(
        profile, prefill_ms_per_token=0.002, prefill_base_ms=0.2, decode_base_ms=0.5, decode_ms_per_seq=0.01
    )


@pytest.fixture(scope="module")
def sims():
    handles = {p.name: start_in_thread(quick(p)) for p in (FP16, AWQ, AWQ_FA2)}
    handles["small"] = start_in_thread(quick(FP16), max_logprobs=5)
    yield {name: h.url for name, h in handles.items()}
    for h in handles.values():
        h.stop()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json={"model": MODEL, **body}, trust_env=False, timeout=30)


def reference_ids(ids: list[int], n: int) -> list[int]:
    key = answers.prompt_key(prompt=ids)
    return [tokens.answer_id(t) for t in itertools.islice(answers.reference(key, FP16), n)]


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


# -- the pure model -------------------------------------------------------------------------


def test_after_a_prompt_the_most_likely_token_is_the_first_it_answers():
    for text in PROMPTS:
        ids = tokens.prompt_ids("bytes4", prompt=text)
        last = list(logprobs.contexts(ids, FP16))[-1]
        assert (last.key, last.position) == (answers.prompt_key(prompt=ids), 0)
        first = reference_ids(ids, 1)[0]
        assert tokens.ANSWER_BASE + argmax(logprobs.distribution(last, FP16)) == first


def test_teacher_forcing_the_reference_answer_keeps_the_prompt_as_anchor():
    for text in PROMPTS:
        prompt = tokens.prompt_ids("bytes4", prompt=text)
        answer = reference_ids(prompt, TOKENS)
        found = list(logprobs.contexts(prompt + answer, FP16))
        key = answers.prompt_key(prompt=prompt)
        for i, token in enumerate(answer):
            context = found[len(prompt) - 1 + i]  # the context before answer position i
            assert (context.key, context.position, context.greedy) == (key, i, token - tokens.ANSWER_BASE)
        scored = logprobs.prompt_logprobs(prompt + answer, FP16, K)
        assert [p.rank for p in scored[len(prompt) :]] == [1] * TOKENS
        # inside the prompt each position is a prompt of its own, and prompt pieces are impossible
        assert all(p.rank == tokens.VOCAB_SIZE and p.logprob == -math.inf for p in scored[1 : len(prompt)])


def test_an_answer_that_leaves_the_reference_is_anchored_afresh():
    prompt = tokens.prompt_ids("bytes4", prompt=PROMPTS[0])
    answer = reference_ids(prompt, 6)
    answer[3] = next(t for t in range(tokens.ANSWER_BASE, tokens.BYTES_BASE) if t != answer[3])
    found = list(logprobs.contexts(prompt + answer, FP16))
    after = found[len(prompt) + 3]  # the context ending with the departing token
    assert after.position < 4 and after.key != answers.prompt_key(prompt=prompt)


def test_a_numerical_change_perturbs_the_same_logits():
    context = logprobs.Context("k", 3, 7)
    base = logprobs.logits(context, FP16)
    assert logprobs.logits(context, dataclasses.replace(AWQ, logit_noise=0.0)) == base
    noisy = logprobs.logits(context, dataclasses.replace(AWQ, logit_noise=0.5))
    assert 0.3 < statistics.stdev(b - a for a, b in zip(base, noisy)) < 0.7
    assert logprobs.logits(context, dataclasses.replace(AWQ_FA2, logit_noise=0.5)) != noisy  # its own seed


def test_the_noise_keeps_a_16_token_answer_the_references_as_often_as_the_answers_do():
    for p in PROFILES.values():
        assert p.logit_noise == (logprobs.noise_for(p.divergence_rate) if p.divergence_rate else 0.0), p.name
    for rate in (0.06, 0.08, 0.5):
        q = logprobs.flip_probability(logprobs.noise_for(rate))
        assert (1 - q) ** logprobs.NOMINAL_POSITIONS == pytest.approx(1 - rate, abs=1e-12)
    assert round(AWQ.logit_noise, 4) == 0.0069 and round(AWQ_FA2.logit_noise, 4) == 0.0093
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="noise_for: divergence_rate"):
            logprobs.noise_for(bad)
    with pytest.raises(ValueError, match="logit_noise=-1 must be a finite number >= 0"):
        dataclasses.replace(AWQ, logit_noise=-1)


def test_flips_happen_as_often_as_flip_probability_says():
    """Counted over 5000 positions at a noise that flips ~4% of them (at awq's, ~0.4%, a test
    would need ten times as many). Tokens below the runner-up add a few percent to the rate."""
    profile = dataclasses.replace(AWQ, logit_noise=logprobs.noise_for(0.5))
    n = 5000
    flips = 0
    for i in range(n):
        context = logprobs.Context(f"flip {i}", i % 16, i % logprobs.SUPPORT)
        flips += argmax(logprobs.logits(context, profile)) != context.greedy
    q = logprobs.flip_probability(profile.logit_noise)
    assert abs(flips / n - q) <= 4 * math.sqrt(q * (1 - q) / n) + 0.05 * q, (flips / n, q)


def test_ranks_count_as_vllm_counts_and_ties_go_by_id():
    lps = [math.log(0.25)] * 2 + [math.log(0.5 / (logprobs.SUPPORT - 2))] * (logprobs.SUPPORT - 2)
    a, b, c = (tokens.ANSWER_BASE + i for i in range(3))
    tied = logprobs.score_position(lps, b, 3)
    assert (tied.rank, [t for t, _ in tied.top]) == (2, [a, b, c])  # the tokens at least as likely
    low = logprobs.score_position(lps, c, 1)
    assert low.rank == logprobs.SUPPORT and [t for t, _ in low.top] == [a]
    outside = logprobs.score_position(lps, tokens.BOS_ID, 0)
    assert (outside.logprob, outside.rank, outside.top) == (-math.inf, tokens.VOCAB_SIZE, ())
    with pytest.raises(ValueError, match="tokens with a probability"):
        logprobs.score_position(lps, a, logprobs.SUPPORT + 1)


def test_the_wire_shape_is_vllms():
    capture = json.loads((CAPTURES / "prompt_logprobs_float32.json").read_text())["choices"][0]
    ids = tokens.prompt_ids("bytes4", prompt=PROMPTS[2])
    ours = logprobs.as_vllm(logprobs.prompt_logprobs(ids, FP16, 3))
    for entries in (capture["prompt_logprobs"], ours):
        assert entries[0] is None
        for entry in entries[1:]:
            assert len(entry) in (3, 4) and all(
                set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values()
            )
            ranks = [v["rank"] for v in entry.values()]
            assert ranks[-3:] == [1, 2, 3] or (len(entry) == 3 and sorted(ranks) == [1, 2, 3])
    assert ours[1][str(ids[1])] == {"logprob": -9999.0, "rank": tokens.VOCAB_SIZE, "decoded_token": "Tell"}
    answer = reference_ids(ids, 2)
    forced = logprobs.as_vllm(logprobs.prompt_logprobs(ids + answer, FP16, 3))[-1]
    assert next(iter(forced)) == str(answer[1]) and forced[str(answer[1])]["rank"] == 1  # first, ranked 1


# -- through the app ------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_logprobs_are_exactly_the_models(sims, path):
    if path == "/v1/completions":
        body, where = {"prompt": PROMPTS[1]}, "choices"
        ids = tokens.prompt_ids("bytes4", prompt=PROMPTS[1])
    else:
        msgs = [{"role": "user", "content": PROMPTS[1]}]
        body, where = {"messages": msgs}, "top"  # vLLM's chat carries them beside its choices
        ids = tokens.prompt_ids("bytes4", messages=msgs)
    r = post(sims["awq"], path, {**body, "max_tokens": 1, "prompt_logprobs": 5, "return_token_ids": True})
    assert r.status_code == 200, r.text
    out = r.json()["choices"][0] if where == "choices" else r.json()
    assert out["prompt_token_ids"] == ids
    assert out["prompt_logprobs"] == logprobs.as_vllm(logprobs.prompt_logprobs(ids, AWQ, 5))


def direct(prompt: list[int], answer: list[int], profile: Profile) -> list[dict[int, float]]:
    """The model's top-k at each answer position, from its full distributions."""
    found = list(logprobs.contexts(prompt + answer, profile))[len(prompt) - 1 : -1]
    out = []
    for context in found:
        lps = logprobs.distribution(context, profile)
        order = sorted(range(logprobs.SUPPORT), key=lambda i: (-lps[i], i))[:K]
        out.append({tokens.ANSWER_BASE + i: lps[i] for i in order})
    return out


def test_teacher_forced_kl_from_the_simulator_is_the_models_kl(sims):
    """fp16's greedy answers scored under fp16, awq and awq-fa2 through vLLM's API and
    fidelity.scoring, against the same KL from the model's distributions: equal to 1e-9 at
    every position; fp16 under itself: KL 0 and top-1 agreement 1."""
    means: dict[str, list[float]] = {"awq": [], "awq-fa2": []}
    agreement: dict[str, list[float]] = {"awq": [], "awq-fa2": []}
    for text in PROMPTS:
        got = parse_answer(post(sims["fp16"], "/v1/completions", answer_request(MODEL, text, TOKENS)).json())
        prompt, answer = list(got.prompt_ids), list(got.answer_ids)
        assert answer == reference_ids(prompt, TOKENS)
        body = scoring_request(MODEL, prompt, answer, K)
        scored = {}
        for name in ("fp16", "awq", "awq-fa2"):
            r = post(sims[name], "/v1/completions", body)
            assert r.status_code == 200, r.text
            scored[name] = parse_scoring(r.json(), prompt, answer, K)
        itself = score(scored["fp16"], scored["fp16"])
        assert itself.max_kl == 0.0 and itself.top1_agreement == itself.reference_top1_agreement == 1.0
        ref = direct(prompt, answer, FP16)
        for name, profile in (("awq", AWQ), ("awq-fa2", AWQ_FA2)):
            s = score(scored["fp16"], scored[name])
            assert s.truncation == TRUNCATION.format(k=K) and s.measured == TOKENS
            want = [truncated_kl(r, c).kl for r, c in zip(ref, direct(prompt, answer, profile))]
            assert all(abs(x.kl - w) <= 1e-9 for x, w in zip(s.kl, want))
            assert abs(s.mean_kl - math.fsum(want) / TOKENS) <= 1e-9
            means[name].append(s.mean_kl)
            agreement[name].append(s.top1_agreement)
    # The size: about 0.37·noise² nats a position (simulator/logprobs.py, 7), fa2's the larger.
    awq, fa2 = statistics.mean(means["awq"]), statistics.mean(means["awq-fa2"])
    assert 0.15 * AWQ.logit_noise**2 < awq < 0.6 * AWQ.logit_noise**2
    assert 0.15 * AWQ_FA2.logit_noise**2 < fa2 < 0.6 * AWQ_FA2.logit_noise**2
    assert min(agreement["awq"] + agreement["awq-fa2"]) >= 0.9


def vllm_error(message: str, param: str | None, kind: str = "BadRequestError") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": 400}}


@pytest.mark.parametrize(
    "fields, expected",
    [
        # The bodies vLLM 0.32 sends (its request model's validators, SamplingParams' bound, its
        # exception handlers: entrypoints/serve/exception_handling).
        (
            {"prompt_logprobs": 2, "stream": True},
            vllm_error(
                "`prompt_logprobs` are not available when `stream=True`. (parameter=prompt_logprobs)",
                "prompt_logprobs",
            ),
        ),
        (
            {"prompt_logprobs": 21},
            vllm_error(
                "Requested prompt logprobs of 21, which is greater than max allowed: 20 "
                "(parameter=prompt_logprobs, value=21)",
                "prompt_logprobs",
            ),
        ),
        (
            {"prompt_logprobs": -1},
            vllm_error(
                f"Requested prompt logprobs of {tokens.VOCAB_SIZE}, which is greater than max allowed: 20 "
                f"(parameter=prompt_logprobs, value={tokens.VOCAB_SIZE})",
                "prompt_logprobs",
            ),
        ),
        (
            {"prompt_logprobs": -2},
            vllm_error(
                "`prompt_logprobs` must be a positive value or -1. (parameter=prompt_logprobs, value=-2)",
                "prompt_logprobs",
            ),
        ),
        (
            {"prompt_logprobs": "3"},
            vllm_error(
                "`prompt_logprobs` must be an integer. (parameter=prompt_logprobs, value=3)",
                "prompt_logprobs",
            ),
        ),
        (
            {"prompt_logprobs": 2.5},
            vllm_error(
                "1 validation error:\n  {'type': 'int_from_float', 'loc': 'body.prompt_logprobs', 'msg': "
                "'Input should be a valid integer, got a number with a fractional part', 'input': '2.5'}",
                "body.prompt_logprobs",
                "Bad Request",
            ),
        ),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_bad_prompt_logprobs_gets_vllms_error(sims, path, fields, expected):
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    r = post(sims["fp16"], path, {**body, "max_tokens": 2, **fields})
    assert (r.status_code, r.json()) == (400, expected)


def test_the_bound_is_the_servers_max_logprobs_and_zero_is_the_forced_token_alone(sims):
    five = post(sims["small"], "/v1/completions", {"prompt": "x y z", "prompt_logprobs": 5})
    assert five.status_code == 200 and all(
        len(e) in (5, 6) for e in five.json()["choices"][0]["prompt_logprobs"][1:]
    )
    six = post(sims["small"], "/v1/completions", {"prompt": "x y z", "prompt_logprobs": 6})
    assert six.status_code == 400 and "greater than max allowed: 5" in six.json()["error"]["message"]
    zero = post(sims["fp16"], "/v1/completions", {"prompt": "x y z", "prompt_logprobs": 0})
    assert {len(e) for e in zero.json()["choices"][0]["prompt_logprobs"][1:]} == {1}
    streamed = post(sims["fp16"], "/v1/completions", {"prompt": "x", "prompt_logprobs": 0, "stream": True})
    assert streamed.status_code == 200  # vLLM refuses only a positive k (or -1) with a stream
    with pytest.raises(ValueError, match="--max-logprobs 99: must be within"):
        validated({"port": 8100, "profile": None, "serve": [], "replicas": 1, "max_logprobs": 99})
