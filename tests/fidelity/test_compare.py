"""The per-request fidelity core against direct computations from whole distributions."""

from __future__ import annotations

import math
import random

import pytest

from fidelity.compare import compare_tokens, top1_agreement, truncated_kl


@pytest.mark.parametrize(
    "reference, candidate, identical, first, prefix",
    [
        ([5, 6, 7], [5, 6, 7], True, None, 3),
        ([5, 6, 7], [5, 9, 7], False, 1, 1),
        ([5, 6, 7], [8, 6, 7], False, 0, 0),
        ([5, 6, 7], [5, 6], False, 2, 2),  # the shorter answer diverges where it ends
        ([5, 6], [5, 6, 7, 8], False, 2, 2),
        ([], [], True, None, 0),
        (["Hel", "lo"], ["Hel", "p"], False, 1, 1),  # texts where ids are not returned
    ],
)
def test_tokens_compare_to_the_first_divergence(reference, candidate, identical, first, prefix):
    got = compare_tokens(reference, candidate)
    assert (got.identical, got.first_divergence, got.common_prefix) == (identical, first, prefix)
    assert (got.reference_tokens, got.candidate_tokens) == (len(reference), len(candidate))


def _kl(p: dict, q: dict) -> float:
    return sum(pi * math.log(pi / q[t]) for t, pi in p.items() if pi > 0)


def _logs(d: dict) -> dict:
    return {t: math.log(v) for t, v in d.items()}


def test_with_every_token_listed_it_is_the_full_kl():
    p = {"a": 0.5, "b": 0.3, "c": 0.2}
    q = {"a": 0.4, "b": 0.4, "c": 0.2}
    got = truncated_kl(_logs(p), _logs(q))
    assert got.kl == pytest.approx(0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.4), abs=1e-12)
    assert (got.shared, got.k) == (3, 3)
    assert truncated_kl(_logs(p), _logs(p)).kl == pytest.approx(0.0, abs=1e-12)


def _top(d: dict, k: int) -> dict:
    return dict(sorted(d.items(), key=lambda kv: -kv[1])[:k])


def _random_distribution(rng: random.Random, vocab: int, sharpness: float) -> dict:
    weights = [math.exp(sharpness * rng.gauss(0, 1)) for _ in range(vocab)]
    total = sum(weights)
    return {t: w / total for t, w in enumerate(weights)}


@pytest.mark.parametrize("seed", range(20))
def test_truncated_to_top_k_it_equals_the_coarsened_kl_and_never_exceeds_the_full_one(seed):
    rng = random.Random(seed)
    p = _random_distribution(rng, 64, 2.0)
    # the candidate: the reference's logits nudged, as a change of numerics does
    q = {t: v * math.exp(0.3 * rng.gauss(0, 1)) for t, v in p.items()}
    q = {t: v / sum(q.values()) for t, v in q.items()}
    k = rng.choice([1, 5, 20])
    got = truncated_kl(_logs(_top(p, k)), _logs(_top(q, k)))
    shared = set(_top(p, k)) & set(_top(q, k))
    coarse_p = {t: p[t] for t in shared} | {"rest": 1 - sum(p[t] for t in shared)}
    coarse_q = {t: q[t] for t in shared} | {"rest": 1 - sum(q[t] for t in shared)}
    assert got.kl == pytest.approx(_kl(coarse_p, coarse_q), rel=1e-9, abs=1e-12)
    assert got.kl <= _kl(p, q) + 1e-12
    assert got.shared == len(shared)


def test_mass_the_candidate_cannot_produce_makes_it_infinite():
    # Q all on a; P half on a, half elsewhere: the rest of P has no counterpart in Q
    assert truncated_kl({"a": math.log(0.5), "b": math.log(0.5)}, {"a": 0.0}).kl == math.inf
    assert truncated_kl({"a": math.log(0.5)}, {"a": math.log(0.5)}).kl == pytest.approx(0.0, abs=1e-12)


def test_top_k_lists_with_no_token_in_common_measure_nothing_and_say_so():
    got = truncated_kl({"a": 0.0}, {"b": 0.0})  # one bucket each: coarsened, they are equal
    assert (got.kl, got.shared) == (0.0, 0)


@pytest.mark.parametrize(
    "reference, candidate, message",
    [
        ({}, {"a": 0.0}, "reference: no log-probabilities"),
        ({"a": 0.1}, {"a": 0.0}, "reference: log-probability of 'a' is 0.1"),
        ({"a": 0.0}, {"a": float("nan")}, "candidate: log-probability of 'a' is nan"),
        ({"a": math.log(0.7), "b": math.log(0.7)}, {"a": 0.0}, "sum to probability 1.4"),
    ],
)
def test_log_probabilities_a_server_could_not_have_sent_are_refused_naming_the_side(
    reference, candidate, message
):
    with pytest.raises(ValueError, match=message):
        truncated_kl(reference, candidate)


def test_top1_agreement_is_the_share_of_reference_tokens_the_candidate_would_have_chosen():
    assert top1_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 0.75
    assert top1_agreement([], []) is None
    with pytest.raises(ValueError, match="3 reference tokens but 2 candidate positions"):
        top1_agreement([1, 2, 3], [1, 2])
