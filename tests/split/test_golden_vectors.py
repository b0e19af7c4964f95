"""Golden vectors pin assignment hash version 1 (GrowthBook-style cases file).

A failure here means a code change would move real users between variants: ship the change as
a new hash version with its own vectors instead of editing tests/data/assignment_golden_v1.json.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from experiments.assignment import (
    HASH_VERSION,
    Allocation,
    assign,
    bucket,
    bucket_v1,
    make_assigner,
    rebalance,
)

GOLDEN = json.loads((Path(__file__).parents[1] / "data" / "assignment_golden_v1.json").read_text("utf-8"))


def pytest_generate_tests(metafunc):
    for group in ("bucket", "assign", "rebalance"):
        name = f"{group}_case"
        if name in metafunc.fixturenames:
            cases = GOLDEN[group]
            ids = [c.get("name") or f"{c['salt']!r}-{c['user_id'][:20]!r}" for c in cases]
            metafunc.parametrize(name, cases, ids=ids)


def test_golden_file_pins_version_1_and_it_is_the_current_default():
    assert GOLDEN["hash_version"] == 1
    assert HASH_VERSION == 1


def test_bucket_matches_golden_vector(bucket_case):
    n = bucket_case.get("n_buckets", 10_000)
    assert bucket_v1(bucket_case["salt"], bucket_case["user_id"], n) == bucket_case["bucket"]
    assert bucket(bucket_case["salt"], bucket_case["user_id"], n, version=1) == bucket_case["bucket"]


def test_bucket_v1_is_the_documented_sha256_formula(bucket_case):
    # The definition written in the golden file, computed independently of the module.
    n = bucket_case.get("n_buckets", 10_000)
    digest = hashlib.sha256(f"{bucket_case['salt']}:{bucket_case['user_id']}".encode()).digest()
    assert int.from_bytes(digest[:8], "big") % n == bucket_case["bucket"]


def test_assignment_matches_golden_vector(assign_case):
    allocation = Allocation.from_json(assign_case["allocation"], hash_version=1)
    assert assign(assign_case["salt"], assign_case["user_id"], allocation) == assign_case["variant"]
    # the router's bound fast path computes the same answer
    bound = make_assigner(assign_case["salt"], allocation)
    assert bound(assign_case["user_id"]) == assign_case["variant"]


def test_bound_assigner_agrees_with_bucket_v1_on_every_golden_bucket(bucket_case):
    n = bucket_case.get("n_buckets", 10_000)
    table = Allocation(tuple(f"b{i}" for i in range(n)), tuple((i, 1) for i in range(n)), n)
    bound = make_assigner(bucket_case["salt"], table)
    assert bound(bucket_case["user_id"]) == f"b{bucket_case['bucket']}"


def test_rebalance_matches_golden_vector(rebalance_case):
    old = Allocation.from_json(rebalance_case["old"], hash_version=1)
    new = rebalance(old, rebalance_case["new_weights"])
    assert new.to_json() == rebalance_case["expected"]
