"""User-clustered shares with no events (or all events): the clustered variance is then 0, which
is no evidence of certainty. Every such interval, fixed-horizon or anytime-valid, per arm, as a
difference and adjusted, is the one at the effective sample size the request-level interval uses
(N, since there is no spread between users to estimate): never a point. Checked against the
request-level intervals computed independently, by coverage over simulated data with a small
known rate, and in the degenerate cases (one user, every user at the same share)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stats.adjusted import adjusted_difference
from stats.clustered import ArmMoments, ClusterSums, clustered_difference, clustered_mean, no_spread
from stats.comparisons import attainment_difference
from stats.proportions import wilson_interval
from stats.sequential.adjusted import (
    adjusted_difference_sequence,
    clustered_difference_sequence,
    clustered_mean_sequence,
)
from stats.sequential.means import MeanSequence, difference_interval, mean_interval


def users_arm(values_per_user: list[np.ndarray]) -> ClusterSums:
    y = np.concatenate(values_per_user)
    uid = np.repeat(np.arange(len(values_per_user)), [v.size for v in values_per_user])
    return ClusterSums.from_samples(y, uid, binary=True)


def flat(n_users: int, per_user: int, value: float) -> ClusterSums:
    return users_arm([np.full(per_user, value) for _ in range(n_users)])


def moments(arm: ClusterSums, x: np.ndarray | None = None) -> ArmMoments:
    """ArmMoments of an arm, with one covariate per request when x is given (per-user sums)."""
    if x is None:
        return ArmMoments.from_clusters(arm.n, arm.sums, binary=True)
    starts = np.r_[0, np.cumsum(arm.n)[:-1]]
    sx = np.add.reduceat(x, starts)
    sxx = np.add.reduceat(x * x, starts)
    y = np.concatenate([np.full(k, s / k) for k, s in zip(arm.n, arm.sums, strict=True)])
    sxy = np.add.reduceat(x * y, starts)
    return ArmMoments.from_clusters(
        arm.n, arm.sums, sx[:, None], sxx[:, None, None], sxy[:, None], None, ("x",), True
    )


@pytest.mark.parametrize("value", [0.0, 1.0])
def test_an_arm_without_events_or_all_events_has_the_wilson_interval_at_its_requests(value):
    arm = flat(37, 11, value)
    got = clustered_mean(arm)
    ref = wilson_interval(int(value) * 407, 407)
    assert (got.lo, got.hi) == pytest.approx((ref.lo, ref.hi), rel=1e-12)
    assert got.hi - got.lo > 0.009
    assert "no spread between users" in got.note and "Wilson one at N" in got.note


@pytest.mark.parametrize("value", [0.0, 1.0])
def test_a_difference_of_two_arms_without_events_is_the_request_level_newcombe_not_a_point(value):
    c, v = flat(37, 11, value), flat(45, 9, value)
    got = clustered_difference(c, v)
    ref = attainment_difference(int(value) * 407, 407, int(value) * 405, 405)
    assert (got.lo, got.hi) == pytest.approx((ref.lo, ref.hi), rel=1e-12)
    assert got.lo < 0 < got.hi
    assert got.p_value == 1.0  # not "certain" either way
    for arm in (c, v):
        assert no_spread(arm) and no_spread(moments(arm))


def test_one_arm_without_events_combines_its_wilson_at_n_with_the_others_at_its_effective_size():
    rng = np.random.default_rng(2)
    c = flat(40, 10, 0.0)
    v = users_arm(
        [(rng.random(int(k)) < p).astype(float) for k, p in zip(rng.integers(5, 20, 60), rng.beta(1, 30, 60))]
    )
    got = clustered_difference(c, v)
    mv = clustered_mean(v)
    n_eff = mv.estimate * (1 - mv.estimate) / mv.se**2  # the variant's own effective sample size
    wv = wilson_interval(int(round(mv.estimate * v.n.sum())), int(v.n.sum()))  # Wilson at N ...
    assert n_eff < v.n.sum()  # ... is not the variant's: it is clustered
    wc = wilson_interval(0, 400)
    want_lo = mv.estimate - math.sqrt((mv.estimate - mv.lo) ** 2 + wc.hi**2)
    want_hi = mv.estimate + math.sqrt((mv.hi - mv.estimate) ** 2)
    assert (got.lo, got.hi) == pytest.approx((want_lo, want_hi), rel=1e-12)
    assert got.hi - got.lo > wv.hi - wv.lo  # wider than the request-level share alone


def test_every_user_at_the_same_share_is_zero_variance_and_gets_the_interval_at_n():
    arm = users_arm([np.array([1.0, 0.0]) for _ in range(50)])  # each user exactly half
    assert no_spread(arm)
    got = clustered_mean(arm)
    assert "every user at one share" in got.note
    ref = wilson_interval(50, 100)
    assert (got.lo, got.hi) == pytest.approx((ref.lo, ref.hi), rel=1e-12)


def test_one_user_still_gives_no_interval_and_says_why():
    got = clustered_mean(flat(1, 30, 0.0))
    assert got.lo is None and got.hi is None and "fewer than 2 users" in got.note


def test_anytime_arm_and_difference_without_events_are_the_exact_sequences_at_n():
    c, v = flat(120, 40, 0.0), flat(150, 30, 0.0)
    arm = clustered_mean_sequence(c)
    ref = mean_interval(0, 4800)
    assert (arm.lo, arm.hi) == pytest.approx((ref.lo, ref.hi), rel=1e-12) and arm.hi > 0
    diff = clustered_difference_sequence(moments(c), moments(v))
    ref_d = difference_interval(MeanSequence(4800, 0), MeanSequence(4500, 0))
    assert (diff.lo, diff.hi) == pytest.approx((ref_d.lo, ref_d.hi), rel=1e-12)
    assert diff.lo < 0 < diff.hi
    # below the minimum of users there are still no bounds at all
    few = clustered_mean_sequence(flat(10, 40, 0.0))
    assert few.lo is None and few.hi is None


def test_adjusted_differences_without_events_are_at_least_the_unadjusted_ones():
    rng = np.random.default_rng(4)
    c, v = flat(80, 12, 0.0), flat(90, 11, 0.0)
    cm, vm = (moments(a, rng.integers(50, 2000, int(a.n.sum())).astype(float)) for a in (c, v))
    fixed = adjusted_difference(cm, vm)
    plain = clustered_difference(c, v)
    assert fixed.lo <= plain.lo < 0 < plain.hi <= fixed.hi
    assert "no events" in fixed.note and fixed.p_value == 1.0
    seq = adjusted_difference_sequence(cm, vm)
    plain_seq = clustered_difference_sequence(moments(c), moments(v))
    assert seq.lo <= plain_seq.lo < 0 < plain_seq.hi <= seq.hi


def _simulated_arm(rng, users: int, rate: float, concentration: float) -> ClusterSums:
    """Users with heavy-tailed request counts and their own rate, Beta around `rate` (the
    smaller `concentration`, the more a user's requests are alike)."""
    k = 1 + np.floor(rng.lognormal(1.5, 0.8, users)).astype(int)
    p = rng.beta(rate * concentration, (1 - rate) * concentration, users)
    return users_arm([(rng.random(int(n)) < q).astype(float) for n, q in zip(k, p, strict=True)])


def test_coverage_of_a_small_true_rate_over_simulated_clustered_data():
    """A share of 0.05% over ~60 users of ~6 requests: most experiments see no event at all.
    The clustered intervals, fixed-horizon and anytime, cover the true rate (a point at 0 never
    could), and the difference of two arms covers the true difference."""
    rng = np.random.default_rng(11)
    rate, sims = 0.0005, 600
    hit_fixed = hit_seq = hit_diff = no_events = 0
    for _ in range(sims):
        arm = _simulated_arm(rng, 60, rate, 20.0)
        other = _simulated_arm(rng, 60, 2 * rate, 20.0)
        no_events += int(arm.sums.sum() == 0)
        m = clustered_mean(arm)
        hit_fixed += m.lo <= rate <= m.hi
        s = clustered_mean_sequence(arm, min_clusters=50)
        hit_seq += s.lo <= rate <= s.hi
        d = clustered_difference(arm, other)
        hit_diff += d.lo <= rate <= d.hi  # the true difference: 2 * rate - rate
    assert no_events / sims > 0.5  # the case under test is the common one here
    assert hit_fixed / sims >= 0.93
    assert hit_seq / sims >= 0.95
    assert hit_diff / sims >= 0.93
