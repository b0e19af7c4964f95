"""Confidence sequences for a quantile (p99 TTFT), per arm and for candidate - control.

The construction (Howard & Ramdas 2022, "Sequential estimation of quantiles with applications
to A/B-testing and best-arm identification", the fixed-quantile sequence): let xi be the true
q-quantile, inf{x : F(x) >= q} (the population version of stats.quantiles' nearest rank).
Couple the samples to uniforms, X_i = F^-1(U_i), and let B_n count U_i <= q: B_n is a
Binomial(n, q) walk, and pathwise

    #{X_i < xi} <= B_n <= #{X_i <= xi}.

The beta-binomial mixture of stats.sequential.means gives, for the walk B_n, integer ranges
[k_lo(n), k_hi(n)] = {k : M_n(q; k) < 1/alpha} that hold at every n at once with probability
>= 1 - alpha. On that event, at every n,

    X_(k_lo) <= xi <= X_(k_hi + 1)        (order statistics, 1-based; outside 1..n: infinite)

because at least k_lo samples are <= xi and fewer than k_hi + 1 are < xi. So the interval
holds at all looks together with probability >= 1 - alpha, for any distribution (ties and
atoms included), with no assumption beyond i.i.d. samples within the arm.

Two ways to read the order statistics: ``SortedLatencies`` (exact, from sorted values) and
``LatencyHistogram`` (streaming counts on fixed bucket edges, O(buckets) state and O(batch)
updates; the bounds widen to the edges of the buckets holding the order statistics, which
keeps them valid; the sample store can return the same counts with one GROUP BY).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from scipy import special

from stats.quantiles import quantile_rank
from stats.sequential._base import (
    DEFAULT_ALPHA,
    DEFAULT_PRIOR,
    SequentialInterval,
    check_alpha,
    check_prior,
    finite_or_none,
)

QUANTILE_METHOD = "anytime-valid: beta-binomial quantile confidence sequence (order statistics)"
HISTOGRAM_METHOD = "anytime-valid: beta-binomial quantile confidence sequence (histogram bucket edges)"
DIFFERENCE_METHOD = (
    "anytime-valid: per-arm quantile confidence sequences at alpha/2 each, "
    "[lo_cand - hi_ctrl, hi_cand - lo_ctrl] (Bonferroni)"
)


def _check_q(q: float, where: str) -> None:
    if isinstance(q, bool) or not isinstance(q, float | int) or not 0.0 < q < 1.0:
        raise ValueError(f"{where}: quantile q must be strictly between 0 and 1, got {q!r}")


def quantile_cs_ranks(
    n: np.ndarray | Sequence[int] | int,
    q: float,
    alpha: float = DEFAULT_ALPHA,
    prior: tuple[float, float] = DEFAULT_PRIOR,
) -> tuple[np.ndarray, np.ndarray]:
    """1-based ranks (lo, hi) of the order statistics bounding the q-quantile at each n.

    lo = 0 means the lower bound is -inf (too few samples); hi = n + 1 means +inf. Vectorized
    over n; exact integer arithmetic on the ranks, O(log n) evaluations of the mixture:
    1. L(k) = log M_n(q; k) is convex in k with L(k+1) - L(k) = log((a+k)/(b+n-k-1)) - logit(q),
       so its minimum is at k_min = ceil(q (b+n-1) - a (1-q)) (clipped to 0..n), where L < 0.
    2. Binary search each side for the last k with L(k) < log(1/alpha).
    """
    _check_q(q, "quantile_cs_ranks")
    check_alpha(alpha, "quantile_cs_ranks")
    a, b = check_prior(prior, "quantile_cs_ranks")
    nn = np.asarray(n)
    if nn.size and (not np.issubdtype(nn.dtype, np.integer) or (nn < 0).any()):
        raise ValueError("quantile_cs_ranks: n must be integer counts >= 0")
    shape = nn.shape
    nn = nn.astype(np.int64).reshape(-1)
    thr = math.log(1.0 / alpha)
    lq, l1q = math.log(q), math.log1p(-q)
    base = special.betaln(a, b)

    def accepted(k: np.ndarray, m: np.ndarray) -> np.ndarray:
        kf, mf = k.astype(float), m.astype(float)
        return special.betaln(a + kf, b + mf - kf) - base - kf * lq - (mf - kf) * l1q < thr

    k_min = np.clip(np.ceil(q * (b + nn - 1.0) - a * (1.0 - q)), 0, nn).astype(np.int64)
    # Upper side: invariant accepted(lo_in) and not accepted(hi_out); hi_out = n + 1 is a sentinel.
    lo_in, hi_out = k_min.copy(), nn + 1
    top_ok = accepted(nn, nn)
    lo_in[top_ok] = nn[top_ok]
    hi_out[top_ok] = nn[top_ok] + 1
    while True:
        open_ = hi_out - lo_in > 1
        if not open_.any():
            break
        mid = (lo_in + hi_out) // 2
        ok = accepted(mid, nn)
        lo_in = np.where(open_ & ok, mid, lo_in)
        hi_out = np.where(open_ & ~ok, mid, hi_out)
    k_hi = lo_in
    # Lower side: mirror; lo_out = -1 is a sentinel.
    hi_in, lo_out = k_min.copy(), np.full(nn.shape, -1, dtype=np.int64)
    bottom_ok = accepted(np.zeros_like(nn), nn)
    hi_in[bottom_ok] = 0
    while True:
        open_ = hi_in - lo_out > 1
        if not open_.any():
            break
        mid = (lo_out + hi_in) // 2
        ok = accepted(mid, nn)
        hi_in = np.where(open_ & ok, mid, hi_in)
        lo_out = np.where(open_ & ~ok, mid, lo_out)
    return hi_in.reshape(shape), (k_hi + 1).reshape(shape)


def _rank_pair(n: int, q: float, alpha: float, prior: tuple[float, float]) -> tuple[int, int]:
    lo, hi = quantile_cs_ranks(np.array([n], dtype=np.int64), q, alpha, prior)
    return int(lo[0]), int(hi[0])


def quantile_interval_from_order_stats(
    n: int,
    q: float,
    values_by_rank: dict[int, float],
    alpha: float = DEFAULT_ALPHA,
    prior: tuple[float, float] = DEFAULT_PRIOR,
) -> SequentialInterval:
    """The sequence from order statistics fetched at ``quantile_cs_ranks`` (and the nearest rank
    ceil(q n) for the estimate), e.g. by arrayElement(arraySort(groupArray(x)), rank)."""
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise ValueError(f"quantile_interval_from_order_stats: n must be an integer >= 0, got {n!r}")
    _check_q(q, "quantile_interval_from_order_stats")
    check_alpha(alpha, "quantile_interval_from_order_stats")
    if n == 0:
        return SequentialInterval(None, None, None, alpha, QUANTILE_METHOD)
    lo_r, hi_r = _rank_pair(int(n), q, alpha, prior)
    want = [quantile_rank(int(n), q)] + [r for r in (lo_r, hi_r) if 1 <= r <= n]
    missing = [r for r in want if r not in values_by_rank]
    if missing:
        raise ValueError(
            f"quantile_interval_from_order_stats: ranks {missing} needed at n={n} were not fetched; "
            "fetch the ranks quantile_cs_ranks gives, and ceil(q n)"
        )
    est = float(values_by_rank[want[0]])
    lo = float(values_by_rank[lo_r]) if lo_r >= 1 else -math.inf
    hi = float(values_by_rank[hi_r]) if hi_r <= n else math.inf
    return SequentialInterval(est, finite_or_none(lo), finite_or_none(hi), alpha, QUANTILE_METHOD)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class SortedLatencies:
    """Exact order statistics from all of an arm's values (tests, small arms)."""

    values: np.ndarray

    def __post_init__(self) -> None:
        arr = np.sort(np.asarray(self.values, dtype=float).ravel())
        if np.isnan(arr).any():
            raise ValueError("SortedLatencies: values contain NaN (count failed requests separately)")
        object.__setattr__(self, "values", arr)

    @property
    def n(self) -> int:
        return int(self.values.size)

    def quantile_interval(
        self, q: float, alpha: float = DEFAULT_ALPHA, prior: tuple[float, float] = DEFAULT_PRIOR
    ) -> SequentialInterval:
        _check_q(q, "SortedLatencies.quantile_interval")
        check_alpha(alpha, "SortedLatencies.quantile_interval")
        if self.n == 0:
            return SequentialInterval(None, None, None, alpha, QUANTILE_METHOD)
        ranks = {quantile_rank(self.n, q), *_rank_pair(self.n, q, alpha, prior)}
        values = {r: float(self.values[r - 1]) for r in ranks if 1 <= r <= self.n}
        return quantile_interval_from_order_stats(self.n, q, values, alpha, prior)


def histogram_bounds(
    cum_counts: np.ndarray,
    edges: np.ndarray,
    q: float,
    alpha: float = DEFAULT_ALPHA,
    prior: tuple[float, float] = DEFAULT_PRIOR,
) -> tuple[np.ndarray, np.ndarray]:
    """Vectorized (lo, hi) of the sequence from cumulative bucket counts, shape (..., len(edges) + 1).

    Bucket 0 holds values equal to edges[0] (the smallest allowed), bucket j in 1..m-1 holds
    (edges[j-1], edges[j]], the last one (edges[-1], inf). See ``order_statistic_bounds``.
    """
    cum = np.asarray(cum_counts)
    lo_r, hi_r = quantile_cs_ranks(cum[..., -1], q, alpha, prior)
    return order_statistic_bounds(cum, edges, lo_r, hi_r)


def order_statistic_bounds(
    cum_counts: np.ndarray, edges: np.ndarray, lo_rank: np.ndarray, hi_rank: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(lower edge of the bucket holding X_(lo_rank), upper edge of the bucket holding X_(hi_rank)):
    never inside [X_(lo_rank), X_(hi_rank)]. -inf / inf where a rank is outside 1..n or the order
    statistic is in the overflow bucket. Any ranks: the sequence's, or a fixed-horizon CI's."""
    cum = np.asarray(cum_counts)
    e = np.asarray(edges, dtype=float)
    if cum.shape[-1] != e.size + 1:
        raise ValueError(
            f"order_statistic_bounds: {cum.shape[-1]} buckets for {e.size} edges (want edges + 1)"
        )
    n = cum[..., -1]
    lo_r, hi_r = np.broadcast_to(lo_rank, n.shape), np.broadcast_to(hi_rank, n.shape)
    lower_edge = np.concatenate([[e[0]], e])  # lower edge of bucket j
    upper_edge = np.concatenate([e, [np.inf]])
    flat = cum.reshape(-1, cum.shape[-1])

    def bucket_of(rank: np.ndarray) -> np.ndarray:
        # First bucket whose cumulative count reaches the rank (rows with n = 0 give 0, unused).
        return np.argmax(flat >= rank.reshape(-1, 1), axis=1).reshape(n.shape)

    bl = bucket_of(np.maximum(lo_r, 1))
    bh = bucket_of(np.minimum(hi_r, np.maximum(n, 1)))
    lo = np.where(lo_r >= 1, lower_edge[bl], -np.inf)
    hi = np.where(hi_r <= n, upper_edge[bh], np.inf)
    return lo, hi


def latency_edges(max_ms: float = 60_000.0, step_ms: float = 1.0) -> np.ndarray:
    """Bucket edges 0, step, 2 step, ..., max_ms (values above max_ms land in the overflow)."""
    if not (step_ms > 0 and max_ms > step_ms and math.isfinite(max_ms)):
        raise ValueError(f"latency_edges: need 0 < step_ms < max_ms, got {step_ms}, {max_ms}")
    return np.arange(0.0, max_ms + step_ms / 2, step_ms)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class LatencyHistogram:
    """Streaming counts of one arm's latencies on fixed edges: O(buckets) state, O(batch) update.

    Immutable: ``update`` returns the next histogram. Failed requests have no latency; pass
    them as ``failed`` to count them in the overflow bucket (as slower than anything), or leave
    them to the error-rate guardrail. Values below edges[0] are refused.
    """

    edges: np.ndarray
    counts: np.ndarray | None = None

    def __post_init__(self) -> None:
        e = np.asarray(self.edges, dtype=float).ravel()
        if e.size < 1 or not np.isfinite(e).all() or (np.diff(e) <= 0).any():
            raise ValueError("LatencyHistogram: edges must be finite and strictly increasing")
        counts = np.zeros(e.size + 1, dtype=np.int64) if self.counts is None else np.asarray(self.counts)
        if counts.shape != (e.size + 1,) or not np.issubdtype(counts.dtype, np.integer) or (counts < 0).any():
            raise ValueError(
                f"LatencyHistogram: counts must be {e.size + 1} integers >= 0 (edges + overflow)"
            )
        e.flags.writeable = False
        counts = counts.astype(np.int64, copy=True)
        counts.flags.writeable = False
        object.__setattr__(self, "edges", e)
        object.__setattr__(self, "counts", counts)

    @property
    def n(self) -> int:
        assert self.counts is not None
        return int(self.counts.sum())

    def update(self, values: np.ndarray | Sequence[float], failed: int = 0) -> LatencyHistogram:
        v = np.asarray(values, dtype=float).ravel()
        if np.isnan(v).any():
            raise ValueError("LatencyHistogram.update: values contain NaN; pass failed requests as failed=")
        if (v < self.edges[0]).any():
            raise ValueError(f"LatencyHistogram.update: values below the first edge {self.edges[0]}")
        if isinstance(failed, bool) or not isinstance(failed, int | np.integer) or failed < 0:
            raise ValueError(f"LatencyHistogram.update: failed must be an integer >= 0, got {failed!r}")
        add = np.bincount(np.searchsorted(self.edges, v, side="left"), minlength=self.edges.size + 1)
        add[-1] += failed
        assert self.counts is not None
        return LatencyHistogram(self.edges, self.counts + add)

    def quantile_interval(
        self, q: float, alpha: float = DEFAULT_ALPHA, prior: tuple[float, float] = DEFAULT_PRIOR
    ) -> SequentialInterval:
        """Bounds at bucket resolution; the estimate is the upper edge of the bucket holding the
        nearest rank ceil(q n) (None in the overflow bucket)."""
        _check_q(q, "LatencyHistogram.quantile_interval")
        check_alpha(alpha, "LatencyHistogram.quantile_interval")
        n = self.n
        if n == 0:
            return SequentialInterval(None, None, None, alpha, HISTOGRAM_METHOD)
        assert self.counts is not None
        cum = np.cumsum(self.counts)
        lo, hi = histogram_bounds(cum[None, :], self.edges, q, alpha, prior)
        j = int(np.searchsorted(cum, quantile_rank(n, q), side="left"))
        est = float(self.edges[j]) if j < self.edges.size else math.inf
        return SequentialInterval(
            finite_or_none(est), finite_or_none(lo[0]), finite_or_none(hi[0]), alpha, HISTOGRAM_METHOD
        )


def quantile_difference_interval(
    control: SequentialInterval, candidate: SequentialInterval
) -> SequentialInterval:
    """Candidate - control quantile from per-arm sequences each computed at alpha/2.

    With probability >= 1 - alpha both arms' sequences hold at every look (Bonferroni), and then
    the difference of the true quantiles is in [lo_v - hi_c, hi_v - lo_c] at every look.
    Pass the arms' ``quantile_interval(q, alpha / 2)``; the result's alpha is the sum.
    """
    if not math.isclose(control.alpha, candidate.alpha):
        raise ValueError(
            f"quantile_difference_interval: arms at different alpha ({control.alpha}, {candidate.alpha})"
        )
    est = None
    if control.estimate is not None and candidate.estimate is not None:
        est = candidate.estimate - control.estimate
    lo = None if candidate.lo is None or control.hi is None else candidate.lo - control.hi
    hi = None if candidate.hi is None or control.lo is None else candidate.hi - control.lo
    return SequentialInterval(est, lo, hi, control.alpha + candidate.alpha, DIFFERENCE_METHOD)
