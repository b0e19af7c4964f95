"""stats.clustered: user-clustered ratio means and differences from per-user sums.

Checked against statsmodels' cluster-robust OLS on the raw requests (CR1, its default
``use_correction=True``: G/(G-1) * (N-1)/(N-K), K = 1 for a mean), against the raw path, and by
seeded A/A simulation with heterogeneous users (heavy-tailed requests per user and a per-user
effect), where the clustered intervals cover and the unclustered ones visibly do not.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import statsmodels.api as sm
from scipy import stats as sps

from stats.clustered import (
    ClusteredDifference,
    ClusteredMean,
    ClusterSums,
    cluster_codes,
    clustered_difference,
    clustered_difference_moments,
    clustered_mean,
    mean_bounds,
    normal_p_value,
)

RTOL = 1e-9  # far tighter than the 1e-6 asked: the algebra is the same, only rounding differs


def raw_arm(rng: np.random.Generator, users: int, effect_sd: float = 1.0, shift: float = 0.0):
    """Per-request values and user ids: heavy-tailed requests per user, a per-user effect."""
    n = 1 + np.floor(rng.lognormal(1.0, 1.0, users)).astype(int)
    uid = np.repeat(np.arange(users), n)
    y = 100.0 + shift + effect_sd * 20.0 * rng.normal(size=users)[uid] + rng.normal(0.0, 15.0, uid.size)
    return y, uid


def sm_cluster(y: np.ndarray, design: np.ndarray, groups: np.ndarray):
    return sm.OLS(y, design).fit(cov_type="cluster", cov_kwds={"groups": groups})


def test_mean_matches_statsmodels_cluster_robust_intercept_and_its_iid_se():
    rng = np.random.default_rng(1)
    y, uid = raw_arm(rng, 80)
    got = clustered_mean(ClusterSums.from_samples(y, uid))
    fit = sm_cluster(y, np.ones_like(y), uid)
    assert got.estimate == pytest.approx(fit.params[0], rel=RTOL)
    assert got.se == pytest.approx(fit.bse[0], rel=RTOL)
    assert got.se_iid == pytest.approx(sm.OLS(y, np.ones_like(y)).fit().bse[0], rel=RTOL)
    assert got.design_effect == pytest.approx((got.se / got.se_iid) ** 2)
    z = sps.norm.ppf(0.975)
    assert (got.lo, got.hi) == pytest.approx((got.estimate - z * got.se, got.estimate + z * got.se))
    assert got.n == y.size and got.clusters == 80
    # Users matter here: the clustered SE is well above the one that treats requests as independent.
    assert got.design_effect > 2


def test_difference_variance_is_the_sum_of_each_arms_statsmodels_cr1_variance():
    rng = np.random.default_rng(2)
    yc, uc = raw_arm(rng, 60)
    yv, uv = raw_arm(rng, 25, shift=5.0)
    got = clustered_difference(ClusterSums.from_samples(yc, uc), ClusterSums.from_samples(yv, uv))
    fc, fv = sm_cluster(yc, np.ones_like(yc), uc), sm_cluster(yv, np.ones_like(yv), uv)
    assert got.estimate == pytest.approx(fv.params[0] - fc.params[0], rel=RTOL)
    assert got.se == pytest.approx(math.hypot(fc.bse[0], fv.bse[0]), rel=RTOL)
    assert got.p_value == pytest.approx(2 * sps.norm.sf(abs(got.estimate) / got.se), rel=RTOL)
    # One pooled regression with a treatment dummy corrects by G/(G-1) (N-1)/(N-2) over both arms
    # instead of each arm's G_a/(G_a-1): the same CR0 meat, a different factor.
    y = np.r_[yc, yv]
    t = np.r_[np.zeros(yc.size), np.ones(yv.size)]
    pooled = sm_cluster(y, np.c_[np.ones_like(y), t], np.r_[uc, uv + 10_000])
    g, n = 85, y.size
    cr0 = got.control.se**2 * 59 / 60 + got.variant.se**2 * 24 / 25
    assert pooled.bse[1] ** 2 == pytest.approx(cr0 * g / (g - 1) * (n - 1) / (n - 2), rel=RTOL)
    assert got.control.estimate == pytest.approx(yc.mean()) and got.variant.estimate == pytest.approx(
        yv.mean()
    )


def test_aggregates_path_equals_raw_path_exactly():
    rng = np.random.default_rng(3)
    # Whole-millisecond latencies and 0/1 hits: every sum is exact in float64, so the two paths
    # must agree bit for bit, not just closely.
    ids = rng.choice([f"user-{i:03d}" for i in range(40)], size=700)
    latency = rng.integers(50, 900, size=700).astype(float)
    hits = (latency <= 300).astype(float)
    per_user: dict[str, list[float]] = {}
    for uid, value in zip(ids, latency):
        per_user.setdefault(uid, []).append(value)
    users = sorted(per_user)  # the order np.unique gives the raw path
    n = [len(per_user[u]) for u in users]
    sums = [sum(per_user[u]) for u in users]
    squares = [sum(v * v for v in per_user[u]) for u in users]
    hit_sums = [sum(v <= 300 for v in per_user[u]) for u in users]

    raw = clustered_mean(ClusterSums.from_samples(latency, ids))
    agg = clustered_mean(ClusterSums.from_aggregates(n, sums, squares))
    assert raw.as_dict() == agg.as_dict()
    raw_b = clustered_mean(ClusterSums.from_samples(hits, ids, binary=True))
    agg_b = clustered_mean(ClusterSums.from_aggregates(n, hit_sums, binary=True))
    assert raw_b.as_dict() == agg_b.as_dict()
    assert raw_b.method != raw.method  # the 0/1 metric gets the Wilson interval


def test_requests_without_a_user_are_clusters_of_one_request():
    rng = np.random.default_rng(4)
    y, uid = raw_arm(rng, 30)
    ruled = rng.normal(100.0, 15.0, 25)  # served by rule: no user
    ids = np.array([f"u{u}" for u in uid] + [None] * ruled.size, dtype=object)
    values = np.r_[y, ruled]
    got = clustered_mean(ClusterSums.from_samples(values, ids))
    explicit = [f"u{u}" for u in uid] + [f"rule-{i}" for i in range(ruled.size)]
    # Same clusters in another order: equal up to the order of float additions.
    assert got.as_dict() == pytest.approx(
        clustered_mean(ClusterSums.from_samples(values, explicit)).as_dict()
    )
    assert got.clusters == 30 + 25
    groups = np.r_[uid, 1000 + np.arange(ruled.size)]
    assert got.se == pytest.approx(sm_cluster(values, np.ones_like(values), groups).bse[0], rel=RTOL)
    # A float id column marks the missing user with NaN.
    float_ids = np.r_[uid.astype(float), np.full(ruled.size, np.nan)]
    assert clustered_mean(ClusterSums.from_samples(values, float_ids)).as_dict() == pytest.approx(
        got.as_dict()
    )


def test_cluster_codes_factorize_ids_and_give_each_missing_user_its_own_code():
    codes, g = cluster_codes(["b", "a", None, "b", None], 5, "t")
    assert g == 4
    assert codes[0] == codes[3] and len({codes[1], codes[2], codes[4], codes[0]}) == 4
    codes, g = cluster_codes(None, 3, "t")
    assert g == 3 and list(codes) == [0, 1, 2]


def heterogeneous_aa(rng: np.random.Generator, sims: int, users: int, binary: bool):
    """Per-user sums of ``sims`` A/A arms, drawn per user in closed form (no per-request loop).

    Requests per user: 1 + floor(lognormal(1, 1)) (heavy-tailed: with 800 users ~350 effective). A latency is u_user + e with
    u ~ N(0, 1), e ~ N(0, 1): the sum over a user's n requests is n u + sqrt(n) Z, and the sum of
    squares n u^2 + 2 u S_e + S_e^2 / n + chi2(n - 1). A 0/1 metric: hits ~ Binomial(n, p_user),
    p_user ~ Beta(4, 1) (mean 0.8).
    """
    n = 1 + np.floor(rng.lognormal(1.0, 1.0, (sims, users))).astype(np.int64)
    if binary:
        hits = rng.binomial(n, rng.beta(4.0, 1.0, (sims, users))).astype(float)
        return ClusterSums(n, hits, binary=True), 0.8
    u = rng.normal(size=(sims, users))
    s_e = np.sqrt(n) * rng.normal(size=(sims, users))
    sums = n * u + s_e
    squares = n * u * u + 2 * u * s_e + s_e * s_e / n + rng.chisquare(np.maximum(n - 1, 1)) * (n > 1)
    return ClusterSums(n, sums, squares), 0.0


@pytest.mark.parametrize("binary", [False, True], ids=["latency", "share"])
def test_aa_with_heterogeneous_users_clustered_intervals_cover_and_unclustered_do_not(binary):
    rng = np.random.default_rng(5 + binary)
    # The normal approximation over users converges slowly with heavy-tailed users (~93% at ~50
    # effective users, ~94.5% at ~200): 800 users per arm, ~350 effective, and 3,000 experiments
    # so that the simulation's own error (0.4 point) stays below the margin.
    sims = 3000
    control, truth = heterogeneous_aa(rng, sims, 800, binary)
    variant, _ = heterogeneous_aa(rng, sims, 800, binary)
    # One arm's mean against the truth: Wilson at the effective size for the share, normal otherwise.
    mo = control.moments()
    lo, hi = mean_bounds(mo, 0.95, binary)
    lo_iid, hi_iid = mean_bounds(mo._replace(variance=mo.variance_iid), 0.95, binary)
    arm_cover = ((lo <= truth) & (truth <= hi)).mean()
    arm_cover_iid = ((lo_iid <= truth) & (truth <= hi_iid)).mean()
    # The difference against 0.
    d = clustered_difference_moments(control, variant)
    z = sps.norm.ppf(0.975)
    cover = (np.abs(d.estimate) <= z * np.sqrt(d.variance)).mean()
    cover_iid = (np.abs(d.estimate) <= z * np.sqrt(d.variance_iid)).mean()
    assert arm_cover >= 0.94 and cover >= 0.94, (arm_cover, cover)
    assert arm_cover_iid < 0.85 and cover_iid < 0.85, (arm_cover_iid, cover_iid)
    # The vectorized path is the one-experiment API.
    one = clustered_difference(
        ClusterSums(control.n[0], control.sums[0], control.sums_sq[0], binary),
        ClusterSums(variant.n[0], variant.sums[0], variant.sums_sq[0], binary),
    )
    assert one.se == pytest.approx(math.sqrt(d.variance[0]), rel=RTOL)
    assert one.control.lo == pytest.approx(lo[0], rel=RTOL) and one.control.hi == pytest.approx(
        hi[0], rel=RTOL
    )


def test_share_interval_stays_within_0_and_1_and_is_wilson_at_the_effective_size():
    # 3 errors among 2,000 requests from 400 users: the normal interval would go below 0.
    n = np.full(400, 5)
    errors = np.zeros(400)
    errors[:3] = 1
    got = clustered_mean(ClusterSums.from_aggregates(n, errors, binary=True))
    assert got.lo is not None and got.hi is not None
    assert 0.0 <= got.lo < got.estimate < got.hi <= 1.0
    assert got.estimate - 1.96 * got.se < 0  # what the normal interval would have said
    # Every request a hit: no clustering to estimate, the unclustered Wilson interval.
    allhit = clustered_mean(ClusterSums.from_aggregates(n, n, binary=True))
    assert allhit.se == 0 and allhit.hi == 1.0
    assert allhit.lo == pytest.approx(2000 / (2000 + sps.norm.ppf(0.975) ** 2))


def test_fewer_than_two_users_give_no_interval_and_say_why():
    one = clustered_mean(ClusterSums.from_samples([100.0, 120.0, 90.0], ["u1", "u1", "u1"]))
    assert one.estimate == pytest.approx(310 / 3)
    assert (one.se, one.lo, one.hi) == (None, None, None)
    assert "fewer than 2 users" in one.note
    d = clustered_difference(
        ClusterSums.from_samples([1.0, 2.0], ["a", "a"]),
        ClusterSums.from_samples([3.0, 4.0, 5.0], ["b", "c", "d"]),
    )
    assert d.estimate == pytest.approx(4.0 - 1.5)
    assert (d.se, d.lo, d.hi, d.p_value) == (None, None, None, None)
    assert d.note.startswith("control: fewer than 2 users")
    json.dumps(d.as_dict(), allow_nan=False)


def test_a_single_heavy_user_is_flagged_by_the_effective_number_of_users():
    n = np.r_[5000, np.full(99, 10)]
    sums = n * 100.0 + np.arange(100)
    got = clustered_mean(ClusterSums.from_aggregates(n, sums))
    assert got.clusters == 100
    assert got.largest_cluster_share == pytest.approx(5000 / 5990)
    assert got.effective_clusters == pytest.approx(5990**2 / (5000**2 + 99 * 100))
    assert got.effective_clusters < 2 and "effective users" in got.note
    even = clustered_mean(ClusterSums.from_aggregates(np.full(100, 10), np.arange(100) * 10.0))
    assert even.effective_clusters == pytest.approx(100) and even.note is None


def test_results_are_json_safe_frozen_dataclasses():
    rng = np.random.default_rng(6)
    y, uid = raw_arm(rng, 20)
    d = clustered_difference(ClusterSums.from_samples(y, uid), ClusterSums.from_samples(y[::-1], uid))
    assert isinstance(d, ClusteredDifference) and isinstance(d.control, ClusteredMean)
    out = json.loads(json.dumps(d.as_dict(), allow_nan=False))
    assert out["control"]["clusters"] == 20 and out["method"] == d.method
    with pytest.raises(AttributeError):
        d.estimate = 0.0  # type: ignore[misc]


def test_p_value_of_a_zero_standard_error():
    assert normal_p_value(0.0, 0.0) == 1.0
    assert normal_p_value(0.5, 0.0) == 0.0
    assert normal_p_value(1.0, None) is None
    assert normal_p_value(1.96, 1.0) == pytest.approx(0.05, abs=1e-4)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ClusterSums.from_samples([1.0, 2.0], ["a"]), "clusters has shape"),
        (lambda: ClusterSums.from_samples([1.0, math.nan], ["a", "b"]), "NaN"),
        (lambda: ClusterSums.from_aggregates([2, -1], [1.0, 1.0]), "n must be >= 0"),
        (lambda: ClusterSums.from_aggregates([2.5, 1], [1.0, 1.0]), "whole request counts"),
        (lambda: ClusterSums.from_aggregates([2, 1], [1.0]), "sums has shape"),
        (lambda: ClusterSums.from_aggregates([2, 1], [1.0, math.nan]), "sums contains NaN"),
        (lambda: ClusterSums.from_aggregates([2, 0], [1.0, 1.0]), "n = 0 has a nonzero sum"),
        (lambda: ClusterSums.from_aggregates([2, 1], [3.0, 1.0], binary=True), "0 <= sums <= n"),
        (lambda: ClusterSums.from_aggregates([2, 1], [4.0, 1.0], [1.0, 1.0]), "sums_sq is too small"),
        (lambda: ClusterSums.from_samples([0.0, 0.5], None, binary=True), "must be 0 or 1"),
        (lambda: ClusterSums.from_aggregates(["2"], [1.0]), "numeric request counts"),
    ],
)
def test_bad_input_is_refused_naming_the_argument(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_an_arm_without_requests_or_a_bad_conf_is_refused():
    empty = ClusterSums.from_aggregates(np.zeros(3, dtype=int), np.zeros(3))
    some = ClusterSums.from_aggregates([1, 2], [1.0, 2.0])
    with pytest.raises(ValueError, match="no requests"):
        clustered_mean(empty)
    with pytest.raises(ValueError, match=r"clustered_difference\(variant\): no requests"):
        clustered_difference(some, empty)
    with pytest.raises(ValueError, match="conf must be strictly between 0 and 1"):
        clustered_mean(some, conf=1.5)
    with pytest.raises(ValueError, match="one-dimensional"):
        clustered_mean(ClusterSums(np.ones((2, 3), dtype=int), np.ones((2, 3))))
