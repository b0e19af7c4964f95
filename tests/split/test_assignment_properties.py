"""Properties of the pure assignment module: determinism, independence, split accuracy and
minimal movement, measured over 1M users (fixed ids and salts, so the results are fixed too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chi2_contingency

from experiments.assignment import (
    Allocation,
    AllocationError,
    allocate,
    assign,
    bucket_v1,
    moved_buckets,
    moved_share,
    rebalance,
    target_counts,
    total_variation,
    validate_weights,
)

ROOT = Path(__file__).resolve().parents[2]
N_USERS = 1_000_000
SALT_A = "ttft-opt:9f2c1a7b"
SALT_B = "kv-cache:41d07e2a"
TOLERANCE = 0.003  # 0.3 percentage points


@pytest.fixture(scope="module")
def buckets() -> dict[str, np.ndarray]:
    """Bucket of each of 1M users in two experiments (~2 s: one sha256 per user and salt)."""
    users = [f"user-{i}" for i in range(N_USERS)]
    return {
        salt: np.fromiter((bucket_v1(salt, u) for u in users), dtype=np.int32, count=N_USERS)
        for salt in (SALT_A, SALT_B)
    }


def variant_indices(allocation: Allocation, user_buckets: np.ndarray) -> np.ndarray:
    """Vectorized assign(): the variant index of every user."""
    index_of = {k: i for i, k in enumerate(allocation.variants)}
    table = np.array([index_of[k] for k in allocation.lookup], dtype=np.int8)
    return table[user_buckets]


def realized_shares(allocation: Allocation, user_buckets: np.ndarray) -> dict[str, float]:
    counts = np.bincount(variant_indices(allocation, user_buckets), minlength=len(allocation.variants))
    return {k: counts[i] / len(user_buckets) for i, k in enumerate(allocation.variants)}


def users_moved(old: Allocation, new: Allocation, user_buckets: np.ndarray) -> np.ndarray:
    old_keys = np.array(old.lookup, dtype=object)[user_buckets]
    new_keys = np.array(new.lookup, dtype=object)[user_buckets]
    return old_keys != new_keys


# Determinism --------------------------------------------------------------------------------


@pytest.mark.process
def test_same_user_gets_same_variant_in_another_process_with_another_hash_seed():
    allocation = allocate({"fp16": 34, "awq": 33, "awq-fa2": 33})
    users = [f"user-{i}" for i in range(2000)] + ["Ünïcødé-用户", ""]
    here = [assign(SALT_A, u, allocation) for u in users]
    code = (
        "import json, sys\n"
        "from experiments.assignment import Allocation, assign\n"
        "data = json.load(sys.stdin)\n"
        "alloc = Allocation.from_json(data['allocation'])\n"
        "print(json.dumps([assign(data['salt'], u, alloc) for u in data['users']]))\n"
    )
    payload = json.dumps({"allocation": allocation.to_json(), "salt": SALT_A, "users": users})
    # A different PYTHONHASHSEED proves Python's randomized hash() plays no part.
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=payload,
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=True,
        timeout=60,
    )
    assert json.loads(out.stdout) == here


def test_integer_and_string_user_ids_get_the_same_variant():
    allocation = allocate({"a": 50, "b": 50})
    assert all(assign(SALT_A, i, allocation) == assign(SALT_A, str(i), allocation) for i in range(500))


# Independence and accuracy over 1M users ---------------------------------------------------


def test_assignments_in_two_experiments_are_independent(buckets):
    a = variant_indices(allocate({"c": 50, "t": 50}), buckets[SALT_A])
    b = variant_indices(allocate({"c": 50, "t": 50}), buckets[SALT_B])
    correlation = np.corrcoef(a, b)[0, 1]
    assert abs(correlation) < 0.005, correlation  # sampling sd at 1M users is 0.001

    # Three-way by three-way: the joint table is the product of the marginals.
    a3 = variant_indices(allocate({"x": 34, "y": 33, "z": 33}), buckets[SALT_A])
    b3 = variant_indices(allocate({"x": 50, "y": 30, "z": 20}), buckets[SALT_B])
    table = np.zeros((3, 3), dtype=np.int64)
    np.add.at(table, (a3, b3), 1)
    assert chi2_contingency(table).pvalue > 0.001


def test_same_salt_gives_identical_assignments_and_different_salts_do_not(buckets):
    assert np.array_equal(buckets[SALT_A], buckets[SALT_A].copy())
    assert (buckets[SALT_A] == buckets[SALT_B]).mean() < 0.001  # ~1/10_000 collide by chance


@pytest.mark.parametrize(
    "weights",
    [
        {"c": 50, "t": 50},
        {"fp16": 34, "awq": 33, "awq-fa2": 33},
        {"fp16": 50, "awq": 30, "awq-fa2": 20},
        {"a": 20, "b": 20, "c": 20, "d": 20, "e": 20},
        {"a": 1, "b": 99},
        {"a": 0, "b": 100},
    ],
    ids=lambda w: "-".join(f"{k}{v}" for k, v in w.items()),
)
def test_realized_split_matches_weights_within_0_3_points(buckets, weights):
    shares = realized_shares(allocate(weights), buckets[SALT_A])
    for key, weight in weights.items():
        assert abs(shares[key] - weight / 100) <= TOLERANCE, (key, shares[key], weight)


def test_realized_split_after_rebalances_still_matches_weights(buckets):
    allocation = allocate({"a": 20, "b": 20, "c": 20, "d": 20, "e": 20})
    for weights in (
        {"a": 60, "b": 10, "c": 10, "d": 10, "e": 10},
        {"a": 5, "b": 35, "c": 25, "d": 15, "e": 20},
        {"a": 33, "b": 33, "c": 34, "d": 0, "e": 0},
    ):
        allocation = rebalance(allocation, weights)
        shares = realized_shares(allocation, buckets[SALT_A])
        for key, weight in weights.items():
            assert abs(shares[key] - weight / 100) <= TOLERANCE, (weights, key, shares[key])


# Minimal movement --------------------------------------------------------------------------

MOVES = [
    ("2 variants", {"c": 50, "t": 50}, {"c": 90, "t": 10}),
    ("3 variants", {"fp16": 34, "awq": 33, "awq-fa2": 33}, {"fp16": 50, "awq": 30, "awq-fa2": 20}),
    ("3 variants, middle grows", {"a": 40, "b": 20, "c": 40}, {"a": 30, "b": 40, "c": 30}),
    (
        "5 variants",
        {"a": 20, "b": 20, "c": 20, "d": 20, "e": 20},
        {"a": 10, "b": 30, "c": 5, "d": 40, "e": 15},
    ),
]


@pytest.mark.parametrize(("name", "before", "after"), MOVES, ids=[m[0] for m in MOVES])
def test_weight_change_moves_at_most_the_total_variation_distance_of_users(buckets, name, before, after):
    old = allocate(before)
    new = rebalance(old, after)
    moved = users_moved(old, new, buckets[SALT_A]).mean()
    assert moved <= total_variation(before, after) + TOLERANCE, (name, moved)
    assert moved_share(old, new) == pytest.approx(total_variation(before, after))


def test_adding_a_variant_at_weight_zero_moves_nobody(buckets):
    old = allocate({"fp16": 34, "awq": 33, "awq-fa2": 33})
    new = rebalance(old, {"fp16": 34, "awq": 33, "awq-fa2": 33, "gptq": 0})
    assert new.variants == ("fp16", "awq", "awq-fa2", "gptq")
    assert not users_moved(old, new, buckets[SALT_A]).any()


def test_removing_a_variant_moves_only_its_users(buckets):
    old = allocate({"fp16": 34, "awq": 33, "awq-fa2": 33})
    new = rebalance(old, {"fp16": 50, "awq": 50})
    moved = users_moved(old, new, buckets[SALT_A])
    old_keys = np.array(old.lookup, dtype=object)[buckets[SALT_A]]
    assert (old_keys[moved] == "awq-fa2").all()
    assert (old_keys == "awq-fa2")[~moved].sum() == 0  # and every one of its users moved
    assert "awq-fa2" not in new.variants


def test_contiguous_ranges_would_move_more_than_the_minimum_for_three_variants():
    """Why a bucket table: re-cutting contiguous ranges moves users between kept variants."""
    n = 10_000

    def ranges(weights: dict[str, int]) -> list[str]:
        return [k for k, w in weights.items() for _ in range(w * n // 100)]

    before, after = {"a": 50, "b": 30, "c": 20}, {"a": 20, "b": 30, "c": 50}
    contiguous = sum(x != y for x, y in zip(ranges(before), ranges(after), strict=True)) / n
    table = moved_share(allocate(before), rebalance(allocate(before), after))
    assert table == pytest.approx(total_variation(before, after)) == pytest.approx(0.3)
    # a's [20, 50) slides to b and b's [50, 80) to c although b kept its 30 %
    assert contiguous == pytest.approx(0.6)


# Hypothesis: exact bucket-level properties for any weights ---------------------------------


@st.composite
def weightings(draw, keys: list[str]) -> dict[str, int]:
    """Integer percents over ``keys`` summing to 100 (zeros allowed)."""
    cuts = sorted(draw(st.lists(st.integers(0, 100), min_size=len(keys) - 1, max_size=len(keys) - 1)))
    bounds = [0, *cuts, 100]
    return {k: bounds[i + 1] - bounds[i] for i, k in enumerate(keys)}


@st.composite
def weight_changes(draw):
    keys = [f"v{i}" for i in range(draw(st.integers(1, 6)))]
    before = draw(weightings(keys))
    kept = draw(st.lists(st.sampled_from(keys), min_size=1, unique=True))
    added = [f"new{i}" for i in range(draw(st.integers(0, 2)))]
    after = draw(weightings(sorted(kept) + added))
    return before, after


@settings(max_examples=60, deadline=None)
@given(weight_changes())
def test_rebalance_moves_exactly_the_total_variation_distance_of_buckets(change):
    before, after = change
    old = allocate(before)
    new = rebalance(old, after)
    assert new.counts() == {k: v for k, v in target_counts(after).items()}
    assert moved_buckets(old, new) == round(total_variation(before, after) * old.n_buckets)


@settings(max_examples=30, deadline=None)
@given(st.lists(weightings(["a", "b", "c", "d", "e"]), min_size=2, max_size=6))
def test_a_chain_of_changes_keeps_every_step_minimal_and_the_table_compact(chain):
    allocation = allocate(chain[0])
    for weights in chain[1:]:
        new = rebalance(allocation, weights)
        assert moved_buckets(allocation, new) == round(
            total_variation(allocation.weights(), weights) * 10_000
        )
        allocation = new
    # Run-length encoding stays small: surplus comes off the top of runs.
    assert len(allocation.runs) <= 5 * len(chain)
    # and serializes losslessly
    again = Allocation.from_json(json.loads(json.dumps(allocation.to_json())))
    assert again == allocation and again.lookup == allocation.lookup


@settings(max_examples=40, deadline=None)
@given(weightings(["a", "b", "c"]), st.text(max_size=30))
def test_a_user_always_lands_on_a_variant_with_positive_weight(weights, user):
    variant = assign(SALT_A, user, allocate(weights))
    assert weights[variant] > 0


# Bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"a": 50, "b": 49}, "weights: weights must sum to 100, got 99"),
        ({"a": 110, "b": -10}, "weights.b: must be >= 0, got -10"),
        ({"a": 50.0, "b": 50}, "weights.a: must be an integer percent, got 50.0"),
        ({"a": True, "b": 99}, "weights.a: must be an integer percent, got True"),
        ({"a": "50", "b": 50}, "weights.a: must be an integer percent, got '50'"),
        ({}, "weights: must name at least one variant"),
        ({"": 100}, "weights: variant keys must be non-empty strings"),
    ],
)
def test_invalid_weights_are_rejected_with_the_field_named(weights, message):
    assert any(message in e for e in validate_weights(weights)), validate_weights(weights)
    with pytest.raises(AllocationError, match="weights"):
        allocate(weights)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"n_buckets": 10_000, "variants": ["a"], "runs": [[0, 9_999]]}, "lengths sum to 9999"),
        ({"n_buckets": 10_000, "variants": ["a"], "runs": [[1, 10_000]]}, "runs[0]: variant index 1"),
        ({"n_buckets": 10_000, "variants": ["a", "a"], "runs": [[0, 10_000]]}, "duplicate keys"),
        ({"n_buckets": 150, "variants": ["a"], "runs": [[0, 150]]}, "multiple of 100"),
        ({"n_buckets": 100, "variants": ["a"], "runs": [[0, 100, 1]]}, "runs[0]: must be"),
        ({"n_buckets": 100, "variants": ["a"], "runs": [[0, 100]], "x": 1}, "unknown fields"),
    ],
)
def test_invalid_allocations_are_rejected_with_the_field_named(data, message):
    with pytest.raises(AllocationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Allocation.from_json(data)


def test_unsupported_hash_version_is_rejected():
    with pytest.raises(AllocationError, match="hash_version: unsupported version 2"):
        Allocation(("a",), ((0, 10_000),), hash_version=2)
