"""stats.comparisons: variant vs control: differences, rank tests, Holm.

Checked against scipy, brute force and simulation (seeded, deterministic)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats as sps

from stats.comparisons import (
    ArmCounts,
    attainment_difference,
    compare_attainment,
    holm_adjust,
    mann_whitney,
    mann_whitney_from_counts,
    quantile_difference,
    quantile_difference_conf,
    quantile_difference_from_order_stats,
)
from stats.quantiles import quantile_ci_ranks, quantile_estimate, quantile_rank


def test_attainment_difference_ci_matches_newcombe_1998_worked_example():
    # Newcombe (1998), Stat Med 17:873, example (a): 56/70 vs 48/80, method 10: 0.0524, 0.3339.
    d = attainment_difference(control_hits=48, control_n=80, variant_hits=56, variant_n=70)
    assert d.estimate == pytest.approx(0.2)
    assert d.lo == pytest.approx(0.0524, abs=5e-5)
    assert d.hi == pytest.approx(0.3339, abs=5e-5)


@given(
    nc=st.integers(1, 10**6),
    nv=st.integers(1, 10**6),
    fc=st.floats(0, 1),
    fv=st.floats(0, 1),
)
def test_attainment_difference_ci_contains_the_estimate(nc, nv, fc, fv):
    d = attainment_difference(int(fc * nc), nc, int(fv * nv), nv)
    assert -1.0 <= d.lo <= d.estimate <= d.hi <= 1.0
    assert 0.0 <= d.p_value <= 1.0


def test_attainment_difference_p_value_equals_chi_square_without_correction():
    d = attainment_difference(900, 1000, 930, 1000)
    table = [[930, 70], [900, 100]]
    ref = sps.chi2_contingency(table, correction=False).pvalue
    assert d.p_value == pytest.approx(ref, rel=1e-9)
    assert "z test" in d.method


def test_attainment_difference_uses_fisher_exact_when_counts_are_small():
    d = attainment_difference(control_hits=9, control_n=10, variant_hits=4, variant_n=10)
    assert d.p_value == pytest.approx(sps.fisher_exact([[4, 6], [9, 1]]).pvalue)
    assert "Fisher" in d.method


def test_attainment_difference_false_positive_rate_in_simulated_aa_is_near_alpha():
    rng = np.random.default_rng(11)
    reps = 4000
    n = rng.integers(200, 2000, size=reps)
    p = rng.uniform(0.7, 0.98, size=reps)
    a, b = rng.binomial(n, p), rng.binomial(n, p)
    ps = np.array(
        [
            attainment_difference(int(x), int(m), int(y), int(m)).p_value
            for x, y, m in zip(a, b, n, strict=True)
        ]
    )
    assert 0.03 <= np.mean(ps < 0.05) <= 0.07


def test_attainment_difference_ci_covers_the_true_difference():
    rng = np.random.default_rng(12)
    reps = 3000
    n = rng.integers(200, 2000, size=reps)
    pc, pv = rng.uniform(0.7, 0.97, size=reps), rng.uniform(0.7, 0.97, size=reps)
    c, v = rng.binomial(n, pc), rng.binomial(n, pv)
    cover = [
        (d := attainment_difference(int(x), int(m), int(y), int(m))).lo <= tv - tc <= d.hi
        for x, y, m, tc, tv in zip(c, v, n, pc, pv, strict=True)
    ]
    assert np.mean(cover) >= 0.94


def test_mann_whitney_false_positive_rate_in_simulated_aa_is_near_alpha():
    rng = np.random.default_rng(13)
    reps, n = 1000, 100
    x = rng.lognormal(5.0, 0.5, size=(reps, n))
    y = rng.lognormal(5.0, 0.5, size=(reps, n))
    ps = np.array([mann_whitney(x[i], y[i]).p_value for i in range(reps)])
    assert 0.03 <= np.mean(ps < 0.05) <= 0.07


def test_mann_whitney_detects_a_shift_and_reports_the_effect_direction():
    rng = np.random.default_rng(14)
    control = rng.lognormal(5.0, 0.5, size=500)
    slower = rng.lognormal(5.2, 0.5, size=500)
    res = mann_whitney(control, slower)
    assert res.p_value < 1e-3
    assert res.prob_variant_greater > 0.55


def test_mann_whitney_from_counts_equals_scipy_on_rounded_data():
    rng = np.random.default_rng(15)
    c = np.round(rng.lognormal(5.0, 0.4, size=700), 0)
    v = np.round(rng.lognormal(5.05, 0.4, size=600), 0)
    values = np.union1d(c, v)
    cc = np.array([np.sum(c == x) for x in values])
    vc = np.array([np.sum(v == x) for x in values])
    ours = mann_whitney_from_counts(values, cc, vc)
    ref = sps.mannwhitneyu(v, c, alternative="two-sided", method="asymptotic")
    assert ours.statistic == pytest.approx(ref.statistic)
    assert ours.p_value == pytest.approx(ref.pvalue, rel=1e-9)


def test_p99_difference_ci_is_conservative_and_needs_only_order_statistics():
    rng = np.random.default_rng(16)
    n, reps, q = 3000, 800, 0.99
    arm_conf = quantile_difference_conf(0.95)
    lo, hi = quantile_ci_ranks(n, q, arm_conf)
    c = np.sort(rng.exponential(100.0, size=(reps, n)), axis=1)
    v = np.sort(rng.exponential(100.0, size=(reps, n)) + 20.0, axis=1)
    # difference interval [v.lo - c.hi, v.hi - c.lo] around the true shift of 20 ms
    covered = (v[:, lo - 1] - c[:, hi - 1] <= 20.0) & (20.0 <= v[:, hi - 1] - c[:, lo - 1])
    assert covered.mean() >= 0.95
    d = quantile_difference(c[0], v[0], q)
    assert d.lo <= d.estimate <= d.hi
    assert d.estimate == pytest.approx(v[0][quantile_rank(n, q) - 1] - c[0][2969])


def test_p99_difference_without_enough_samples_says_so():
    d = quantile_difference(np.arange(100.0), np.arange(100.0) + 1, 0.99)
    assert d.lo is None and d.hi is None and "too small" in d.method


def test_p99_difference_rejects_arm_estimates_at_the_wrong_level():
    x = np.arange(5000.0)
    with pytest.raises(ValueError, match="quantile_difference_conf"):
        quantile_difference_from_order_stats(quantile_estimate(x, 0.99), quantile_estimate(x, 0.99))


def _holm_brute(ps):
    m = len(ps)
    order = sorted(range(m), key=lambda i: ps[i])
    adj = [0.0] * m
    for pos, i in enumerate(order):
        adj[i] = min(1.0, max((m - j) * ps[order[j]] for j in range(pos + 1)))
    return adj


@given(st.lists(st.floats(0, 1), min_size=1, max_size=12))
def test_holm_adjusted_p_values_match_definition_are_monotone_and_at_least_raw(ps):
    adj = holm_adjust(ps)
    assert adj == pytest.approx(_holm_brute(ps))
    assert all(a >= p for a, p in zip(adj, ps, strict=True))
    by_raw = [a for _, a in sorted(zip(ps, adj, strict=True))]
    assert by_raw == sorted(by_raw)


def test_holm_keeps_variant_keys():
    assert holm_adjust({"b": 0.01, "c": 0.04}) == {"b": 0.02, "c": 0.04}


def test_compare_attainment_applies_holm_across_variants():
    out = compare_attainment(
        ArmCounts(n=1000, hits=900),
        {"v1": ArmCounts(1000, 930), "v2": ArmCounts(1000, 905)},
    )
    raw = {k: v["difference"]["p_value"] for k, v in out.items()}
    assert out["v1"]["p_holm"] == pytest.approx(min(1.0, 2 * raw["v1"]))
    assert out["v2"]["p_holm"] == pytest.approx(max(raw["v2"], 2 * raw["v1"]))
