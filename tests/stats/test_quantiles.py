"""stats.quantiles: the quantile convention, order-statistic CIs, plans and estimates.

Checked against scipy, brute force and simulation (seeded, deterministic)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sps

from stats.quantiles import (
    REPORT_QUANTILES,
    min_n_for_quantile_ci,
    nearest_rank,
    percentile_table,
    quantile_ci_ranks,
    quantile_estimate,
    quantile_from_order_stats,
    quantile_plan,
    quantile_rank,
    ranks_to_fetch,
)


@settings(max_examples=60)
@given(
    data=st.lists(st.floats(0, 1e5, allow_nan=False), min_size=1, max_size=300),
    q=st.sampled_from(REPORT_QUANTILES + (0.25, 0.75, 0.95)),
)
def test_quantile_point_estimate_is_numpy_inverted_cdf(data, q):
    arr = np.array(data)
    est = quantile_estimate(arr, q)
    assert est.value == np.quantile(arr, q, method="inverted_cdf")
    # The definition: smallest sample value whose empirical CDF reaches q.
    assert np.mean(arr <= est.value) >= q
    assert np.mean(arr < est.value) < q


def test_quantile_rank_is_exact_for_decimal_quantiles():
    # 0.999 * 1000 is 999.0000000000001 in floats; the rank must still be 999.
    assert quantile_rank(1000, 0.999) == 999
    assert quantile_rank(100, 0.99) == 99
    assert quantile_rank(101, 0.99) == 100
    assert quantile_rank(1, 0.5) == 1


def _brute_force_ranks(n, q, conf):
    tail = (1 - conf) / 2
    cdf = sps.binom.cdf(np.arange(-1, n + 1), n, q)  # cdf[k + 1] = B(k)
    los = [r for r in range(1, n + 1) if cdf[r - 1 + 1] <= tail]  # B(r - 1) <= tail
    his = [r for r in range(1, n + 1) if cdf[r - 1 + 1] >= 1 - tail]
    if not los or not his:
        return None
    return max(los), min(his)


def test_quantile_ci_ranks_match_brute_force_search():
    for n in (1, 5, 20, 59, 100, 250, 999):
        for q in (0.5, 0.9, 0.99, 0.999):
            for conf in (0.9, 0.95):
                assert quantile_ci_ranks(n, q, conf) == _brute_force_ranks(n, q, conf), (n, q)


@given(n=st.integers(1, 20000), q=st.sampled_from(REPORT_QUANTILES))
@settings(max_examples=60, deadline=None)
def test_quantile_plan_ranks_bracket_the_point_and_cover_at_least_conf(n, q):
    plan = quantile_plan(n, q)
    if plan.lo_rank is None:
        assert "too small" in plan.note and n < min_n_for_quantile_ci(q)
        return
    assert 1 <= plan.lo_rank <= plan.rank <= plan.hi_rank <= n
    assert plan.coverage >= 0.95


def test_too_small_n_for_a_percentile_ci_is_said_with_the_needed_n():
    # p99.9 needs q^n <= 0.025 for a finite upper bound: n >= ln(0.025)/ln(0.999) = 3687.1
    assert min_n_for_quantile_ci(0.999) == 3688
    assert quantile_ci_ranks(3687, 0.999) is None
    assert quantile_ci_ranks(3688, 0.999) is not None
    est = quantile_estimate(np.arange(1000.0), 0.999)
    assert est.value == 998.0 and est.lo is None and est.hi is None
    assert "needs at least 3688 samples" in est.note and "p99.9" in est.note


def test_percentile_ci_simulated_coverage_is_at_least_94_percent():
    rng = np.random.default_rng(7)
    n, reps = 400, 3000
    samples = np.sort(rng.lognormal(mean=5.0, sigma=0.6, size=(reps, n)), axis=1)
    for q in (0.5, 0.9, 0.99):
        truth = sps.lognorm.ppf(q, s=0.6, scale=math.exp(5.0))
        lo, hi = quantile_ci_ranks(n, q)
        covered = (samples[:, lo - 1] <= truth) & (truth <= samples[:, hi - 1])
        assert covered.mean() >= 0.94, q


def test_order_stats_path_equals_the_numpy_path():
    rng = np.random.default_rng(3)
    x = rng.exponential(200.0, size=5000)
    srt = np.sort(x)
    ranks = ranks_to_fetch(x.size)
    fetched = {r: srt[r - 1] for r in ranks}  # what arrayElement(arraySort(...), r) returns
    for q in REPORT_QUANTILES:
        assert quantile_from_order_stats(x.size, q, fetched) == quantile_estimate(x, q)
    table = percentile_table(x)
    assert [e.label for e in table] == ["p50", "p90", "p99", "p99.9"]
    assert all(e.lo <= e.value <= e.hi for e in table)


def test_missing_fetched_rank_is_named():
    with pytest.raises(ValueError, match="rank 50 needed for p50"):
        quantile_from_order_stats(100, 0.5, {40: 1.0, 61: 2.0})


def test_nan_samples_are_rejected_with_a_reason():
    with pytest.raises(ValueError, match="NaN"):
        quantile_estimate([1.0, np.nan], 0.5)


@settings(max_examples=60)
@given(
    data=st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=300),
    q=st.sampled_from([0.01, 0.5, 0.9, 0.99, 0.999]),
)
def test_nearest_rank_is_the_order_statistic_at_quantile_rank_and_numpy_inverted_cdf(data, q):
    values = sorted(data)
    got = nearest_rank(values, q)
    assert got == values[quantile_rank(len(values), q) - 1]
    assert got == np.quantile(np.asarray(values), q, method="inverted_cdf")


def test_nearest_rank_refuses_empty_input_and_q_outside_0_1():
    with pytest.raises(ValueError, match="no values"):
        nearest_rank([], 0.5)
    for q in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="strictly between 0 and 1"):
            nearest_rank([1.0], q)


@pytest.mark.process
def test_nearest_rank_imports_no_numpy_or_scipy():
    import subprocess
    import sys

    code = (
        "import sys; from stats.quantiles import nearest_rank; "
        "print([m for m in sys.modules if m.split('.')[0] in ('numpy', 'scipy')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
