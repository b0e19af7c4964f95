"""Confidence sequences for a share (SLA attainment, error rate) and for a difference of shares.

The construction: the beta-binomial mixture martingale (Robbins 1970; the conjugate mixture of
Howard, Ramdas, McAuliffe & Sekhon 2021, "Time-uniform, nonparametric, nonasymptotic confidence
sequences"). For outcomes x_i in [0, 1] with mean p, S_n their sum and F_n = n - S_n,

    M_n(p) = B(a + S_n, b + F_n) / B(a, b) / (p^S_n (1 - p)^F_n)

is the Beta(a, b) mixture of the likelihood ratios (q/p)^x ((1-q)/(1-p))^(1-x). Each ratio is
convex in x with mean <= 1 when E[x] = p (equal to 1 for 0/1 outcomes), so M_n(p) is a
nonnegative supermartingale with M_0 = 1, and by Ville's inequality

    P(there is an n with M_n(p) >= 1/alpha) <= alpha.

The confidence sequence is C_n = {p : M_n(p) < 1/alpha}: P(p is outside C_n at any n) <= alpha.
It is an interval around S_n/n (log M_n is convex in p, and M_n(S_n/n) <= 1), found here by
Newton's method on the logit scale from the outside in.

Why this one for a controller: it depends on (n, S_n) only, so the state is two counts, an
update is O(1), and the same totals read again from the sample store give the same interval
(an audit can recompute the numbers that decided). It is the exact Bernoulli likelihood ratio,
so it adapts to the small variance of shares near 1 (attainment 0.99x) where a sub-Gaussian
bound would be several times wider. Valid for i.i.d. outcomes and more generally for any
outcomes whose conditional mean given the past is p.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from scipy import special

from stats._common import check_counts
from stats.sequential._base import (
    DEFAULT_ALPHA,
    DEFAULT_PRIOR,
    SequentialInterval,
    check_alpha,
    check_prior,
)

_MAX_NEWTON = 200
# Newton stops when a step moves the logit by less than this (relative): far below any width
# the sequence can have at n <= 1e12, and monotone convergence keeps the bound on the wide side.
_T_TOL = 1e-12
MEAN_METHOD = "anytime-valid: beta-binomial mixture confidence sequence"
DIFFERENCE_METHOD = (
    "anytime-valid: per-arm beta-binomial confidence sequences at alpha/2 each, "
    "[lo_cand - hi_ctrl, hi_cand - lo_ctrl] (Bonferroni; any dependence between arms)"
)


def log_mixture(
    hits: np.ndarray | float,
    n: np.ndarray | float,
    p: np.ndarray | float,
    prior: tuple[float, float] = DEFAULT_PRIOR,
) -> np.ndarray:
    """log M_n(p), the log mixture martingale at the share ``p`` (vectorized).

    ``p`` is outside the confidence sequence at level alpha exactly when this is >= log(1/alpha).
    """
    a, b = check_prior(prior, "log_mixture")
    s = np.asarray(hits, dtype=float)
    f = np.asarray(n, dtype=float) - s
    p = np.asarray(p, dtype=float)
    with np.errstate(divide="ignore"):
        return (
            special.betaln(a + s, b + f) - special.betaln(a, b) - special.xlogy(s, p) - special.xlog1py(f, -p)
        )


def _check_arrays(hits: np.ndarray, n: np.ndarray, where: str) -> None:
    if not (np.isfinite(hits).all() and np.isfinite(n).all()):
        raise ValueError(f"{where}: hits and n must be finite numbers")
    if (n < 0).any() or (hits < 0).any() or (hits > n).any():
        raise ValueError(f"{where}: need n >= 0 and 0 <= hits <= n in every cell")


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def _outer_root(parts: tuple[np.ndarray, ...], centre: np.ndarray, width: np.ndarray) -> np.ndarray:
    """The root of g(t) = n * KL(phat || sigmoid(t)) - T on the side of ``centre`` that ``width``
    points to, approached from outside so that rounding leaves the bound wide, never narrow."""
    m, ph, qh, ent, thr = parts

    def g(t: np.ndarray, i: np.ndarray) -> np.ndarray:
        return m[i] * (ph[i] * _softplus(-t) + qh[i] * _softplus(t) - ent[i]) - thr[i]

    step = width.copy()
    todo = np.arange(centre.size)
    for _ in range(_MAX_NEWTON):  # outside the root: double the normal-approximation width
        inside = g(centre[todo] + step[todo], todo) < 0
        todo = todo[inside]
        if todo.size == 0:
            break
        step[todo] *= 2.0
    t = centre + step
    todo = np.arange(centre.size)
    for _ in range(_MAX_NEWTON):  # Newton inwards, only the cells still moving
        tt = t[todo]
        move = g(tt, todo) / (m[todo] * (special.expit(tt) - ph[todo]))
        t[todo] = tt - move
        todo = todo[np.abs(move) > _T_TOL * np.maximum(1.0, np.abs(tt))]
        if todo.size == 0:
            break
    return t


def mean_cs_bounds(
    hits: np.ndarray | Sequence[float] | float,
    n: np.ndarray | Sequence[float] | float,
    alpha: float = DEFAULT_ALPHA,
    prior: tuple[float, float] = DEFAULT_PRIOR,
) -> tuple[np.ndarray, np.ndarray]:
    """Vectorized (lo, hi) of the confidence sequence for many cells at once (simulations).

    ``hits`` is the sum of the [0, 1] outcomes (a count for 0/1 outcomes) over ``n`` samples;
    n = 0 gives [0, 1]. Steps:
    1. c = log M_n(S/n) <= 0, so the boundary is n * KL(S/n || p) = log(1/alpha) - c =: T.
    2. On the logit scale t, KL(S/n || sigmoid(t)) is convex: start outside the root (a normal
       approximation of the width, doubled until outside) and take Newton steps inwards; they
       converge monotonically, so the bound found errs on the wide side.
    3. All successes (or all failures) have a closed form: lo = exp(-T/n) (hi = 1 - exp(-T/n)).
    """
    check_alpha(alpha, "mean_cs_bounds")
    a, b = check_prior(prior, "mean_cs_bounds")
    s_all, n_all = np.broadcast_arrays(np.asarray(hits, dtype=float), np.asarray(n, dtype=float))
    _check_arrays(s_all, n_all, "mean_cs_bounds")
    lo = np.zeros(s_all.shape)
    hi = np.ones(s_all.shape)
    live = n_all > 0
    if not live.any():
        return lo, hi
    s, m = s_all[live], n_all[live]
    f = m - s
    phat, qhat = s / m, f / m
    c = special.betaln(a + s, b + f) - special.betaln(a, b) - special.xlogy(s, phat) - special.xlogy(f, qhat)
    thr = math.log(1.0 / alpha) - np.minimum(c, 0.0)  # c <= 0 in exact arithmetic
    ent = -(special.xlogy(phat, phat) + special.xlogy(qhat, qhat))
    lo_l, hi_l = np.empty(s.shape), np.empty(s.shape)

    all_hit, all_miss = f == 0, s == 0
    lo_l[all_hit], hi_l[all_hit] = np.exp(-thr[all_hit] / m[all_hit]), 1.0
    lo_l[all_miss], hi_l[all_miss] = 0.0, -np.expm1(-thr[all_miss] / m[all_miss])

    mid = ~(all_hit | all_miss)
    if mid.any():
        ph, qh, mm, tt, hh = phat[mid], qhat[mid], m[mid], thr[mid], ent[mid]
        centre = np.log(s[mid]) - np.log(f[mid])

        width = np.sqrt(2.0 * tt / (mm * ph * qh))
        for side, out in ((1.0, hi_l), (-1.0, lo_l)):
            out[mid] = special.expit(_outer_root((mm, ph, qh, hh, tt), centre, side * width))
    # Two ulps outwards: a bound near 1 (1 - 1e-12) is only representable to ~1e-4 of 1 - p,
    # and rounding must widen the sequence, never narrow it.
    lo_l = np.nextafter(np.nextafter(lo_l, -1.0), -1.0)
    hi_l = np.nextafter(np.nextafter(hi_l, 2.0), 2.0)
    lo[live] = np.clip(np.minimum(lo_l, phat), 0.0, 1.0)
    hi[live] = np.clip(np.maximum(hi_l, phat), 0.0, 1.0)
    return lo, hi


def difference_cs_bounds(
    control_hits: np.ndarray | Sequence[float] | float,
    control_n: np.ndarray | Sequence[float] | float,
    candidate_hits: np.ndarray | Sequence[float] | float,
    candidate_n: np.ndarray | Sequence[float] | float,
    alpha: float = DEFAULT_ALPHA,
    prior: tuple[float, float] = DEFAULT_PRIOR,
) -> tuple[np.ndarray, np.ndarray]:
    """Vectorized (lo, hi) for candidate - control.

    Each arm's sequence at alpha/2: with probability >= 1 - alpha both hold at every look at
    once (Bonferroni, whatever the dependence between the arms and however unequal or random
    their sample sizes), and then candidate - control is in [lo_v - hi_c, hi_v - lo_c].
    Costs little when one arm is much larger (a 1% rollout step): the large arm's width is small.
    """
    check_alpha(alpha, "difference_cs_bounds")
    lc, hc = mean_cs_bounds(control_hits, control_n, alpha / 2.0, prior)
    lv, hv = mean_cs_bounds(candidate_hits, candidate_n, alpha / 2.0, prior)
    return lv - hc, hv - lc


@dataclasses.dataclass(frozen=True, slots=True)
class MeanSequence:
    """The state of one share's confidence sequence: two counts, updated per batch in O(1).

    Immutable: ``update`` returns the next state, so a controller can keep the one it decided
    on. ``MeanSequence(n=N, hits=H)`` built from totals equals any sequence of updates summing
    to them.
    """

    n: int = 0
    hits: int = 0
    alpha: float = DEFAULT_ALPHA
    prior: tuple[float, float] = DEFAULT_PRIOR

    def __post_init__(self) -> None:
        check_counts(self.hits, self.n, "MeanSequence")
        check_alpha(self.alpha, "MeanSequence")
        object.__setattr__(self, "prior", check_prior(self.prior, "MeanSequence"))
        object.__setattr__(self, "n", int(self.n))
        object.__setattr__(self, "hits", int(self.hits))

    def update(self, hits: int, n: int) -> MeanSequence:
        """Add a batch of ``n`` samples of which ``hits`` were successes."""
        check_counts(hits, n, "MeanSequence.update")
        return dataclasses.replace(self, n=self.n + int(n), hits=self.hits + int(hits))

    def bounds(self, alpha: float | None = None) -> tuple[float, float]:
        lo, hi = mean_cs_bounds(self.hits, self.n, self.alpha if alpha is None else alpha, self.prior)
        return float(lo), float(hi)

    def interval(self, alpha: float | None = None) -> SequentialInterval:
        a = self.alpha if alpha is None else alpha
        lo, hi = self.bounds(a)
        return SequentialInterval(self.hits / self.n if self.n else None, lo, hi, a, MEAN_METHOD)


def mean_interval(
    hits: int, n: int, alpha: float = DEFAULT_ALPHA, prior: tuple[float, float] = DEFAULT_PRIOR
) -> SequentialInterval:
    """The confidence sequence of a share at its current totals."""
    return MeanSequence(n=n, hits=hits, alpha=alpha, prior=prior).interval()


def difference_interval(
    control: MeanSequence, candidate: MeanSequence, alpha: float = DEFAULT_ALPHA
) -> SequentialInterval:
    """Candidate - control share, anytime-valid at ``alpha`` (see ``difference_cs_bounds``).

    The arms' own ``alpha`` is not used: each is read at alpha/2 here. Their priors are.
    """
    check_alpha(alpha, "difference_interval")
    lc, hc = control.bounds(alpha / 2.0)
    lv, hv = candidate.bounds(alpha / 2.0)
    est = None
    if control.n and candidate.n:
        est = candidate.hits / candidate.n - control.hits / control.n
    return SequentialInterval(est, lv - hc, hv - lc, alpha, DIFFERENCE_METHOD)
