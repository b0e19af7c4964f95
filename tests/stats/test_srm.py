"""stats.srm: sample ratio mismatch.

Checked against scipy, brute force and simulation (seeded, deterministic)."""

from __future__ import annotations

import json

import pytest
from scipy import stats as sps

from stats.srm import sample_ratio_mismatch


def test_srm_per_revision_matches_scipy_chisquare_and_combines_by_summing():
    revs = [
        ("r1", {"control": 5000, "b": 5150}, {"control": 50, "b": 50}),
        ("r2", {"control": 2000, "b": 6100}, {"control": 25, "b": 75}),
    ]
    res = sample_ratio_mismatch(revs)
    r1 = sps.chisquare([5000, 5150], [10150 / 2, 10150 / 2])
    r2 = sps.chisquare([2000, 6100], [8100 * 0.25, 8100 * 0.75])
    assert res.revisions[0].p_value == pytest.approx(r1.pvalue)
    assert res.revisions[1].p_value == pytest.approx(r2.pvalue)
    assert res.combined.df == 2
    assert res.combined.p_value == pytest.approx(sps.chi2.sf(r1.statistic + r2.statistic, 2))
    assert not res.flagged and res.message == ""


def test_srm_flags_a_lopsided_split_below_one_in_a_thousand_and_names_the_revision():
    res = sample_ratio_mismatch([("r7", {"control": 5000, "b": 5400}, {"control": 1, "b": 1})])
    assert res.flagged
    assert res.revisions[0].p_value < 0.001
    assert "r7" in res.message


def test_srm_pooling_would_hide_a_mismatch_that_per_revision_tests_see():
    # Each revision is off in opposite directions; pooled counts look perfect.
    revs = [
        ("r1", {"a": 5300, "b": 4700}, {"a": 1, "b": 1}),
        ("r2", {"a": 4700, "b": 5300}, {"a": 1, "b": 1}),
    ]
    res = sample_ratio_mismatch(revs)
    assert res.combined.observed == {"a": 10000, "b": 10000}
    assert res.flagged and all(p.flagged for p in res.revisions)


def test_srm_traffic_to_a_zero_weight_variant_is_a_mismatch():
    res = sample_ratio_mismatch(
        [("r1", {"a": 100, "b": 3}, {"a": 1, "b": 0}), ("r2", {"a": 5, "b": 5}, {"a": 1, "b": 1})]
    )
    assert res.flagged and "weight 0" in res.message
    assert res.combined.p_value == 0.0
    json.dumps(res.as_dict(), allow_nan=False)  # the report API must not emit Infinity


def test_srm_counts_for_unknown_variants_are_an_error():
    with pytest.raises(ValueError, match="no weight in force: \\['ghost'\\]"):
        sample_ratio_mismatch([("r1", {"a": 1, "ghost": 2}, {"a": 1})])
