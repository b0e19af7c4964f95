"""Quantiles: one convention, the exact order statistic, and distribution-free CIs.

A quantile is the smallest sample value whose empirical CDF reaches q: the order statistic
x_(ceil(q * n)) (nearest rank, numpy ``method="inverted_cdf"``), so "p99 <= threshold" means
exactly "at least 99% of requests took <= threshold". ``nearest_rank`` computes it from a sorted
list; the report fetches the order statistics at ranks planned here (``quantile_plan`` /
``ranks_to_fetch``) with ``arrayElement(arraySort(groupArray(x)), rank)``.

Imports only the standard library at module level: replay and streaming import
``nearest_rank``; numpy and scipy are imported inside the functions that need them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from typing import TYPE_CHECKING

from stats._common import DEFAULT_CONF, AsDict, check_conf, clean_samples

if TYPE_CHECKING:
    import numpy as np

REPORT_QUANTILES: tuple[float, ...] = (0.5, 0.9, 0.99, 0.999)


def _as_fraction(q: float) -> Fraction:
    # repr() round-trips 0.999 as "0.999", so ceil(q * n) is exact for decimal-entered q
    # (0.999 * 1000 in floats is 999.0000000000001, which would pick the wrong rank).
    return Fraction(repr(float(q)))


def _check_q(q: float, where: str) -> None:
    if not (isinstance(q, float | int) and 0.0 < q < 1.0):
        raise ValueError(f"{where}: quantile q must be strictly between 0 and 1, got {q!r}")


def quantile_rank(n: int, q: float) -> int:
    """1-based rank of the exact q-quantile among n sorted samples: ceil(q * n)."""
    _check_q(q, "quantile_rank")
    if n < 1:
        raise ValueError(f"quantile_rank: n must be >= 1, got {n}")
    return _rank(n, float(q))


@functools.lru_cache(maxsize=8192)
def _rank(n: int, q: float) -> int:
    # Pure in (n, q), and asked again and again for the same few: every streamed request's ITL
    # p50 and p99 (streaming.timing) at its own gap count. The exact Fraction arithmetic costs
    # microseconds per call, a visible share of the replay's CPU per request (bench/RESULTS.md,
    # "Replay CPU per token against vLLM's client").
    return max(1, min(n, math.ceil(_as_fraction(q) * n)))


def nearest_rank(sorted_values: Sequence[float], q: float) -> float:
    """The exact q-quantile of ascending ``sorted_values``: x_(ceil(q * n)) (1-based rank).

    q must be strictly between 0 and 1; an empty sequence raises ValueError. The caller sorts:
    this function only indexes, so it costs O(1) per quantile.
    """
    n = len(sorted_values)
    if n == 0:
        raise ValueError("nearest_rank: no values")
    _check_q(q, "nearest_rank")
    return sorted_values[quantile_rank(n, q) - 1]


def quantile_ci_ranks(n: int, q: float, conf: float = DEFAULT_CONF) -> tuple[int, int] | None:
    """1-based ranks (lo, hi) with P(X_(lo) <= xi_q <= X_(hi)) >= conf, or None if n is too small.

    The number of samples below the true quantile is Binomial(n, q), so for continuous data
    P(X_(l) <= xi_q < X_(u)) = B(u-1) - B(l-1) with B the binomial CDF. Equal tails:
    l is the largest rank with B(l-1) <= alpha/2, u the smallest with B(u-1) >= 1 - alpha/2.
    Distribution-free; with ties the coverage only goes up (closed interval).
    """
    _check_q(q, "quantile_ci_ranks")
    check_conf(conf, "quantile_ci_ranks")
    if n < 1:
        return None
    return _quantile_ci_ranks(n, q, conf)


@functools.lru_cache(maxsize=4096)
def _quantile_ci_ranks(n: int, q: float, conf: float) -> tuple[int, int] | None:
    # Pure in (n, q, conf), and a report asks for the same arm's n for every metric, for the
    # ranks to fetch and again for the estimates. The unfrozen binom methods: freezing
    # sps.binom(n, q) builds a distribution instance (docstrings and all), ~0.5 ms each.
    from scipy import stats as sps

    tail = (1.0 - conf) / 2.0
    binom = sps.binom
    # ppf is float-based; nudge by exact cdf checks so the tail conditions hold exactly.
    k = int(binom.ppf(tail, n, q))
    while k >= 0 and binom.cdf(k, n, q) > tail:
        k -= 1
    while binom.cdf(k + 1, n, q) <= tail:
        k += 1
    lo = k + 1  # B(lo - 1) = B(k) <= tail
    m = int(binom.ppf(1.0 - tail, n, q))
    while m > 0 and binom.cdf(m - 1, n, q) >= 1.0 - tail:
        m -= 1
    while binom.cdf(m, n, q) < 1.0 - tail:
        m += 1
    hi = m + 1  # smallest u with B(u - 1) >= 1 - tail
    if lo < 1 or hi > n:
        return None
    return lo, hi


def min_n_for_quantile_ci(q: float, conf: float = DEFAULT_CONF) -> int:
    """Smallest n for which quantile_ci_ranks(n, q, conf) exists (both bounds finite)."""
    _check_q(q, "min_n_for_quantile_ci")
    check_conf(conf, "min_n_for_quantile_ci")
    tail = (1.0 - conf) / 2.0
    # Upper bound needs q^n <= tail, lower bound needs (1-q)^n <= tail; start there, then
    # confirm with the exact rank search (discreteness can need one or two more samples).
    n = max(1, math.ceil(math.log(tail) / math.log(max(q, 1 - q))))
    while quantile_ci_ranks(n, q, conf) is None:
        n += 1
    return n


@dataclasses.dataclass(frozen=True, slots=True)
class QuantilePlan(AsDict):
    """Which order statistics to fetch for one quantile."""

    q: float
    n: int
    rank: int | None  # None when n == 0
    lo_rank: int | None  # None when n is too small for a CI at this quantile
    hi_rank: int | None
    coverage: float | None  # exact binomial coverage of [X_(lo), X_(hi)]
    note: str  # "" or why there is no CI


def quantile_plan(n: int, q: float, conf: float = DEFAULT_CONF) -> QuantilePlan:
    _check_q(q, "quantile_plan")
    if n < 1:
        return QuantilePlan(q, n, None, None, None, None, "no samples")
    ranks = quantile_ci_ranks(n, q, conf)
    if ranks is None:
        need = min_n_for_quantile_ci(q, conf)
        note = (
            f"n={n} is too small for a {conf * 100:g}% CI at {quantile_label(q)}: "
            f"needs at least {need} samples"
        )
        return QuantilePlan(q, n, quantile_rank(n, q), None, None, None, note)
    from scipy import stats as sps

    lo, hi = ranks
    coverage = float(sps.binom.cdf(hi - 1, n, q) - sps.binom.cdf(lo - 1, n, q))
    return QuantilePlan(q, n, quantile_rank(n, q), lo, hi, coverage, "")


def ranks_to_fetch(n: int, qs: Iterable[float] = REPORT_QUANTILES, conf: float = DEFAULT_CONF) -> list[int]:
    """Sorted unique 1-based ranks to pull from ClickHouse for all quantiles in one query."""
    ranks: set[int] = set()
    for q in qs:
        plan = quantile_plan(n, q, conf)
        ranks.update(r for r in (plan.rank, plan.lo_rank, plan.hi_rank) if r is not None)
    return sorted(ranks)


@dataclasses.dataclass(frozen=True, slots=True)
class QuantileEstimate(AsDict):
    q: float
    label: str  # "p50", "p99.9"
    n: int
    value: float | None
    lo: float | None
    hi: float | None
    coverage: float | None
    note: str


def quantile_label(q: float) -> str:
    return "p" + f"{float(_as_fraction(q) * 100):g}"


def quantile_from_order_stats(
    n: int, q: float, values_by_rank: Mapping[int, float], conf: float = DEFAULT_CONF
) -> QuantileEstimate:
    """Build the estimate from order statistics fetched at ``quantile_plan`` ranks."""
    plan = quantile_plan(n, q, conf)

    def at(rank: int | None) -> float | None:
        if rank is None:
            return None
        if rank not in values_by_rank:
            raise ValueError(
                f"quantile_from_order_stats: rank {rank} needed for {quantile_label(q)} "
                f"(n={n}) was not fetched; fetch ranks_to_fetch(n, ...)"
            )
        return float(values_by_rank[rank])

    value, lo, hi = at(plan.rank), at(plan.lo_rank), at(plan.hi_rank)
    if lo is not None and hi is not None and value is not None and not lo <= value <= hi:
        raise ValueError(
            f"quantile_from_order_stats: values are not sorted by rank for {quantile_label(q)}: "
            f"X_({plan.lo_rank})={lo}, X_({plan.rank})={value}, X_({plan.hi_rank})={hi}"
        )
    return QuantileEstimate(q, quantile_label(q), n, value, lo, hi, plan.coverage, plan.note)


def quantile_estimate(
    samples: np.ndarray | Sequence[float], q: float, conf: float = DEFAULT_CONF
) -> QuantileEstimate:
    import numpy as np

    arr = np.sort(clean_samples(samples, "quantile_estimate"))
    plan = quantile_plan(arr.size, q, conf)
    ranks = [r for r in (plan.rank, plan.lo_rank, plan.hi_rank) if r is not None]
    return quantile_from_order_stats(arr.size, q, {r: arr[r - 1] for r in ranks}, conf)


def percentile_table(
    samples: np.ndarray | Sequence[float],
    qs: Iterable[float] = REPORT_QUANTILES,
    conf: float = DEFAULT_CONF,
) -> list[QuantileEstimate]:
    import numpy as np

    arr = np.sort(clean_samples(samples, "percentile_table"))
    out = []
    for q in qs:
        plan = quantile_plan(arr.size, q, conf)
        ranks = [r for r in (plan.rank, plan.lo_rank, plan.hi_rank) if r is not None]
        values = {r: float(arr[r - 1]) for r in ranks}
        out.append(quantile_from_order_stats(arr.size, q, values, conf))
    return out
