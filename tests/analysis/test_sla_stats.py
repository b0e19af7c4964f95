"""analysis.stats checked against scipy, brute force and simulation (seeded, deterministic)."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sps

from analysis import stats as S

# ---------------------------------------------------------------------------------------------
# Wilson interval and attainment


def test_wilson_interval_matches_scipy_binomtest_wilson():
    for hits, n in [(0, 10), (3, 10), (10, 10), (950, 1000), (1, 7)]:
        ours = S.wilson_interval(hits, n)
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
    ci = S.wilson_interval(hits, n, conf)
    assert 0.0 <= ci.lo <= ci.estimate <= ci.hi <= 1.0


def test_wilson_exact_coverage_is_at_least_94_percent_at_report_sizes():
    # Exact coverage: sum of binomial probabilities of the counts whose interval covers p.
    for n, p in itertools.product((200, 500, 1000), (0.5, 0.8, 0.9, 0.95, 0.99)):
        ks = np.arange(n + 1)
        lo, hi = S.wilson_bounds(ks, np.full(ks.size, n))
        covers = (lo <= p) & (p <= hi)
        assert sps.binom.pmf(ks[covers], n, p).sum() >= 0.94, (n, p)


def test_vectorized_wilson_bounds_equal_the_scalar_interval():
    hits, n = np.array([0, 3, 10, 950, 1]), np.array([10, 10, 10, 1000, 7])
    lo, hi = S.wilson_bounds(hits, n)
    for i in range(hits.size):
        ci = S.wilson_interval(int(hits[i]), int(n[i]))
        assert (lo[i], hi[i]) == pytest.approx((ci.lo, ci.hi), abs=1e-15)


def test_wilson_simulated_coverage_is_at_least_94_percent():
    rng = np.random.default_rng(20240601)
    reps = 50000
    n = rng.integers(100, 3000, size=reps)
    p = rng.uniform(0.5, 0.99, size=reps)
    lo, hi = S.wilson_bounds(rng.binomial(n, p), n)
    assert np.mean((lo <= p) & (p <= hi)) >= 0.94


def test_sla_attainment_counts_errors_as_misses_and_reports_goodput():
    a = S.sla_attainment(n=1000, hits=900, errors=50, window_s=100.0)
    assert a.error_rate == 0.05
    assert a.attainment.estimate == 0.9
    assert a.goodput_rps == 9.0
    with pytest.raises(ValueError, match="errors must count as misses"):
        S.sla_attainment(n=100, hits=90, errors=20)


def test_meets_slos_treats_failures_and_missing_metrics_as_misses():
    ok = np.array([True, True, False, True])
    ttft = np.array([100.0, 300.0, 50.0, np.nan])
    e2e = np.array([1000.0, 1000.0, 1000.0, 1000.0])
    hit = S.meets_slos(ok, {"ttft_ms": ttft, "e2e_ms": e2e}, {"ttft_ms": 200, "e2e_ms": 2000})
    assert hit.tolist() == [True, False, False, False]
    with pytest.raises(ValueError, match="'tpot_ms'"):
        S.meets_slos(ok, {"ttft_ms": ttft}, {"tpot_ms": 50})


def test_bad_counts_name_the_problem():
    with pytest.raises(ValueError, match="hits \\(5\\) cannot exceed n \\(3\\)"):
        S.wilson_interval(5, 3)
    with pytest.raises(ValueError, match="n is 0"):
        S.wilson_interval(0, 0)
    with pytest.raises(TypeError, match="integer count"):
        S.wilson_interval(1.5, 3)


# ---------------------------------------------------------------------------------------------
# Quantiles


@settings(max_examples=60)
@given(
    data=st.lists(st.floats(0, 1e5, allow_nan=False), min_size=1, max_size=300),
    q=st.sampled_from(S.REPORT_QUANTILES + (0.25, 0.75, 0.95)),
)
def test_quantile_point_estimate_is_numpy_inverted_cdf(data, q):
    arr = np.array(data)
    est = S.quantile_estimate(arr, q)
    assert est.value == np.quantile(arr, q, method="inverted_cdf")
    # The definition: smallest sample value whose empirical CDF reaches q.
    assert np.mean(arr <= est.value) >= q
    assert np.mean(arr < est.value) < q


def test_quantile_rank_is_exact_for_decimal_quantiles():
    # 0.999 * 1000 is 999.0000000000001 in floats; the rank must still be 999.
    assert S.quantile_rank(1000, 0.999) == 999
    assert S.quantile_rank(100, 0.99) == 99
    assert S.quantile_rank(101, 0.99) == 100
    assert S.quantile_rank(1, 0.5) == 1


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
                assert S.quantile_ci_ranks(n, q, conf) == _brute_force_ranks(n, q, conf), (n, q)


@given(n=st.integers(1, 20000), q=st.sampled_from(S.REPORT_QUANTILES))
@settings(max_examples=60, deadline=None)
def test_quantile_plan_ranks_bracket_the_point_and_cover_at_least_conf(n, q):
    plan = S.quantile_plan(n, q)
    if plan.lo_rank is None:
        assert "too small" in plan.note and n < S.min_n_for_quantile_ci(q)
        return
    assert 1 <= plan.lo_rank <= plan.rank <= plan.hi_rank <= n
    assert plan.coverage >= 0.95


def test_too_small_n_for_a_percentile_ci_is_said_with_the_needed_n():
    # p99.9 needs q^n <= 0.025 for a finite upper bound: n >= ln(0.025)/ln(0.999) = 3687.1
    assert S.min_n_for_quantile_ci(0.999) == 3688
    assert S.quantile_ci_ranks(3687, 0.999) is None
    assert S.quantile_ci_ranks(3688, 0.999) is not None
    est = S.quantile_estimate(np.arange(1000.0), 0.999)
    assert est.value == 998.0 and est.lo is None and est.hi is None
    assert "needs at least 3688 samples" in est.note and "p99.9" in est.note


def test_percentile_ci_simulated_coverage_is_at_least_94_percent():
    rng = np.random.default_rng(7)
    n, reps = 400, 3000
    samples = np.sort(rng.lognormal(mean=5.0, sigma=0.6, size=(reps, n)), axis=1)
    for q in (0.5, 0.9, 0.99):
        truth = sps.lognorm.ppf(q, s=0.6, scale=math.exp(5.0))
        lo, hi = S.quantile_ci_ranks(n, q)
        covered = (samples[:, lo - 1] <= truth) & (truth <= samples[:, hi - 1])
        assert covered.mean() >= 0.94, q


def test_order_stats_path_equals_the_numpy_path():
    rng = np.random.default_rng(3)
    x = rng.exponential(200.0, size=5000)
    srt = np.sort(x)
    ranks = S.ranks_to_fetch(x.size)
    fetched = {r: srt[r - 1] for r in ranks}  # what arrayElement(arraySort(...), r) returns
    for q in S.REPORT_QUANTILES:
        assert S.quantile_from_order_stats(x.size, q, fetched) == S.quantile_estimate(x, q)
    table = S.percentile_table(x)
    assert [e.label for e in table] == ["p50", "p90", "p99", "p99.9"]
    assert all(e.lo <= e.value <= e.hi for e in table)


def test_missing_fetched_rank_is_named():
    with pytest.raises(ValueError, match="rank 50 needed for p50"):
        S.quantile_from_order_stats(100, 0.5, {40: 1.0, 61: 2.0})


def test_nan_samples_are_rejected_with_a_reason():
    with pytest.raises(ValueError, match="NaN"):
        S.quantile_estimate([1.0, np.nan], 0.5)


# ---------------------------------------------------------------------------------------------
# Variant vs control


def test_attainment_difference_ci_matches_newcombe_1998_worked_example():
    # Newcombe (1998), Stat Med 17:873, example (a): 56/70 vs 48/80, method 10: 0.0524, 0.3339.
    d = S.attainment_difference(control_hits=48, control_n=80, variant_hits=56, variant_n=70)
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
    d = S.attainment_difference(int(fc * nc), nc, int(fv * nv), nv)
    assert -1.0 <= d.lo <= d.estimate <= d.hi <= 1.0
    assert 0.0 <= d.p_value <= 1.0


def test_attainment_difference_p_value_equals_chi_square_without_correction():
    d = S.attainment_difference(900, 1000, 930, 1000)
    table = [[930, 70], [900, 100]]
    ref = sps.chi2_contingency(table, correction=False).pvalue
    assert d.p_value == pytest.approx(ref, rel=1e-9)
    assert "z test" in d.method


def test_attainment_difference_uses_fisher_exact_when_counts_are_small():
    d = S.attainment_difference(control_hits=9, control_n=10, variant_hits=4, variant_n=10)
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
            S.attainment_difference(int(x), int(m), int(y), int(m)).p_value
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
        (d := S.attainment_difference(int(x), int(m), int(y), int(m))).lo <= tv - tc <= d.hi
        for x, y, m, tc, tv in zip(c, v, n, pc, pv, strict=True)
    ]
    assert np.mean(cover) >= 0.94


def test_mann_whitney_false_positive_rate_in_simulated_aa_is_near_alpha():
    rng = np.random.default_rng(13)
    reps, n = 1000, 100
    x = rng.lognormal(5.0, 0.5, size=(reps, n))
    y = rng.lognormal(5.0, 0.5, size=(reps, n))
    ps = np.array([S.mann_whitney(x[i], y[i]).p_value for i in range(reps)])
    assert 0.03 <= np.mean(ps < 0.05) <= 0.07


def test_mann_whitney_detects_a_shift_and_reports_the_effect_direction():
    rng = np.random.default_rng(14)
    control = rng.lognormal(5.0, 0.5, size=500)
    slower = rng.lognormal(5.2, 0.5, size=500)
    res = S.mann_whitney(control, slower)
    assert res.p_value < 1e-3
    assert res.prob_variant_greater > 0.55


def test_mann_whitney_from_counts_equals_scipy_on_rounded_data():
    rng = np.random.default_rng(15)
    c = np.round(rng.lognormal(5.0, 0.4, size=700), 0)
    v = np.round(rng.lognormal(5.05, 0.4, size=600), 0)
    values = np.union1d(c, v)
    cc = np.array([np.sum(c == x) for x in values])
    vc = np.array([np.sum(v == x) for x in values])
    ours = S.mann_whitney_from_counts(values, cc, vc)
    ref = sps.mannwhitneyu(v, c, alternative="two-sided", method="asymptotic")
    assert ours.statistic == pytest.approx(ref.statistic)
    assert ours.p_value == pytest.approx(ref.pvalue, rel=1e-9)


def test_p99_difference_ci_is_conservative_and_needs_only_order_statistics():
    rng = np.random.default_rng(16)
    n, reps, q = 3000, 800, 0.99
    arm_conf = S.quantile_difference_conf(0.95)
    lo, hi = S.quantile_ci_ranks(n, q, arm_conf)
    c = np.sort(rng.exponential(100.0, size=(reps, n)), axis=1)
    v = np.sort(rng.exponential(100.0, size=(reps, n)) + 20.0, axis=1)
    # difference interval [v.lo - c.hi, v.hi - c.lo] around the true shift of 20 ms
    covered = (v[:, lo - 1] - c[:, hi - 1] <= 20.0) & (20.0 <= v[:, hi - 1] - c[:, lo - 1])
    assert covered.mean() >= 0.95
    d = S.quantile_difference(c[0], v[0], q)
    assert d.lo <= d.estimate <= d.hi
    assert d.estimate == pytest.approx(v[0][S.quantile_rank(n, q) - 1] - c[0][2969])


def test_p99_difference_without_enough_samples_says_so():
    d = S.quantile_difference(np.arange(100.0), np.arange(100.0) + 1, 0.99)
    assert d.lo is None and d.hi is None and "too small" in d.method


def test_p99_difference_rejects_arm_estimates_at_the_wrong_level():
    x = np.arange(5000.0)
    with pytest.raises(ValueError, match="quantile_difference_conf"):
        S.quantile_difference_from_order_stats(S.quantile_estimate(x, 0.99), S.quantile_estimate(x, 0.99))


def _holm_brute(ps):
    m = len(ps)
    order = sorted(range(m), key=lambda i: ps[i])
    adj = [0.0] * m
    for pos, i in enumerate(order):
        adj[i] = min(1.0, max((m - j) * ps[order[j]] for j in range(pos + 1)))
    return adj


@given(st.lists(st.floats(0, 1), min_size=1, max_size=12))
def test_holm_adjusted_p_values_match_definition_are_monotone_and_at_least_raw(ps):
    adj = S.holm_adjust(ps)
    assert adj == pytest.approx(_holm_brute(ps))
    assert all(a >= p for a, p in zip(adj, ps, strict=True))
    by_raw = [a for _, a in sorted(zip(ps, adj, strict=True))]
    assert by_raw == sorted(by_raw)


def test_holm_keeps_variant_keys():
    assert S.holm_adjust({"b": 0.01, "c": 0.04}) == {"b": 0.02, "c": 0.04}


def test_compare_attainment_applies_holm_across_variants():
    out = S.compare_attainment(
        S.ArmCounts(n=1000, hits=900),
        {"v1": S.ArmCounts(1000, 930), "v2": S.ArmCounts(1000, 905)},
    )
    raw = {k: v["difference"]["p_value"] for k, v in out.items()}
    assert out["v1"]["p_holm"] == pytest.approx(min(1.0, 2 * raw["v1"]))
    assert out["v2"]["p_holm"] == pytest.approx(max(raw["v2"], 2 * raw["v1"]))


# ---------------------------------------------------------------------------------------------
# Mirror mode


def test_mcnemar_p_value_is_the_mid_p_binomial_of_discordant_pairs():
    r = S.mcnemar_attainment(both_hit=800, control_only=30, variant_only=55, both_miss=115)
    exact = sps.binomtest(30, 85, 0.5).pvalue
    # mid-p = exact two-sided minus the probability of the observed split (symmetric case)
    assert r.difference.p_value == pytest.approx(exact - sps.binom.pmf(30, 85, 0.5))
    assert r.difference.p_value < exact
    assert r.difference.estimate == pytest.approx((55 - 30) / 1000)
    assert r.control_attainment == 0.83 and r.variant_attainment == 0.855
    assert r.difference.lo <= r.difference.estimate <= r.difference.hi


def test_mcnemar_false_positive_rate_in_simulated_aa_is_near_alpha():
    rng = np.random.default_rng(21)
    reps, n = 2500, 300
    # Correlated pairs: shared per-request difficulty, identical arms.
    difficulty = rng.uniform(size=(reps, n))
    c = difficulty + 0.1 * rng.normal(size=(reps, n)) < 0.9
    v = difficulty + 0.1 * rng.normal(size=(reps, n)) < 0.9
    both, co, vo = (c & v).sum(1), (c & ~v).sum(1), (~c & v).sum(1)
    ps = np.array(
        [
            S.mcnemar_attainment(int(a), int(b), int(d), n - int(a + b + d)).difference.p_value
            for a, b, d in zip(both, co, vo, strict=True)
        ]
    )
    assert 0.03 <= np.mean(ps < 0.05) <= 0.07


def test_wilcoxon_paired_matches_scipy_and_handles_all_zero_differences():
    rng = np.random.default_rng(22)
    d = rng.normal(5.0, 20.0, size=300)
    r = S.wilcoxon_paired(d)
    assert r.p_value == pytest.approx(sps.wilcoxon(d).pvalue)
    assert r.median_difference == pytest.approx(np.median(d))
    z = S.wilcoxon_paired(np.zeros(10))
    assert z.p_value == 1.0 and z.n_nonzero == 0


# ---------------------------------------------------------------------------------------------
# Sample ratio mismatch


def test_srm_per_revision_matches_scipy_chisquare_and_combines_by_summing():
    revs = [
        ("r1", {"control": 5000, "b": 5150}, {"control": 50, "b": 50}),
        ("r2", {"control": 2000, "b": 6100}, {"control": 25, "b": 75}),
    ]
    res = S.sample_ratio_mismatch(revs)
    r1 = sps.chisquare([5000, 5150], [10150 / 2, 10150 / 2])
    r2 = sps.chisquare([2000, 6100], [8100 * 0.25, 8100 * 0.75])
    assert res.revisions[0].p_value == pytest.approx(r1.pvalue)
    assert res.revisions[1].p_value == pytest.approx(r2.pvalue)
    assert res.combined.df == 2
    assert res.combined.p_value == pytest.approx(sps.chi2.sf(r1.statistic + r2.statistic, 2))
    assert not res.flagged and res.message == ""


def test_srm_flags_a_lopsided_split_below_one_in_a_thousand_and_names_the_revision():
    res = S.sample_ratio_mismatch([("r7", {"control": 5000, "b": 5400}, {"control": 1, "b": 1})])
    assert res.flagged
    assert res.revisions[0].p_value < 0.001
    assert "r7" in res.message


def test_srm_pooling_would_hide_a_mismatch_that_per_revision_tests_see():
    # Each revision is off in opposite directions; pooled counts look perfect.
    revs = [
        ("r1", {"a": 5300, "b": 4700}, {"a": 1, "b": 1}),
        ("r2", {"a": 4700, "b": 5300}, {"a": 1, "b": 1}),
    ]
    res = S.sample_ratio_mismatch(revs)
    assert res.combined.observed == {"a": 10000, "b": 10000}
    assert res.flagged and all(p.flagged for p in res.revisions)


def test_srm_traffic_to_a_zero_weight_variant_is_a_mismatch():
    res = S.sample_ratio_mismatch(
        [("r1", {"a": 100, "b": 3}, {"a": 1, "b": 0}), ("r2", {"a": 5, "b": 5}, {"a": 1, "b": 1})]
    )
    assert res.flagged and "weight 0" in res.message
    assert res.combined.p_value == 0.0
    json.dumps(res.as_dict(), allow_nan=False)  # the report API must not emit Infinity


def test_srm_counts_for_unknown_variants_are_an_error():
    with pytest.raises(ValueError, match="no weight in force: \\['ghost'\\]"):
        S.sample_ratio_mismatch([("r1", {"a": 1, "ghost": 2}, {"a": 1})])


# ---------------------------------------------------------------------------------------------
# Verdict


def test_verdict_meets_misses_and_undecided():
    assert S.sla_verdict(990, 1000, 0.95).verdict == S.MEETS
    assert S.sla_verdict(900, 1000, 0.95).verdict == S.MISSES
    v = S.sla_verdict(95, 100, 0.9)
    assert v.verdict == S.NOT_ENOUGH and v.n_needed > 100
    assert S.sla_verdict(0, 0, 0.9).n_needed is None


def _wilson_bounds(p, n, z):
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return centre - half, centre + half


@pytest.mark.parametrize(("p", "target"), [(0.95, 0.9), (0.9, 0.95), (0.991, 0.99), (1.0, 0.99)])
def test_sample_size_needed_is_the_first_n_whose_interval_clears_the_target(p, target):
    z = sps.norm.ppf(0.975)
    need = S.sample_size_to_decide(p, target)

    def decided(n):
        lo, hi = _wilson_bounds(p, n, z)
        return lo >= target if p >= target else hi < target

    assert decided(need) and not decided(need - 1)


def test_sample_size_needed_is_none_when_the_estimate_equals_the_target():
    v = S.sla_verdict(90, 100, 0.9)
    assert v.verdict == S.NOT_ENOUGH and v.n_needed is None
    assert "equals the target" in v.message


def test_results_serialize_to_plain_dicts():
    d = S.sla_verdict(95, 100, 0.9).as_dict()
    assert d["attainment"]["lo"] < 0.9 < d["attainment"]["hi"]
    assert isinstance(S.quantile_estimate([1.0, 2.0], 0.5).as_dict()["note"], str)
