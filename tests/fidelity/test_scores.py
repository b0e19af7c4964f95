"""The scoring pass's pure parts (fidelity.scores): which requests a share picks, what a failed
call means, and one row per variant for every request picked, whatever failed."""

from __future__ import annotations

import hashlib
import math

import pytest

from fidelity import scores
from fidelity.scoring import Position

REQUEST = scores.Request(experiment="e", run_id=7, seq=3, user_id="u1", control="fp16", top_k=2)
L = math.log


def pos(token: int, top: dict[int, float]) -> Position:
    """A position forcing ``token``, with the top-k ``top`` (its logprob read from it, or -5)."""
    lp = top.get(token, -5.0)
    return Position(token, lp, 1 + sum(v > lp for v in top.values()), dict(top))


REFERENCE = (pos(1, {1: L(0.6), 2: L(0.3)}), pos(2, {2: L(0.5), 3: L(0.25)}))
CANDIDATE = (pos(1, {1: L(0.5), 2: L(0.4)}), pos(2, {3: L(0.5), 2: L(0.25)}))


def test_a_request_is_chosen_by_the_documented_hash_below_the_share():
    for seq in range(200):
        u = (
            int.from_bytes(hashlib.blake2b(f"fidelity-score:v1:7:{seq}".encode(), digest_size=8).digest())
            / 2**64
        )
        for share in (0.0, 0.1, 0.5, 1.0):
            assert scores.chosen(7, seq, share) is (u < share)


def test_the_chosen_set_is_about_the_share_and_grows_with_it():
    seqs = range(4000)
    half, tenth = scores.choose(11, seqs, 0.5), scores.choose(11, seqs, 0.1)
    assert scores.choose(11, list(seqs) * 2, 0.5) == half  # each once, in order, every time
    assert set(tenth) <= set(half)  # a larger share scores a superset
    assert abs(len(half) - 2000) < 4 * math.sqrt(4000 * 0.25)
    assert abs(len(tenth) - 400) < 4 * math.sqrt(4000 * 0.09)
    assert scores.choose(11, seqs, 1.0) == list(seqs) and scores.choose(11, seqs, 0.0) == []
    assert scores.choose(12, seqs, 0.5) != half  # another run, other requests


@pytest.mark.parametrize("share", [-0.1, 1.5, "0.5", True, math.nan])
def test_a_share_outside_0_to_1_is_refused(share):
    with pytest.raises(ValueError, match="share: a number from 0 to 1"):
        scores.chosen(1, 1, share)


def test_a_refusal_naming_logprobs_is_a_server_without_prompt_logprobs():
    body = '{"error": {"message": "Requested prompt logprobs of 20, which is greater than max allowed: 0"}}'
    outcome, error = scores.refusal(400, body)
    assert outcome == scores.NO_PROMPT_LOGPROBS
    assert error.startswith("HTTP 400: the server refuses prompt_logprobs: ") and "max allowed: 0" in error
    assert scores.refusal(503, "overloaded\n  try later") == (
        scores.HTTP_ERROR,
        "HTTP 503: overloaded try later",
    )
    assert scores.refusal(400, "bad model")[0] == scores.HTTP_ERROR
    ignored = ValueError(
        "scoring: choices[0].prompt_logprobs is None, not a list: the server ignored the prompt_logprobs parameter (not vLLM?)"
    )
    assert scores.unreadable(ignored)[0] == scores.NO_PROMPT_LOGPROBS
    assert scores.unreadable(ValueError("scoring: 3 entries for 4 prompt tokens"))[0] == scores.BAD_RESPONSE


def test_a_scored_variant_carries_its_sums_and_the_control_its_noise_floor():
    rows = scores.compared_rows(
        REQUEST, {"fp16": scores.Scoring(REFERENCE), "awq": scores.Scoring(CANDIDATE)}
    )
    control, awq = rows
    assert control == {
        "experiment": "e",
        "variant": "fp16",
        "run_id": 7,
        "seq": 3,
        "user_id": "u1",
        "control": "fp16",
        "top_k": 2,
        "outcome": "ok",
        "error": "",
        "positions": 2,
        "kl_sum": 0.0,
        "kl_max": 0.0,
        "top1_agree": 2,
    }
    # by hand: position 0 shares {1, 2}, rest 0.1 vs 0.1; position 1 shares {2, 3}, rest 0.25 vs 0.25
    kl0 = 0.6 * L(0.6 / 0.5) + 0.3 * L(0.3 / 0.4) + 0.1 * L(0.1 / 0.1)
    kl1 = 0.5 * L(0.5 / 0.25) + 0.25 * L(0.25 / 0.5) + 0.25 * L(0.25 / 0.25)
    assert awq["outcome"] == "ok" and awq["positions"] == 2
    assert awq["kl_sum"] == pytest.approx(kl0 + kl1, rel=1e-12)
    assert awq["kl_max"] == pytest.approx(max(kl0, kl1), rel=1e-12)
    assert awq["top1_agree"] == 1  # position 1: token 3 is the candidate's most likely, not 2


def test_every_failure_leaves_one_row_per_variant_saying_why():
    failed = scores.failed_rows(REQUEST, ["fp16", "awq"], scores.CONTROL_ERROR, "HTTP 500: boom")
    assert [(r["variant"], r["outcome"], r["error"], r["positions"]) for r in failed] == [
        ("fp16", "control_error", "HTTP 500: boom", 0),
        ("awq", "control_error", "HTTP 500: boom", 0),
    ]
    refused = scores.Scoring(None, scores.NO_PROMPT_LOGPROBS, "HTTP 400: the server refuses prompt_logprobs")
    rows = scores.compared_rows(
        REQUEST, {"fp16": scores.Scoring(REFERENCE), "awq": refused, "awq-fa2": scores.Scoring(CANDIDATE)}
    )
    assert [(r["variant"], r["outcome"]) for r in rows] == [
        ("fp16", "ok"),
        ("awq", "no_prompt_logprobs"),
        ("awq-fa2", "ok"),
    ]
    # the control's own scoring failed: nothing to compare with, every row says so
    rows = scores.compared_rows(
        REQUEST,
        {"fp16": scores.Scoring(None, scores.HTTP_ERROR, "HTTP 502: gone"), "awq": scores.Scoring(CANDIDATE)},
    )
    assert [(r["variant"], r["outcome"]) for r in rows] == [
        ("fp16", "http_error"),
        ("awq", "reference_error"),
    ]
    assert rows[1]["error"] == "the control's own scoring failed (http_error): HTTP 502: gone"
    assert (
        len(scores.failed_rows(REQUEST, ["fp16"], scores.HTTP_ERROR, "x" * 2000)[0]["error"])
        == scores.ERROR_CHARS
    )


def test_positions_without_a_finite_kl_are_named_not_averaged():
    disjoint = (pos(1, {1: L(0.6), 2: L(0.3)}), pos(2, {7: L(0.5), 8: L(0.25)}))
    row = scores.scored_row(REQUEST, "awq", REFERENCE, disjoint)
    assert row["outcome"] == scores.UNMEASURED and row["error"].startswith("1 of 2 answer positions")
    # the candidate puts all its mass on the shared tokens, the reference does not
    full = (pos(1, {1: L(0.5), 2: L(0.5)}), pos(2, {2: L(0.5), 3: L(0.5)}))
    row = scores.scored_row(REQUEST, "awq", REFERENCE, full)
    assert row["outcome"] == scores.INFINITE_KL and "answer position 0" in row["error"]
    other = (pos(1, {1: L(0.6), 2: L(0.3)}), pos(5, {2: L(0.5), 5: L(0.25)}))
    assert scores.scored_row(REQUEST, "awq", REFERENCE, other)["outcome"] == scores.BAD_RESPONSE


def test_a_chat_answer_is_asked_of_the_chat_api_and_read_with_its_templated_prompt():
    from fidelity.scoring import chat_answer_request, parse_answer

    body = chat_answer_request("m", [{"role": "user", "content": "hi"}], 8, {"ignore_eos": True})
    assert body == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": False,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    # vLLM's chat response: the templated prompt's ids beside the choices, the answer's in it
    response = {
        "object": "chat.completion",
        "choices": [
            {"index": 0, "message": {"content": "x"}, "token_ids": [9, 8], "finish_reason": "length"}
        ],
        "prompt_token_ids": [3, 6, 5, 4],
    }
    assert tuple(parse_answer(response)) == ((3, 6, 5, 4), (9, 8), "length")
    with pytest.raises(ValueError, match="no 'prompt_token_ids': the server ignored return_token_ids"):
        parse_answer({**response, "prompt_token_ids": None})
    with pytest.raises(ValueError, match="messages: a non-empty list"):
        chat_answer_request("m", [], 8)
