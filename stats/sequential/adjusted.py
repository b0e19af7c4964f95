"""Anytime-valid confidence sequences for the user-clustered and the covariate-adjusted difference.

The sequences of stats.sequential.means are exact for independent 0/1 outcomes; requests of one
user are not independent, and an exact construction has no room for covariates. Here the
fixed-horizon estimate and its robust variance (stats.clustered, stats.adjusted) go through a
normal-mixture boundary instead: the asymptotic confidence sequence of Waudby-Smith, Arbour,
Sinha, Kennedy & Ramdas ("Time-uniform central limit theory and asymptotic confidence
sequences", Annals of Statistics 2024, arXiv:2103.06476), applied to a regression coefficient
with its sandwich variance as Lindon, Ham, Tingley & Bojinov do ("Anytime-valid linear models
and regression adjusted causal inference in randomized experiments", 2022, arXiv:2210.08589).

The boundary: for a standardized sum S_t of t units with variance sigma^2 each, the Gaussian
mixture over lambda ~ N(0, rho^2) of exp(lambda S_t / sigma - lambda^2 t / 2) is
M_t = (t rho^2 + 1)^(-1/2) exp(rho^2 S_t^2 / (2 sigma^2 (t rho^2 + 1))) (Robbins 1970); by
Ville's inequality it exceeds 1/alpha at some t with probability <= alpha. In terms of an
estimate with variance v = sigma^2 / t and r = t rho^2:

    estimate +- sqrt(v * (1 + 1/r) * (log(1 + r) + 2 log(1/alpha)))

which holds at every t at once (two-sided, level alpha; asymptotically, with the plug-in
variance). rho is fixed before the data: r = r* n / target_n, where r* solves
r = 2 log(1/alpha) + log(1 + r), makes the sequence narrowest at n = target_n requests
(about 1.5 times the fixed-horizon half-width there at alpha 0.05; wider before, and growing
only like sqrt(log n) times it after). n is the total requests of both arms (of the one arm for
``clustered_mean_sequence``, one arm's mean: a rollout's "candidate attainment >= x").

What the guarantee rests on, and the guards here:
- asymptotic: the plug-in variance must be close to the truth, which fails at the first looks
  with few users (the cluster-robust variance is then noisy and low). No bounds until each arm
  has ``min_clusters`` users;
- the independent unit is the user: the variance is the cluster-robust one, so correlation
  between one user's requests is accounted for at each look. In calendar time a returning user
  adds requests at several looks; the benchmark (bench/bench_clustered.py) measures the false
  rejection rate under a look every 30 s of such traffic;
- a share with few events (an error rate of 0.1% with a handful of errors) is far from normal:
  the exact sequences of stats.sequential.means suit it better (they treat requests as
  independent).

Every sequence takes an arm as its per-user arrays (ClusterSums, ArmData) or as those sums
reduced over its users (stats.clustered.ArmMoments: what a store returns when the users are too
many to bring to Python one by one); both give the same interval, to rounding.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from stats.adjusted import ArmData, fit_arms
from stats.clustered import ArmMoments, ClusterSums, clustered_difference_moments, no_spread
from stats.sequential._base import DEFAULT_ALPHA, SequentialInterval, check_alpha, finite_or_none
from stats.sequential.means import MeanSequence

# Where the sequence is narrowest, in requests of both arms: a rollout step at 20 req/s decides
# within minutes to an hour, so ~10^4 requests is where its looks matter most.
DEFAULT_TARGET_N = 10_000
# Users per arm before any bound: below this the cluster-robust variance is too noisy for the
# asymptotic boundary (bench/bench_clustered.py, A/A with heavy-tailed users).
DEFAULT_MIN_CLUSTERS = 50
CLUSTERED_MEAN_METHOD = (
    "anytime-valid (asymptotic): normal-mixture confidence sequence on the ratio mean with its "
    "user-clustered variance"
)
CLUSTERED_METHOD = (
    "anytime-valid (asymptotic): normal-mixture confidence sequence on the difference of ratio "
    "means with its user-clustered variance"
)
NO_SPREAD_MEAN_METHOD = (
    "anytime-valid: no events (or all events), so no spread between users to estimate: the "
    "beta-binomial mixture sequence at the arm's N requests (stats.sequential.means)"
)
NO_SPREAD_DIFFERENCE_METHOD = (
    "anytime-valid: an arm without events (or all events) has no spread between users to estimate: "
    "per-arm sequences at alpha/2 each (that arm's beta-binomial one at its N requests, the other's "
    "user-clustered), [lo_v - hi_c, hi_v - lo_c] (Bonferroni)"
)
ADJUSTED_METHOD = (
    "anytime-valid (asymptotic): normal-mixture confidence sequence on the covariate-adjusted "
    "difference with its user-clustered sandwich variance"
)


@functools.lru_cache(maxsize=64)
def optimal_ratio(alpha: float) -> float:
    """r* minimizing (1 + 1/r)(log(1 + r) + 2 log(1/alpha)): the root of r = 2 log(1/alpha) + log(1 + r).

    The map is a contraction (slope 1/(1 + r) < 1/3 for alpha < 0.5), so the iteration converges.
    """
    check_alpha(alpha, "optimal_ratio")
    two_l = 2.0 * math.log(1.0 / alpha)
    r = two_l + 1.0
    for _ in range(200):
        nxt = two_l + math.log1p(r)
        if abs(nxt - r) <= 1e-14 * r:
            return nxt
        r = nxt
    return r


def _check_target(target_n: float, where: str) -> None:
    if isinstance(target_n, bool) or not (isinstance(target_n, int | float) and 0 < target_n < math.inf):
        raise ValueError(f"{where}: target_n must be a positive number of requests, got {target_n!r}")


def normal_mixture_half_width(
    variance: np.ndarray | float,
    n: np.ndarray | float,
    alpha: float = DEFAULT_ALPHA,
    target_n: float = DEFAULT_TARGET_N,
) -> np.ndarray:
    """Half-width of the sequence at variance ``variance`` of the estimate after ``n`` requests.

    Vectorized; NaN variance (too few users) or n <= 0 gives an infinite half-width.
    """
    check_alpha(alpha, "normal_mixture_half_width")
    _check_target(target_n, "normal_mixture_half_width")
    v = np.asarray(variance, dtype=float)
    nn = np.asarray(n, dtype=float)
    if (v < 0).any():
        raise ValueError("normal_mixture_half_width: variance must be >= 0")
    r = optimal_ratio(float(alpha)) * nn / float(target_n)
    with np.errstate(divide="ignore", invalid="ignore"):
        half = np.sqrt(v * (1.0 + 1.0 / r) * (np.log1p(r) + 2.0 * math.log(1.0 / alpha)))
    return np.where(np.isfinite(half) & (nn > 0), half, np.inf)


def asymptotic_cs_bounds(
    estimate: np.ndarray | float,
    variance: np.ndarray | float,
    n: np.ndarray | float,
    alpha: float = DEFAULT_ALPHA,
    target_n: float = DEFAULT_TARGET_N,
) -> tuple[np.ndarray, np.ndarray]:
    """Vectorized (lo, hi) of the sequence for many experiments or looks at once (simulations)."""
    half = normal_mixture_half_width(variance, n, alpha, target_n)
    est = np.asarray(estimate, dtype=float)
    with np.errstate(invalid="ignore"):
        lo = np.where(np.isfinite(half), est - half, -np.inf)
        hi = np.where(np.isfinite(half), est + half, np.inf)
    return lo, hi


def _check_min_clusters(min_clusters: int, where: str) -> None:
    if isinstance(min_clusters, bool) or not isinstance(min_clusters, int) or min_clusters < 2:
        raise ValueError(f"{where}: min_clusters must be an integer >= 2, got {min_clusters!r}")


def _interval(
    estimate: float,
    variance: float,
    n: float,
    clusters: tuple[int, int],
    alpha: float,
    target_n: float,
    min_clusters: int,
    method: str,
) -> SequentialInterval:
    est = finite_or_none(estimate)  # NaN (an arm without requests) is not finite either
    if est is None or min(clusters) < min_clusters or not math.isfinite(variance):
        return SequentialInterval(est, None, None, alpha, method)
    lo, hi = asymptotic_cs_bounds(estimate, variance, n, alpha, target_n)
    return SequentialInterval(est, finite_or_none(float(lo)), finite_or_none(float(hi)), alpha, method)


def _check_cluster_arm(arm: object, where: str, label: str) -> None:
    if isinstance(arm, ArmMoments):
        return  # one arm with at least one request by construction
    if not isinstance(arm, ClusterSums) or arm.n.ndim != 1:
        raise ValueError(
            f"{where}: {label} must be one arm's ClusterSums or ArmMoments (clusters on one axis)"
        )


def _clusters(arm: ClusterSums | ArmMoments) -> int:
    return arm.clusters if isinstance(arm, ArmMoments) else int((arm.n > 0).sum())


def _requests(arm: ClusterSums | ArmMoments) -> int:
    return arm.n if isinstance(arm, ArmMoments) else int(arm.n.sum())


def clustered_difference_sequence(
    control: ClusterSums | ArmMoments,
    variant: ClusterSums | ArmMoments,
    alpha: float = DEFAULT_ALPHA,
    target_n: float = DEFAULT_TARGET_N,
    min_clusters: int = DEFAULT_MIN_CLUSTERS,
) -> SequentialInterval:
    """Variant - control mean per request (stats.clustered), anytime-valid at ``alpha``.

    Read it at every look from the current per-user totals; bounds are None until each arm has
    ``min_clusters`` users.
    """
    where = "clustered_difference_sequence"
    check_alpha(alpha, where)
    _check_target(target_n, where)
    _check_min_clusters(min_clusters, where)
    for label, arm in (("control", control), ("variant", variant)):
        _check_cluster_arm(arm, where, label)
    d = clustered_difference_moments(control, variant)
    clusters = (_clusters(control), _clusters(variant))
    n = float(_requests(control) + _requests(variant))
    if min(clusters) >= min_clusters and (no_spread(control) or no_spread(variant)):
        # A variance of 0 is no certainty: each arm at alpha/2 (the one without spread through
        # the exact sequence at N), their bounds combined as stats.sequential.means does.
        half = alpha / 2.0
        c = clustered_mean_sequence(control, half, target_n, min_clusters)
        v = clustered_mean_sequence(variant, half, target_n, min_clusters)
        if None not in (c.lo, c.hi, v.lo, v.hi):
            assert c.lo is not None and c.hi is not None and v.lo is not None and v.hi is not None
            low, high = (0.0, 1.0)
            c_lo, c_hi = max(c.lo, low), min(c.hi, high)  # a share's truth lies in [0, 1]
            v_lo, v_hi = max(v.lo, low), min(v.hi, high)
            est = float(d.estimate)
            return SequentialInterval(
                est, min(est, v_lo - c_hi), max(est, v_hi - c_lo), alpha, NO_SPREAD_DIFFERENCE_METHOD
            )
    return _interval(
        float(d.estimate), float(d.variance), n, clusters, alpha, target_n, min_clusters, CLUSTERED_METHOD
    )


def clustered_mean_sequence(
    arm: ClusterSums | ArmMoments,
    alpha: float = DEFAULT_ALPHA,
    target_n: float = DEFAULT_TARGET_N,
    min_clusters: int = DEFAULT_MIN_CLUSTERS,
) -> SequentialInterval:
    """One arm's mean per request (stats.clustered's ratio mean), anytime-valid at ``alpha``.

    The same boundary as the differences, over this arm's requests (n = its requests); bounds
    are None until the arm has ``min_clusters`` users. A 0/1 metric's bounds are not clipped to
    [0, 1] here: the caller knows the metric's range.
    """
    where = "clustered_mean_sequence"
    check_alpha(alpha, where)
    _check_target(target_n, where)
    _check_min_clusters(min_clusters, where)
    _check_cluster_arm(arm, where, "arm")
    mo = arm.moments()
    g = int(mo.clusters)
    if g >= min_clusters and no_spread(arm):
        # no events (or all): a variance of 0 would give a point; the exact sequence at N instead
        big_n = int(round(float(mo.n)))
        hits = int(round(float(mo.estimate) * big_n))
        iv = MeanSequence(n=big_n, hits=hits, alpha=alpha).interval()
        return SequentialInterval(iv.estimate, iv.lo, iv.hi, alpha, NO_SPREAD_MEAN_METHOD)
    return _interval(
        float(mo.estimate),
        float(mo.variance),
        float(mo.n),
        (g, g),
        alpha,
        target_n,
        min_clusters,
        CLUSTERED_MEAN_METHOD,
    )


class AdjustedLook(NamedTuple):
    """One look of the adjusted sequence with what the adjustment bought."""

    interval: SequentialInterval
    # 1 - V / V_0: V the adjusted estimate's clustered variance, V_0 the same fit's without
    # covariates (stats.adjusted.AdjustedDifference.variance_reduction); the sequence's width
    # shrinks by sqrt(1 - this). None when either variance is undefined.
    variance_reduction: float | None
    theta: tuple[float, ...]  # the pooled slopes, per covariate


def adjusted_difference_look(
    control: ArmData | ArmMoments,
    variant: ArmData | ArmMoments,
    alpha: float = DEFAULT_ALPHA,
    target_n: float = DEFAULT_TARGET_N,
    min_clusters: int = DEFAULT_MIN_CLUSTERS,
) -> AdjustedLook:
    """``adjusted_difference_sequence`` with the variance reduction and the slopes of the same fit
    (the rollout decision records both)."""
    where = "adjusted_difference_sequence"
    check_alpha(alpha, where)
    _check_target(target_n, where)
    _check_min_clusters(min_clusters, where)
    fit = fit_arms(control, variant, where)
    if bool(fit.degenerate):
        raise ValueError(f"{where}: the covariates {control.covariates} are constant or collinear")
    clusters = (int(fit.clusters[0]), int(fit.clusters[1]))
    var, var0 = float(fit.variance), float(fit.variance_unadjusted)
    interval = _interval(
        float(fit.estimate), var, float(fit.n.sum()), clusters, alpha, target_n, min_clusters, ADJUSTED_METHOD
    )
    reduction = 1.0 - var / var0 if math.isfinite(var) and math.isfinite(var0) and var0 > 0 else None
    if (
        isinstance(control, ArmMoments)
        and isinstance(variant, ArmMoments)
        and interval.lo is not None
        and interval.hi is not None
        and (no_spread(control) or no_spread(variant))
    ):
        # An arm's share without events (or all): at least as wide, on each side, as the
        # unadjusted sequence from the arms' own (clustered_difference_sequence), moved to the
        # adjusted estimate.
        plain = clustered_difference_sequence(
            control.select(()), variant.select(()), alpha, target_n, min_clusters
        )
        if plain.lo is not None and plain.hi is not None and plain.estimate is not None:
            est = float(fit.estimate)
            interval = SequentialInterval(
                est,
                min(interval.lo, est - (plain.estimate - plain.lo)),
                max(interval.hi, est + (plain.hi - plain.estimate)),
                alpha,
                ADJUSTED_METHOD + "; " + plain.method,
            )
    return AdjustedLook(interval, reduction, tuple(float(t) for t in fit.theta))


def adjusted_difference_sequence(
    control: ArmData | ArmMoments,
    variant: ArmData | ArmMoments,
    alpha: float = DEFAULT_ALPHA,
    target_n: float = DEFAULT_TARGET_N,
    min_clusters: int = DEFAULT_MIN_CLUSTERS,
) -> SequentialInterval:
    """Covariate-adjusted variant - control (stats.adjusted), anytime-valid at ``alpha``.

    Same per-user sums as ``stats.adjusted.adjusted_difference``; the covariates must be fixed
    before the variant sees the request. Bounds are None until each arm has ``min_clusters``
    users; an arm without requests or a constant or collinear covariate set raises ValueError,
    arms of the wrong kind TypeError (stats.adjusted.fit_arms).
    """
    return adjusted_difference_look(control, variant, alpha, target_n, min_clusters).interval
