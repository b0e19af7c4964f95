"""stats.proportions: Wilson interval, attainment, meets_slos.

Checked against scipy, brute force and simulation (seeded, deterministic)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats as sps

from stats.proportions import meets_slos, sla_attainment, wilson_bounds, wilson_interval


def test_wilson_interval_matches_scipy_binomtest_wilson():
    for hits, n in [(0, 10), (3, 10), (10, 10), (950, 1000), (1, 7)]:
        ours = wilson_interval(hits, n)
        ref = sps.binomtest(hits, n).proportion_ci(confidence_level=0.95, method="wilson")
        assert ours.lo == pytest.approx(ref.low, abs=1e-12)
        assert ours.hi == pytest.approx(ref.high, abs=1e-12)
        assert ours.estimate == hits / n


@given(
    n=st.integers(1, 10**7),
    frac=st.floats(0, 1),
    conf=st.sampled_from([0.8, 0.95, 0.99]),
)
def test_wilson_interval_contains_the_estimate_and_stays_in_unit_range(n, frac, conf):
    hits = int(frac * n)
    ci = wilson_interval(hits, n, conf)
    assert 0.0 <= ci.lo <= ci.estimate <= ci.hi <= 1.0


def test_wilson_exact_coverage_is_at_least_94_percent_at_report_sizes():
    # Exact coverage: sum of binomial probabilities of the counts whose interval covers p.
    for n, p in itertools.product((200, 500, 1000), (0.5, 0.8, 0.9, 0.95, 0.99)):
        ks = np.arange(n + 1)
        lo, hi = wilson_bounds(ks, np.full(ks.size, n))
        covers = (lo <= p) & (p <= hi)
        assert sps.binom.pmf(ks[covers], n, p).sum() >= 0.94, (n, p)


def test_vectorized_wilson_bounds_equal_the_scalar_interval():
    hits, n = np.array([0, 3, 10, 950, 1]), np.array([10, 10, 10, 1000, 7])
    lo, hi = wilson_bounds(hits, n)
    for i in range(hits.size):
        ci = wilson_interval(int(hits[i]), int(n[i]))
        assert (lo[i], hi[i]) == pytest.approx((ci.lo, ci.hi), abs=1e-15)


def test_wilson_simulated_coverage_is_at_least_94_percent():
    rng = np.random.default_rng(20240601)
    reps = 50000
    n = rng.integers(100, 3000, size=reps)
    p = rng.uniform(0.5, 0.99, size=reps)
    lo, hi = wilson_bounds(rng.binomial(n, p), n)
    assert np.mean((lo <= p) & (p <= hi)) >= 0.94


def test_sla_attainment_counts_errors_as_misses_and_reports_goodput():
    a = sla_attainment(n=1000, hits=900, errors=50, window_s=100.0)
    assert a.error_rate == 0.05
    assert a.attainment.estimate == 0.9
    assert a.goodput_rps == 9.0
    with pytest.raises(ValueError, match="errors must count as misses"):
        sla_attainment(n=100, hits=90, errors=20)


def test_meets_slos_treats_failures_and_missing_metrics_as_misses():
    ok = np.array([True, True, False, True])
    ttft = np.array([100.0, 300.0, 50.0, np.nan])
    e2e = np.array([1000.0, 1000.0, 1000.0, 1000.0])
    hit = meets_slos(ok, {"ttft_ms": ttft, "e2e_ms": e2e}, {"ttft_ms": 200, "e2e_ms": 2000})
    assert hit.tolist() == [True, False, False, False]
    with pytest.raises(ValueError, match="'tpot_ms'"):
        meets_slos(ok, {"ttft_ms": ttft}, {"tpot_ms": 50})


def test_bad_counts_name_the_problem():
    with pytest.raises(ValueError, match="hits \\(5\\) cannot exceed n \\(3\\)"):
        wilson_interval(5, 3)
    with pytest.raises(ValueError, match="n is 0"):
        wilson_interval(0, 0)
    with pytest.raises(TypeError, match="integer count"):
        wilson_interval(1.5, 3)
