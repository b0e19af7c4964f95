"""stats.adjusted and stats.sequential.adjusted: covariate adjustment, user-clustered, fixed and anytime.

The fixed-horizon fit is checked against statsmodels' OLS of y on [1, variant, covariates] with
``cov_type="cluster"`` on the raw requests: statsmodels' default correction (use_correction=True)
is CR1, G/(G-1) * (N-1)/(N-K), the one stats.adjusted uses. The sequences are checked against
their closed form and by seeded simulation under a look at every batch.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import statsmodels.api as sm
from scipy import optimize
from scipy import stats as sps

from stats.adjusted import AdjustedDifference, ArmData, adjusted_difference, adjusted_moments
from stats.clustered import ClusterSums, clustered_difference
from stats.sequential._base import SequentialInterval
from stats.sequential.adjusted import (
    DEFAULT_TARGET_N,
    adjusted_difference_look,
    adjusted_difference_sequence,
    asymptotic_cs_bounds,
    clustered_difference_sequence,
    clustered_mean_sequence,
    normal_mixture_half_width,
    optimal_ratio,
)

RTOL = 1e-9  # far tighter than the 1e-6 asked: the algebra is the same, only rounding differs
ALPHA = 0.05


def raw_arm(rng: np.random.Generator, users: int, shift: float = 0.0, slope: float = 0.03):
    """Requests of one arm: heavy-tailed requests per user, users with their own prompt sizes and
    a per-user effect; TTFT-like y = 60 + slope * prompt + 0.1 * max_tokens + user + noise."""
    n = 1 + np.floor(rng.lognormal(1.0, 1.0, users)).astype(int)
    uid = np.repeat(np.arange(users), n)
    prompt = rng.lognormal(7.0, 0.8, users)[uid] * rng.lognormal(0.0, 0.3, uid.size)
    max_tokens = rng.integers(16, 512, uid.size).astype(float)
    y = 60.0 + shift + slope * prompt + 0.1 * max_tokens + rng.normal(0, 10, users)[uid]
    y += rng.normal(0, 8, uid.size)
    return y, np.c_[prompt, max_tokens], uid


def pooled_fit(yc, xc, uc, yv, xv, uv, cov_type="cluster"):
    y = np.r_[yc, yv]
    design = np.c_[np.ones_like(y), np.r_[np.zeros(yc.size), np.ones(yv.size)], np.r_[xc, xv]]
    groups = np.r_[uc, uv + 1_000_000]
    if cov_type == "cluster":
        return sm.OLS(y, design).fit(cov_type="cluster", cov_kwds={"groups": groups}), design
    return sm.OLS(y, design).fit(), design


def test_adjusted_difference_matches_statsmodels_ols_cluster_robust_cr1():
    rng = np.random.default_rng(10)
    yc, xc, uc = raw_arm(rng, 70)
    yv, xv, uv = raw_arm(rng, 45, shift=4.0)
    names = ("prompt_tokens", "max_tokens")
    got = adjusted_difference(
        ArmData.from_samples(yc, xc, uc, names), ArmData.from_samples(yv, xv, uv, names)
    )
    fit, design = pooled_fit(yc, xc, uc, yv, xv, uv)
    assert got.estimate == pytest.approx(fit.params[1], rel=RTOL)
    assert got.se == pytest.approx(fit.bse[1], rel=RTOL)
    assert got.theta == pytest.approx(tuple(fit.params[2:]), rel=1e-8)
    assert got.p_value == pytest.approx(fit.pvalues[1], rel=1e-8)  # statsmodels: normal for cluster
    ci = fit.conf_int(0.05)[1]
    assert (got.lo, got.hi) == pytest.approx(tuple(ci), rel=RTOL)
    # Without covariates: the same correction with K = 2.
    plain = sm.OLS(fit.model.endog, design[:, :2]).fit(
        cov_type="cluster", cov_kwds={"groups": np.r_[uc, uv + 1_000_000]}
    )
    assert got.unadjusted == pytest.approx(plain.params[1], rel=RTOL)
    assert got.se_unadjusted == pytest.approx(plain.bse[1], rel=RTOL)
    assert got.variance_reduction == pytest.approx(1 - (fit.bse[1] / plain.bse[1]) ** 2, rel=1e-8)
    # The unclustered SE beside it: classic OLS.
    nonrobust, _ = pooled_fit(yc, xc, uc, yv, xv, uv, cov_type="nonrobust")
    assert got.se_iid == pytest.approx(nonrobust.bse[1], rel=RTOL)
    # Adjusted means at the pooled covariate mean; their difference is tau.
    xbar = np.r_[xc, xv].mean(axis=0)
    assert got.control_mean == pytest.approx(fit.params[0] + fit.params[2:] @ xbar, rel=RTOL)
    assert got.variant_mean - got.control_mean == pytest.approx(got.estimate, rel=1e-8)
    assert got.covariates == names
    assert (got.control_n, got.variant_n, got.control_clusters, got.variant_clusters) == (
        yc.size,
        yv.size,
        70,
        45,
    )
    # Prompt size explains much of y, so the adjustment pays.
    assert got.variance_reduction > 0.3


def test_requests_without_a_user_and_a_binary_metric_match_statsmodels():
    rng = np.random.default_rng(11)
    yc, xc, uc = raw_arm(rng, 50)
    yv, xv, uv = raw_arm(rng, 50)
    hit_c, hit_v = (yc <= 110).astype(float), (yv <= 110).astype(float)  # attainment, linear probability
    ids_c = np.array([None if i % 7 == 0 else f"c{u}" for i, u in enumerate(uc)], dtype=object)
    got = adjusted_difference(
        ArmData.from_samples(hit_c, xc[:, :1], ids_c), ArmData.from_samples(hit_v, xv[:, :1], uv)
    )
    groups_c = np.array([10_000 + i if i % 7 == 0 else u for i, u in enumerate(uc)])
    y = np.r_[hit_c, hit_v]
    design = np.c_[np.ones_like(y), np.r_[np.zeros(yc.size), np.ones(yv.size)], np.r_[xc[:, 0], xv[:, 0]]]
    fit = sm.OLS(y, design).fit(cov_type="cluster", cov_kwds={"groups": np.r_[groups_c, uv + 1_000_000]})
    assert got.estimate == pytest.approx(fit.params[1], rel=RTOL)
    assert got.se == pytest.approx(fit.bse[1], rel=RTOL)
    assert got.control_clusters == np.unique(groups_c).size


def test_aggregates_path_equals_raw_path_exactly():
    rng = np.random.default_rng(12)

    # Whole numbers (ms latencies, token counts): every sum is exact in float64, so both paths
    # must agree bit for bit.
    def arm(users: int):
        ids = rng.integers(0, users, 400)
        x = np.c_[rng.integers(10, 8000, 400), rng.integers(1, 300, 400)].astype(float)
        y = np.round(50 + 0.02 * x[:, 0] + rng.normal(0, 20, 400))
        return y, x, ids

    def aggregates(y, x, ids):
        users = sorted(set(ids.tolist()))  # np.unique's order, as the raw path
        rows = {u: [i for i in range(ids.size) if ids[i] == u] for u in users}
        return ArmData(
            n=np.array([len(rows[u]) for u in users]),
            sum_y=np.array([sum(y[i] for i in rows[u]) for u in users]),
            sum_x=np.array([[sum(x[i, k] for i in rows[u]) for k in range(2)] for u in users]),
            sum_xx=np.array(
                [
                    [[sum(x[i, k] * x[i, m] for i in rows[u]) for m in range(2)] for k in range(2)]
                    for u in users
                ]
            ),
            sum_xy=np.array([[sum(x[i, k] * y[i] for i in rows[u]) for k in range(2)] for u in users]),
            sum_yy=np.array([sum(y[i] * y[i] for i in rows[u]) for u in users]),
        )

    c, v = arm(60), arm(40)
    raw = adjusted_difference(ArmData.from_samples(*c), ArmData.from_samples(*v))
    agg = adjusted_difference(aggregates(*c), aggregates(*v))
    assert raw.as_dict() == agg.as_dict()


def test_without_covariates_it_is_the_clustered_difference_up_to_the_pooled_correction():
    rng = np.random.default_rng(13)
    yc, _, uc = raw_arm(rng, 40)
    yv, _, uv = raw_arm(rng, 30)
    got = adjusted_difference(ArmData.from_samples(yc, None, uc), ArmData.from_samples(yv, None, uv))
    per_arm = clustered_difference(ClusterSums.from_samples(yc, uc), ClusterSums.from_samples(yv, uv))
    assert got.estimate == pytest.approx(per_arm.estimate, rel=RTOL) == got.unadjusted
    assert got.se == pytest.approx(got.se_unadjusted, rel=RTOL) and got.theta == ()
    assert got.variance_reduction == pytest.approx(0.0, abs=1e-12)
    # The same CR0 meat: per arm G_a/(G_a-1) there, pooled G/(G-1)(N-1)/(N-2) here.
    cr0 = per_arm.control.se**2 * 39 / 40 + per_arm.variant.se**2 * 29 / 30
    n = yc.size + yv.size
    assert got.se**2 == pytest.approx(cr0 * 70 / 69 * (n - 1) / (n - 2), rel=RTOL)


def simulate_arms(rng: np.random.Generator, sims: int, users: int, slope: float, binary: bool = False):
    """Per-user sums of ``sims`` A/A experiments, batched: ArmData with a leading batch axis."""
    out = []
    for _ in range(2):
        n = 1 + np.floor(rng.lognormal(0.8, 1.0, (sims, users))).astype(np.int64)
        cell = np.repeat(np.arange(sims * users), n.ravel())
        prompt = rng.lognormal(7.0, 0.8, sims * users)[cell] * rng.lognormal(0.0, 0.3, cell.size)
        y = 60.0 + slope * prompt + rng.normal(0, 10, sims * users)[cell] + rng.normal(0, 8, cell.size)
        if binary:
            y = (y <= 100.0).astype(float)

        def per_cell(w: np.ndarray, cell: np.ndarray = cell) -> np.ndarray:
            return np.bincount(cell, w, minlength=sims * users).reshape(sims, users)

        out.append(
            ArmData(
                n=n,
                sum_y=per_cell(y),
                sum_x=per_cell(prompt)[..., None],
                sum_xx=per_cell(prompt * prompt)[..., None, None],
                sum_xy=per_cell(prompt * y)[..., None],
                sum_yy=per_cell(y * y),
            )
        )
    return out


@pytest.mark.parametrize(
    ("slope", "binary", "least_reduction"),
    [(0.03, False, 0.5), (0.03, True, 0.15), (0.0, False, None)],
    ids=["latency-depends-on-prompt", "attainment-depends-on-prompt", "latency-independent-of-prompt"],
)
def test_adjustment_reduces_variance_when_y_depends_on_x_and_does_no_harm_otherwise(
    slope, binary, least_reduction
):
    rng = np.random.default_rng(14 + int(binary) + 2 * int(slope == 0))
    control, variant = simulate_arms(rng, 1500, 200, slope, binary)
    fit = adjusted_moments(control, variant)
    z = sps.norm.ppf(0.975)
    cover = (np.abs(fit.estimate) <= z * np.sqrt(fit.variance)).mean()
    cover_plain = (np.abs(fit.unadjusted) <= z * np.sqrt(fit.variance_unadjusted)).mean()
    assert cover >= 0.94 and cover_plain >= 0.94, (cover, cover_plain)
    empirical = 1 - np.var(fit.estimate) / np.var(fit.unadjusted)
    reported = float(np.mean(1 - fit.variance / fit.variance_unadjusted))
    if least_reduction is None:
        # An unrelated covariate costs about nothing: the estimator's variance does not grow, and
        # the reported reduction is only the sandwich's small-sample bias (about p / G, a chance fit).
        assert abs(reported) < 0.03 and empirical > -0.02, (reported, empirical)
    else:
        assert reported > least_reduction and empirical > least_reduction, (reported, empirical)
        assert reported == pytest.approx(empirical, abs=0.06)
    # The batch is the one-experiment API.
    one = adjusted_difference(
        *(
            ArmData(a.n[3], a.sum_y[3], a.sum_x[3], a.sum_xx[3], a.sum_xy[3], a.sum_yy[3])
            for a in (control, variant)
        )
    )
    assert one.estimate == pytest.approx(fit.estimate[3], rel=RTOL)
    assert one.se == pytest.approx(math.sqrt(fit.variance[3]), rel=RTOL)


def test_too_few_users_give_no_interval_and_say_why():
    one_user = ArmData.from_samples([100.0, 120.0, 90.0], [1000.0, 3000.0, 500.0], ["u", "u", "u"])
    many = ArmData.from_samples(
        [100.0, 130.0, 95.0, 140.0], [900.0, 3100.0, 700.0, 2000.0], ["a", "b", "c", "d"]
    )
    got = adjusted_difference(one_user, many)
    assert math.isfinite(got.estimate)
    assert (got.se, got.lo, got.hi, got.p_value, got.variance_reduction) == (None, None, None, None, None)
    assert got.note.startswith("control: fewer than 2 users")
    json.dumps(got.as_dict(), allow_nan=False)


def test_result_is_a_json_safe_frozen_dataclass():
    rng = np.random.default_rng(15)
    yc, xc, uc = raw_arm(rng, 20)
    yv, xv, uv = raw_arm(rng, 20)
    got = adjusted_difference(ArmData.from_samples(yc, xc, uc), ArmData.from_samples(yv, xv, uv))
    assert isinstance(got, AdjustedDifference) and got.covariates == ("x1", "x2")
    out = json.loads(json.dumps(got.as_dict(), allow_nan=False))
    assert out["theta"] == list(got.theta) and "effective users" in out["note"]
    with pytest.raises(AttributeError):
        got.estimate = 0.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ArmData.from_samples([1.0, 2.0], [[1.0], [2.0], [3.0]]), "x has shape"),
        (lambda: ArmData.from_samples([1.0, 2.0], [1.0, 2.0], ["a"]), "clusters has shape"),
        (lambda: ArmData.from_samples([1.0, math.nan], [1.0, 2.0]), "y contains NaN"),
        (lambda: ArmData.from_samples([1.0, 2.0], [1.0, math.inf]), "x contains NaN"),
        (lambda: ArmData(n=[2, -1], sum_y=[1.0, 1.0]), "n must be >= 0"),
        (lambda: ArmData(n=[2, 1], sum_y=[1.0, 1.0], sum_x=[1.0, 1.0]), "must be given together"),
        (
            lambda: ArmData(
                n=[2], sum_y=[1.0], sum_x=[[1.0, 2.0]], sum_xx=[[[1.0, 2.0], [3.0, 4.0]]], sum_xy=[[1.0, 1.0]]
            ),
            "symmetric",
        ),
        (
            lambda: ArmData(n=[2], sum_y=[1.0], sum_x=[1.0], sum_xx=[-1.0], sum_xy=[1.0]),
            "negative sum of squares",
        ),
        (lambda: ArmData(n=[0, 1], sum_y=[1.0, 1.0]), "n = 0 has nonzero sums"),
        (lambda: ArmData(n=[1], sum_y=[1.0], covariates=("prompt",)), "no sum_x"),
        (
            lambda: ArmData(
                n=[1], sum_y=[1.0], sum_x=[1.0], sum_xx=[1.0], sum_xy=[1.0], covariates=("a", "b")
            ),
            "2 covariate names",
        ),
        (lambda: ArmData(n=[1], sum_y=[1.0], sum_yy=[-1.0]), "sum_yy must be >= 0"),
    ],
)
def test_bad_input_is_refused_naming_the_argument(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_constant_collinear_or_mismatched_covariates_are_refused():
    rng = np.random.default_rng(16)
    yc, xc, uc = raw_arm(rng, 20)
    yv, xv, uv = raw_arm(rng, 20)
    const_c, const_v = np.c_[xc[:, 0], np.full(yc.size, 7.0)], np.c_[xv[:, 0], np.full(yv.size, 7.0)]
    with pytest.raises(ValueError, match="constant or collinear"):
        adjusted_difference(ArmData.from_samples(yc, const_c, uc), ArmData.from_samples(yv, const_v, uv))
    double_c, double_v = np.c_[xc[:, 0], 2 * xc[:, 0] + 1], np.c_[xv[:, 0], 2 * xv[:, 0] + 1]
    with pytest.raises(ValueError, match="constant or collinear"):
        adjusted_difference(ArmData.from_samples(yc, double_c, uc), ArmData.from_samples(yv, double_v, uv))
    with pytest.raises(ValueError, match="covariates differ"):
        adjusted_difference(
            ArmData.from_samples(yc, xc, uc, ("prompt", "max")),
            ArmData.from_samples(yv, xv, uv, ("max", "prompt")),
        )
    with pytest.raises(ValueError, match="control has no requests"):
        adjusted_difference(
            ArmData(n=[0], sum_y=[0.0], sum_x=[0.0], sum_xx=[0.0], sum_xy=[0.0]),
            ArmData.from_samples(yv, xv[:, 0], uv),
        )
    with pytest.raises(ValueError, match="conf must be strictly between 0 and 1"):
        adjusted_difference(ArmData.from_samples(yc, xc, uc), ArmData.from_samples(yv, xv, uv), conf=0.0)


# Anytime-valid sequences (stats.sequential.adjusted).


def test_mixture_ratio_minimizes_the_width_and_the_width_is_the_closed_form():
    for alpha in (0.01, 0.05, 0.2):
        two_l = 2 * math.log(1 / alpha)
        best = optimize.minimize_scalar(
            lambda r, two_l=two_l: (1 + 1 / r) * (math.log1p(r) + two_l), bounds=(0.1, 100), method="bounded"
        )
        assert optimal_ratio(alpha) == pytest.approx(best.x, rel=1e-4)
    r = optimal_ratio(ALPHA)
    v, n = 4.0, 3 * DEFAULT_TARGET_N
    rr = r * n / DEFAULT_TARGET_N
    expected = math.sqrt(v * (1 + 1 / rr) * (math.log1p(rr) + 2 * math.log(1 / ALPHA)))
    assert float(normal_mixture_half_width(v, n, ALPHA)) == pytest.approx(expected, rel=1e-12)
    # At target_n the sequence is about 1.5 times the fixed-horizon half-width.
    at_target = float(normal_mixture_half_width(1.0, DEFAULT_TARGET_N, ALPHA))
    assert 1.4 < at_target / sps.norm.ppf(0.975) < 1.7
    lo, hi = asymptotic_cs_bounds(
        [1.0, 1.0, 1.0], [1.0, np.nan, 1.0], [DEFAULT_TARGET_N, DEFAULT_TARGET_N, 0]
    )
    assert lo[0] == pytest.approx(1 - at_target) and hi[0] == pytest.approx(1 + at_target)
    assert np.isinf(lo[1:]).all() and np.isinf(hi[1:]).all()
    with pytest.raises(ValueError, match="target_n"):
        normal_mixture_half_width(1.0, 10, ALPHA, target_n=0)
    with pytest.raises(ValueError, match="alpha"):
        normal_mixture_half_width(1.0, 10, 1.0)


def test_normal_mixture_boundary_holds_at_every_look_for_iid_gaussian_means():
    # Ville's inequality for the Gaussian mixture: a walk of unit-variance means, read after every
    # batch of 20 for 500 batches, leaves the sequence in at most alpha of the paths. Fixed-horizon
    # intervals read the same way fail far more often.
    rng = np.random.default_rng(17)
    sims, looks, batch = 4000, 500, 20
    n = batch * np.arange(1, looks + 1)
    sums = np.cumsum(rng.normal(0.0, math.sqrt(batch), (sims, looks)), axis=1)
    est, var = sums / n, 1.0 / n
    lo, hi = asymptotic_cs_bounds(est, var, n, ALPHA, target_n=2000)
    ever = ((lo > 0) | (hi < 0)).any(axis=1).mean()
    fixed = (np.abs(est) > sps.norm.ppf(0.975) * np.sqrt(var)).any(axis=1).mean()
    assert ever <= ALPHA, ever
    assert fixed > 3 * ALPHA, fixed


def test_clustered_sequence_under_peeking_with_returning_heterogeneous_users():
    # 300 users per arm return look after look (heavy-tailed rates, a per-user effect): the
    # sequence with the clustered variance keeps the A/A false rejection at most alpha over 30
    # looks; the same boundary with the variance that treats requests as independent does not.
    rng = np.random.default_rng(18)
    sims, users, looks = 300, 300, 30
    rate = rng.lognormal(0.0, 1.0, (2, sims, users)) * 0.5
    effect = rng.normal(0.0, 1.0, (2, sims, users))
    n = np.zeros((2, sims, users), dtype=np.int64)
    s = np.zeros((2, sims, users))
    ss = np.zeros((2, sims, users))
    ever = np.zeros(sims, bool)
    ever_iid = np.zeros(sims, bool)
    for _ in range(looks):
        k = rng.poisson(rate)
        e_sum = np.sqrt(k) * rng.normal(size=k.shape)
        n += k
        s += k * effect + e_sum
        ss += k * effect**2 + 2 * effect * e_sum + np.where(k > 0, e_sum**2 / np.maximum(k, 1), 0.0)
        ss += np.where(k > 1, rng.chisquare(np.maximum(k - 1, 1)), 0.0)
        arms = [ClusterSums(n[a], s[a], ss[a]) for a in (0, 1)]
        mc, mv = arms[0].moments(), arms[1].moments()
        est = mv.estimate - mc.estimate
        total = mc.n + mv.n
        lo, hi = asymptotic_cs_bounds(est, mc.variance + mv.variance, total, ALPHA)
        ever |= (lo > 0) | (hi < 0)
        lo, hi = asymptotic_cs_bounds(est, mc.variance_iid + mv.variance_iid, total, ALPHA)
        ever_iid |= (lo > 0) | (hi < 0)
    tolerance = sps.binom.ppf(0.999, sims, ALPHA) / sims
    assert ever.mean() <= tolerance, ever.mean()
    assert ever_iid.mean() > 3 * ALPHA, ever_iid.mean()
    one = clustered_difference_sequence(
        ClusterSums(n[0, 0], s[0, 0], ss[0, 0]), ClusterSums(n[1, 0], s[1, 0], ss[1, 0]), ALPHA
    )
    lo0, hi0 = asymptotic_cs_bounds(
        est[0], float(arms[0].moments().variance[0] + arms[1].moments().variance[0]), total[0], ALPHA
    )
    assert (one.lo, one.hi) == pytest.approx((float(lo0), float(hi0)), rel=RTOL)


def test_sequences_wait_for_min_clusters_and_match_the_fixed_horizon_fit():
    rng = np.random.default_rng(19)
    yc, xc, uc = raw_arm(rng, 80)
    yv, xv, uv = raw_arm(rng, 80, shift=30.0)
    c, v = ArmData.from_samples(yc, xc, uc), ArmData.from_samples(yv, xv, uv)
    seq = adjusted_difference_sequence(c, v, ALPHA, target_n=1000, min_clusters=50)
    fixed = adjusted_difference(c, v)
    assert isinstance(seq, SequentialInterval) and seq.alpha == ALPHA and "adjusted" in seq.method
    assert seq.estimate == pytest.approx(fixed.estimate, rel=RTOL)
    half = float(normal_mixture_half_width(fixed.se**2, yc.size + yv.size, ALPHA, 1000))
    assert (seq.lo, seq.hi) == pytest.approx((fixed.estimate - half, fixed.estimate + half), rel=RTOL)
    assert half > fixed.hi - fixed.estimate  # wider than the fixed-horizon interval
    assert seq.lo > 0  # the shift of 30 is found
    early = adjusted_difference_sequence(c, v, ALPHA, min_clusters=81)
    assert (early.lo, early.hi) == (None, None) and early.estimate == seq.estimate
    json.dumps(seq.as_dict(), allow_nan=False)
    with pytest.raises(ValueError, match="min_clusters"):
        adjusted_difference_sequence(c, v, ALPHA, min_clusters=1)
    with pytest.raises(ValueError, match="alpha"):
        clustered_difference_sequence(
            ClusterSums.from_samples(yc, uc), ClusterSums.from_samples(yv, uv), alpha=0
        )


@pytest.mark.parametrize(
    ("where", "fit"),
    [
        ("adjusted_difference", lambda c, v: adjusted_difference(c, v)),
        ("adjusted_difference_sequence", lambda c, v: adjusted_difference_look(c, v, ALPHA)),
    ],
)
def test_the_fixed_and_the_anytime_fit_refuse_the_same_arms_the_same_way(where, fit):
    # An arm of the wrong kind is a TypeError: the callers (guardrails, analysis.units) read a
    # ValueError as collinear covariates and drop one, which would hide it. An arm without
    # requests has no slope to fit: refused, not a look with NaN slopes.
    rng = np.random.default_rng(21)
    yc, xc, uc = raw_arm(rng, 20)
    yv, xv, uv = raw_arm(rng, 20)
    c, v = ArmData.from_samples(yc, xc[:, 0], uc), ArmData.from_samples(yv, xv[:, 0], uv)
    with pytest.raises(TypeError, match=f"^{where}: control must be ArmData or ArmMoments, got ClusterSums$"):
        fit(ClusterSums.from_samples(yc, uc), v)
    with pytest.raises(
        TypeError, match=f"^{where}: control and variant must be both ArmData or both ArmMoments$"
    ):
        fit(c, v.arm_moments())
    with pytest.raises(ValueError, match=f"^{where}: variant has no requests$"):
        fit(c, ArmData(n=[0, 0], sum_y=[0.0, 0.0], sum_x=[0.0, 0.0], sum_xx=[0.0, 0.0], sum_xy=[0.0, 0.0]))
    with pytest.raises(
        ValueError, match=rf"^{where}: variant must hold one experiment \(clusters on one axis\)"
    ):
        fit(c, ArmData(n=[[1], [1]], sum_y=[[1.0], [2.0]]))


def test_the_mean_sequence_and_the_adjusted_look_are_the_boundary_on_the_fixed_horizon_fit():
    # One arm's mean (a rollout's "candidate attainment >= x"): the boundary around the
    # clustered ratio mean over that arm's requests; the adjusted look carries the same
    # variance reduction as the fixed-horizon adjusted difference.
    rng = np.random.default_rng(20)
    yc, xc, uc = raw_arm(rng, 80)
    yv, xv, uv = raw_arm(rng, 80, shift=30.0)
    arm = ClusterSums.from_samples(yv, uv)
    mo = arm.moments()
    seq = clustered_mean_sequence(arm, ALPHA, target_n=1000, min_clusters=50)
    lo, hi = asymptotic_cs_bounds(mo.estimate, mo.variance, yv.size, ALPHA, 1000)
    assert (seq.estimate, seq.lo, seq.hi) == pytest.approx(
        (float(mo.estimate), float(lo), float(hi)), rel=RTOL
    )
    assert "ratio mean" in seq.method and seq.alpha == ALPHA
    early = clustered_mean_sequence(arm, ALPHA, min_clusters=81)
    assert (early.lo, early.hi) == (None, None) and early.estimate == seq.estimate
    c, v = ArmData.from_samples(yc, xc, uc), ArmData.from_samples(yv, xv, uv)
    look = adjusted_difference_look(c, v, ALPHA, target_n=1000)
    fixed = adjusted_difference(c, v)
    assert look.interval == adjusted_difference_sequence(c, v, ALPHA, target_n=1000)
    assert look.variance_reduction == pytest.approx(fixed.variance_reduction, rel=RTOL)
    assert look.theta == pytest.approx(fixed.theta, rel=RTOL) and look.variance_reduction > 0.5
    with pytest.raises(ValueError, match="one arm's ClusterSums"):
        clustered_mean_sequence(ArmData.from_samples(yv, None, uv), ALPHA)  # type: ignore[arg-type]
