"""Statistics for the SLA report: pure numpy/scipy, no Django, no ClickHouse.

The API is shaped around what ClickHouse returns, so only aggregates travel to Python:
- proportions take counts (``count()``, ``countIf(<meets every SLO>)``);
- quantiles take the order statistics at ranks computed here (``quantile_plan`` /
  ``ranks_to_fetch``), fetched with ``arrayElement(arraySort(groupArray(x)), rank)``;
  a numpy convenience (``quantile_estimate``) does the same from a raw array;
- the rank test takes either raw arrays or counts per distinct (rounded) value.

Conventions: differences are ``variant - control``; a quantile is the smallest sample value
whose empirical CDF reaches q (rank ``ceil(q * n)``, numpy ``method="inverted_cdf"``), so
"p99 <= threshold" means exactly "at least 99% of requests took <= threshold".
Every result is a frozen dataclass with ``as_dict()`` giving JSON-safe values (no NaN).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any, overload

import numpy as np
from scipy import special
from scipy import stats as sps

DEFAULT_CONF = 0.95
SRM_ALPHA = 0.001
REPORT_QUANTILES: tuple[float, ...] = (0.5, 0.9, 0.99, 0.999)
# Below these expected counts the normal approximation of the two-proportion test is poor.
_MIN_EXPECTED_FOR_Z = 5.0


def _asdict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)


def _check_conf(conf: float, where: str) -> None:
    if not (isinstance(conf, float | int) and 0.0 < conf < 1.0):
        raise ValueError(f"{where}: conf must be strictly between 0 and 1, got {conf!r}")


def _check_counts(hits: int, n: int, where: str) -> None:
    for name, value in (("hits", hits), ("n", n)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise TypeError(f"{where}: {name} must be an integer count, got {value!r}")
        if value < 0:
            raise ValueError(f"{where}: {name} must be >= 0, got {value}")
    if hits > n:
        raise ValueError(f"{where}: hits ({hits}) cannot exceed n ({n})")


@functools.lru_cache(maxsize=64)
def _z(conf: float) -> float:
    return float(sps.norm.ppf(0.5 + conf / 2.0))


# ---------------------------------------------------------------------------------------------
# Proportions: Wilson interval, SLA attainment, goodput


@dataclasses.dataclass(frozen=True, slots=True)
class Interval:
    estimate: float
    lo: float
    hi: float
    conf: float

    def as_dict(self) -> dict[str, Any]:
        return _asdict(self)


def wilson_interval(hits: int, n: int, conf: float = DEFAULT_CONF) -> Interval:
    _check_counts(hits, n, "wilson_interval")
    _check_conf(conf, "wilson_interval")
    if n == 0:
        raise ValueError("wilson_interval: n is 0, a proportion needs at least one sample")
    z = _z(conf)
    p = hits / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # Clamp float fuzz so the interval always contains the estimate and stays in [0, 1].
    return Interval(p, max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half)), conf)


def wilson_bounds(
    hits: np.ndarray | Sequence[int],
    n: np.ndarray | Sequence[int],
    conf: float = DEFAULT_CONF,
) -> tuple[np.ndarray, np.ndarray]:
    """Vectorized Wilson (lo, hi) for many cells at once (segment heatmaps, simulations)."""
    _check_conf(conf, "wilson_bounds")
    h = np.asarray(hits, dtype=float)
    m = np.asarray(n, dtype=float)
    if (m <= 0).any() or (h < 0).any() or (h > m).any():
        raise ValueError("wilson_bounds: need n > 0 and 0 <= hits <= n in every cell")
    z = _z(conf)
    p = h / m
    denom = 1.0 + z * z / m
    centre = (p + z * z / (2 * m)) / denom
    half = z * np.sqrt(p * (1 - p) / m + z * z / (4 * m * m)) / denom
    return np.clip(np.minimum(p, centre - half), 0, 1), np.clip(np.maximum(p, centre + half), 0, 1)


@dataclasses.dataclass(frozen=True, slots=True)
class Attainment:
    n: int
    hits: int
    errors: int
    error_rate: float
    attainment: Interval
    goodput_rps: float | None  # requests per second meeting every SLO; None without a window

    def as_dict(self) -> dict[str, Any]:
        return _asdict(self)


def sla_attainment(
    n: int,
    hits: int,
    errors: int = 0,
    window_s: float | None = None,
    conf: float = DEFAULT_CONF,
) -> Attainment:
    """``hits`` must already count errors as misses: countIf(outcome = 'ok' AND every SLO)."""
    _check_counts(hits, n, "sla_attainment")
    _check_counts(errors, n, "sla_attainment(errors)")
    if hits + errors > n:
        raise ValueError(
            f"sla_attainment: hits ({hits}) + errors ({errors}) exceed n ({n}); "
            "errors must count as misses, so a request cannot be both"
        )
    if window_s is not None and not (window_s > 0 and math.isfinite(window_s)):
        raise ValueError(f"sla_attainment: window_s must be a positive number, got {window_s!r}")
    return Attainment(
        n=int(n),
        hits=int(hits),
        errors=int(errors),
        error_rate=errors / n if n else 0.0,
        attainment=wilson_interval(hits, n, conf),
        goodput_rps=hits / window_s if window_s is not None else None,
    )


def meets_slos(ok: np.ndarray, metrics: Mapping[str, np.ndarray], slos_ms: Mapping[str, float]) -> np.ndarray:
    """Per-request "meets every SLO" from raw arrays; the reference for the ClickHouse countIf.

    A failed request, or a metric that never happened (NaN), is a miss.
    """
    ok = np.asarray(ok, dtype=bool)
    hit = ok.copy()
    for name, limit in slos_ms.items():
        if name not in metrics:
            raise ValueError(f"meets_slos: SLO on {name!r} but no such metric array was given")
        values = np.asarray(metrics[name], dtype=float)
        if values.shape != ok.shape:
            raise ValueError(
                f"meets_slos: metric {name!r} has shape {values.shape}, outcomes have {ok.shape}"
            )
        with np.errstate(invalid="ignore"):
            hit &= values <= limit  # NaN <= x is False: missing phase = miss
    return hit


# ---------------------------------------------------------------------------------------------
# Quantiles: exact point estimate and distribution-free CI from order statistics


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
    return max(1, min(n, math.ceil(_as_fraction(q) * n)))


def quantile_ci_ranks(n: int, q: float, conf: float = DEFAULT_CONF) -> tuple[int, int] | None:
    """1-based ranks (lo, hi) with P(X_(lo) <= xi_q <= X_(hi)) >= conf, or None if n is too small.

    The number of samples below the true quantile is Binomial(n, q), so for continuous data
    P(X_(l) <= xi_q < X_(u)) = B(u-1) - B(l-1) with B the binomial CDF. Equal tails:
    l is the largest rank with B(l-1) <= alpha/2, u the smallest with B(u-1) >= 1 - alpha/2.
    Distribution-free; with ties the coverage only goes up (closed interval).
    """
    _check_q(q, "quantile_ci_ranks")
    _check_conf(conf, "quantile_ci_ranks")
    if n < 1:
        return None
    return _quantile_ci_ranks(n, q, conf)


@functools.lru_cache(maxsize=4096)
def _quantile_ci_ranks(n: int, q: float, conf: float) -> tuple[int, int] | None:
    # Pure in (n, q, conf), and a report asks for the same arm's n for every metric, for the
    # ranks to fetch and again for the estimates. The unfrozen binom methods: freezing
    # sps.binom(n, q) builds a distribution instance (docstrings and all), ~0.5 ms each.
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
    _check_conf(conf, "min_n_for_quantile_ci")
    tail = (1.0 - conf) / 2.0
    # Upper bound needs q^n <= tail, lower bound needs (1-q)^n <= tail; start there, then
    # confirm with the exact rank search (discreteness can need one or two more samples).
    n = max(1, math.ceil(math.log(tail) / math.log(max(q, 1 - q))))
    while quantile_ci_ranks(n, q, conf) is None:
        n += 1
    return n


@dataclasses.dataclass(frozen=True, slots=True)
class QuantilePlan:
    """Which order statistics to fetch for one quantile."""

    q: float
    n: int
    rank: int | None  # None when n == 0
    lo_rank: int | None  # None when n is too small for a CI at this quantile
    hi_rank: int | None
    coverage: float | None  # exact binomial coverage of [X_(lo), X_(hi)]
    note: str  # "" or why there is no CI

    def as_dict(self) -> dict[str, Any]:
        return _asdict(self)


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
class QuantileEstimate:
    q: float
    label: str  # "p50", "p99.9"
    n: int
    value: float | None
    lo: float | None
    hi: float | None
    coverage: float | None
    note: str

    def as_dict(self) -> dict[str, Any]:
        return _asdict(self)


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


def _clean_samples(samples: np.ndarray | Sequence[float], where: str) -> np.ndarray:
    arr = np.asarray(samples, dtype=float).ravel()
    if np.isnan(arr).any():
        raise ValueError(
            f"{where}: samples contain NaN; drop requests without this metric first "
            "(they are SLA misses, not latencies)"
        )
    return arr


def quantile_estimate(
    samples: np.ndarray | Sequence[float], q: float, conf: float = DEFAULT_CONF
) -> QuantileEstimate:
    arr = np.sort(_clean_samples(samples, "quantile_estimate"))
    plan = quantile_plan(arr.size, q, conf)
    ranks = [r for r in (plan.rank, plan.lo_rank, plan.hi_rank) if r is not None]
    return quantile_from_order_stats(arr.size, q, {r: arr[r - 1] for r in ranks}, conf)


def percentile_table(
    samples: np.ndarray | Sequence[float],
    qs: Iterable[float] = REPORT_QUANTILES,
    conf: float = DEFAULT_CONF,
) -> list[QuantileEstimate]:
    arr = np.sort(_clean_samples(samples, "percentile_table"))
    out = []
    for q in qs:
        plan = quantile_plan(arr.size, q, conf)
        ranks = [r for r in (plan.rank, plan.lo_rank, plan.hi_rank) if r is not None]
        values = {r: float(arr[r - 1]) for r in ranks}
        out.append(quantile_from_order_stats(arr.size, q, values, conf))
    return out


# ---------------------------------------------------------------------------------------------
# Variant vs control


@dataclasses.dataclass(frozen=True, slots=True)
class Difference:
    estimate: float  # variant - control
    lo: float | None
    hi: float | None
    conf: float
    p_value: float | None
    method: str

    def as_dict(self) -> dict[str, Any]:
        return _asdict(self)


def attainment_difference(
    control_hits: int,
    control_n: int,
    variant_hits: int,
    variant_n: int,
    conf: float = DEFAULT_CONF,
) -> Difference:
    """Variant minus control attainment.

    CI: Newcombe's hybrid score interval (method 10, 1998) built from the two Wilson intervals;
    good coverage down to small n and never outside [-1, 1].
    p-value: pooled two-proportion z test when every expected 2x2 cell count is >= 5, else
    Fisher's exact test. The CI and p-value come from different constructions, so at the
    margin one can exclude 0 while the other is just above alpha; the report uses the
    (Holm-adjusted) p-value for significance.
    """
    _check_counts(control_hits, control_n, "attainment_difference(control)")
    _check_counts(variant_hits, variant_n, "attainment_difference(variant)")
    if control_n == 0 or variant_n == 0:
        raise ValueError(
            f"attainment_difference: both arms need samples (control n={control_n}, variant n={variant_n})"
        )
    wc = wilson_interval(control_hits, control_n, conf)
    wv = wilson_interval(variant_hits, variant_n, conf)
    d = wv.estimate - wc.estimate
    lo = d - math.sqrt((wv.estimate - wv.lo) ** 2 + (wc.hi - wc.estimate) ** 2)
    hi = d + math.sqrt((wv.hi - wv.estimate) ** 2 + (wc.estimate - wc.lo) ** 2)

    n = control_n + variant_n
    hits = control_hits + variant_hits
    expected = [
        control_n * hits / n,
        control_n * (n - hits) / n,
        variant_n * hits / n,
        variant_n * (n - hits) / n,
    ]
    if min(expected) >= _MIN_EXPECTED_FOR_Z:
        pooled = hits / n
        se = math.sqrt(pooled * (1 - pooled) * (1 / control_n + 1 / variant_n))
        p_value = float(2 * sps.norm.sf(abs(d) / se)) if se > 0 else 1.0
        method = "newcombe-wilson CI; pooled two-proportion z test"
    else:
        table = [
            [variant_hits, variant_n - variant_hits],
            [control_hits, control_n - control_hits],
        ]
        p_value = float(sps.fisher_exact(table).pvalue)
        method = "newcombe-wilson CI; Fisher exact test (small expected counts)"
    return Difference(d, max(-1.0, min(d, lo)), min(1.0, max(d, hi)), conf, p_value, method)


def quantile_difference_from_order_stats(
    control: QuantileEstimate, variant: QuantileEstimate, conf: float = DEFAULT_CONF
) -> Difference:
    """Difference of two quantiles with a distribution-free, conservative CI.

    Built from per-arm order-statistic intervals at level 1 - alpha/2 each (pass estimates
    computed with ``conf=quantile_difference_conf(conf)``): by Bonferroni both cover with
    probability >= 1 - alpha whatever the dependence between the arms, so the difference
    interval [v.lo - c.hi, v.hi - c.lo] covers with probability >= conf. Valid in mirror mode
    too (paired arms). Needs only 4 order statistics per pair from ClickHouse; no bootstrap.
    """
    want = quantile_difference_conf(conf)
    if control.q != variant.q:
        raise ValueError(
            f"quantile_difference: quantiles differ (control {control.label}, variant {variant.label})"
        )
    if control.value is None or variant.value is None:
        raise ValueError("quantile_difference: an arm has no samples")
    est = variant.value - control.value
    for arm, e in (("control", control), ("variant", variant)):
        if e.coverage is not None and e.coverage + 1e-12 < want:
            raise ValueError(
                f"quantile_difference: {arm} CI has coverage {e.coverage:.4f}; compute both arms "
                f"with conf={want} (quantile_difference_conf({conf}))"
            )
    if None in (control.lo, control.hi, variant.lo, variant.hi):
        return Difference(
            est,
            None,
            None,
            conf,
            None,
            "order-statistic Bonferroni CI unavailable: "
            + (variant.note or control.note or "too few samples"),
        )
    assert control.lo is not None and control.hi is not None
    assert variant.lo is not None and variant.hi is not None
    return Difference(
        est,
        variant.lo - control.hi,
        variant.hi - control.lo,
        conf,
        None,
        "order-statistic CIs at 1-alpha/2 per arm combined (Bonferroni, conservative)",
    )


def quantile_difference_conf(conf: float = DEFAULT_CONF) -> float:
    _check_conf(conf, "quantile_difference_conf")
    return 1.0 - (1.0 - conf) / 2.0


def quantile_difference(
    control: np.ndarray | Sequence[float],
    variant: np.ndarray | Sequence[float],
    q: float = 0.99,
    conf: float = DEFAULT_CONF,
) -> Difference:
    arm_conf = quantile_difference_conf(conf)
    return quantile_difference_from_order_stats(
        quantile_estimate(control, q, arm_conf),
        quantile_estimate(variant, q, arm_conf),
        conf,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class RankTest:
    statistic: float  # U of the variant
    p_value: float
    prob_variant_greater: float  # P(V > C) + 0.5 P(V = C), the common-language effect size
    n_control: int
    n_variant: int
    method: str

    def as_dict(self) -> dict[str, Any]:
        return _asdict(self)


def mann_whitney(control: np.ndarray | Sequence[float], variant: np.ndarray | Sequence[float]) -> RankTest:
    c = _clean_samples(control, "mann_whitney(control)")
    v = _clean_samples(variant, "mann_whitney(variant)")
    if c.size == 0 or v.size == 0:
        raise ValueError(f"mann_whitney: both arms need samples (control {c.size}, variant {v.size})")
    res = sps.mannwhitneyu(v, c, alternative="two-sided", method="auto")
    u = float(res.statistic)
    return RankTest(
        u,
        float(res.pvalue),
        u / (c.size * v.size),
        int(c.size),
        int(v.size),
        "scipy mannwhitneyu",
    )


def mann_whitney_from_counts(
    values: np.ndarray | Sequence[float],
    control_counts: np.ndarray | Sequence[int],
    variant_counts: np.ndarray | Sequence[int],
) -> RankTest:
    """Mann-Whitney U from counts per distinct value (ClickHouse: GROUP BY round(ttft_ms, 1)).

    Exact U for data at that resolution; normal approximation with tie correction and
    continuity correction (what scipy does with method="asymptotic"). Only aggregates travel.
    """
    vals = np.asarray(values, dtype=float)
    cc = np.asarray(control_counts, dtype=np.int64)
    vc = np.asarray(variant_counts, dtype=np.int64)
    if not (vals.shape == cc.shape == vc.shape) or vals.ndim != 1:
        raise ValueError(
            f"mann_whitney_from_counts: values {vals.shape}, control_counts {cc.shape} and "
            f"variant_counts {vc.shape} must be 1-d and the same length"
        )
    if (cc < 0).any() or (vc < 0).any():
        raise ValueError("mann_whitney_from_counts: counts must be >= 0")
    order = np.argsort(vals, kind="stable")
    vals, cc, vc = vals[order], cc[order], vc[order]
    if vals.size > 1 and (np.diff(vals) == 0).any():
        raise ValueError("mann_whitney_from_counts: values must be distinct (one row per value)")
    n1, n2 = int(vc.sum()), int(cc.sum())
    if n1 == 0 or n2 == 0:
        raise ValueError(f"mann_whitney_from_counts: both arms need samples ({n2}, {n1})")
    t = (cc + vc).astype(float)
    # Midrank of each tie group: ranks below + (t + 1) / 2.
    midrank = np.cumsum(t) - t + (t + 1.0) / 2.0
    r1 = float((vc * midrank).sum())
    u1 = r1 - n1 * (n1 + 1) / 2.0
    n = n1 + n2
    mu = n1 * n2 / 2.0
    tie = float((t**3 - t).sum())
    sigma = math.sqrt(n1 * n2 / 12.0 * ((n + 1) - tie / (n * (n - 1)))) if n > 1 else 0.0
    if sigma == 0:
        p = 1.0
    else:
        z = (abs(u1 - mu) - 0.5) / sigma
        p = float(min(1.0, 2 * sps.norm.sf(max(z, 0.0))))
    return RankTest(u1, p, u1 / (n1 * n2), n2, n1, "mann-whitney from counts, normal approx")


@overload
def holm_adjust(p_values: Mapping[str, float]) -> dict[str, float]: ...
@overload
def holm_adjust(p_values: Sequence[float]) -> list[float]: ...
def holm_adjust(p_values: Sequence[float] | Mapping[str, float]) -> Any:
    """Holm step-down adjusted p-values (same shape as the input: list or dict)."""
    if isinstance(p_values, Mapping):
        keys = list(p_values)
        adjusted = holm_adjust([p_values[k] for k in keys])
        return dict(zip(keys, adjusted, strict=True))
    ps = np.asarray(p_values, dtype=float)
    if ps.ndim != 1 or np.isnan(ps).any() or (ps < 0).any() or (ps > 1).any():
        raise ValueError(f"holm_adjust: p-values must be numbers in [0, 1], got {list(p_values)}")
    m = ps.size
    order = np.argsort(ps, kind="stable")
    scaled = ps[order] * (m - np.arange(m))
    adj_sorted = np.minimum(1.0, np.maximum.accumulate(scaled))
    out = np.empty(m)
    out[order] = adj_sorted
    return [float(x) for x in out]


# ---------------------------------------------------------------------------------------------
# Mirror mode: paired tests on the same requests


@dataclasses.dataclass(frozen=True, slots=True)
class PairedAttainment:
    n_pairs: int
    control_attainment: float
    variant_attainment: float
    difference: Difference
    discordant_variant_only: int  # variant met the SLA, control missed
    discordant_control_only: int

    def as_dict(self) -> dict[str, Any]:
        return _asdict(self)


def mcnemar_attainment(
    both_hit: int,
    control_only: int,
    variant_only: int,
    both_miss: int,
    conf: float = DEFAULT_CONF,
) -> PairedAttainment:
    """Paired attainment difference: mid-p McNemar p-value + Agresti-Min CI.

    p-value: mid-p binomial test of the discordant pairs (variant_only ~ Bin(b + c, 1/2)):
    the exact conditional test is conservative with few discordant pairs (size ~0.03 at 0.05),
    the mid-p version keeps the size near alpha at every count (Fagerland, Lydersen & Laake,
    2013). CI: Agresti & Min (2005) adjusted Wald for paired proportions (add 0.5 to every
    cell), which has near-nominal coverage.
    """
    cells = (both_hit, control_only, variant_only, both_miss)
    for name, value in zip(("both_hit", "control_only", "variant_only", "both_miss"), cells):
        _check_counts(0, value, f"mcnemar_attainment({name})")
    n = sum(cells)
    if n == 0:
        raise ValueError("mcnemar_attainment: no pairs")
    d = (variant_only - control_only) / n
    p = mcnemar_mid_p(control_only, variant_only)
    b, c = control_only + 0.5, variant_only + 0.5
    nn = n + 2.0
    d_adj = (c - b) / nn
    var = ((b + c) - (c - b) ** 2 / nn) / nn**2
    half = _z(conf) * math.sqrt(max(var, 0.0))
    lo, hi = max(-1.0, min(d, d_adj - half)), min(1.0, max(d, d_adj + half))
    diff = Difference(d, lo, hi, conf, p, "paired: mid-p McNemar test; Agresti-Min CI")
    return PairedAttainment(
        n,
        (both_hit + control_only) / n,
        (both_hit + variant_only) / n,
        diff,
        variant_only,
        control_only,
    )


def mcnemar_mid_p(control_only: int, variant_only: int) -> float:
    """Two-sided mid-p McNemar: 2 * (P(X < k) + P(X = k) / 2), X ~ Bin(b + c, 1/2), k = min."""
    discordant = control_only + variant_only
    if discordant == 0:
        return 1.0
    k = min(control_only, variant_only)
    # scipy.special.bdtr is the binomial CDF without the rv_discrete overhead (~50x faster).
    below = float(special.bdtr(k - 1, discordant, 0.5)) if k > 0 else 0.0
    at = float(special.bdtr(k, discordant, 0.5)) - below
    return min(1.0, 2.0 * (below + 0.5 * at))


@dataclasses.dataclass(frozen=True, slots=True)
class PairedRankTest:
    n_pairs: int
    n_nonzero: int
    median_difference: float  # median of variant - control per request
    statistic: float
    p_value: float
    method: str

    def as_dict(self) -> dict[str, Any]:
        return _asdict(self)


def wilcoxon_paired(
    differences: np.ndarray | Sequence[float],
) -> PairedRankTest:
    """Wilcoxon signed-rank on per-request differences (variant - control TTFT).

    Pass only pairs where both arms produced a TTFT; failed requests are attainment misses,
    compared by ``mcnemar_attainment``. Zero differences are dropped (Wilcoxon's convention).
    """
    d = _clean_samples(differences, "wilcoxon_paired")
    if d.size == 0:
        raise ValueError("wilcoxon_paired: no pairs")
    nonzero = int(np.count_nonzero(d))
    if nonzero == 0:
        return PairedRankTest(int(d.size), 0, 0.0, 0.0, 1.0, "all differences are zero")
    res = sps.wilcoxon(d, zero_method="wilcox", alternative="two-sided")
    return PairedRankTest(
        int(d.size),
        nonzero,
        float(np.median(d)),
        float(res.statistic),
        float(res.pvalue),
        "scipy wilcoxon signed-rank",
    )


# ---------------------------------------------------------------------------------------------
# Sample ratio mismatch


@dataclasses.dataclass(frozen=True, slots=True)
class SrmPart:
    revision: str
    total: int
    observed: dict[str, int]
    expected: dict[str, float]
    chi2: float | None  # None when traffic reached a weight-0 variant (infinite mismatch)
    df: int
    p_value: float
    flagged: bool
    note: str

    def as_dict(self) -> dict[str, Any]:
        return _asdict(self)


@dataclasses.dataclass(frozen=True, slots=True)
class SrmResult:
    flagged: bool
    alpha: float
    combined: SrmPart
    revisions: list[SrmPart]
    message: str

    def as_dict(self) -> dict[str, Any]:
        return _asdict(self)


def _srm_part(
    revision: str, counts: Mapping[str, int], weights: Mapping[str, float], alpha: float
) -> SrmPart:
    where = f"sample_ratio_mismatch(revision {revision!r})"
    unknown = sorted(set(counts) - set(weights))
    if unknown:
        raise ValueError(f"{where}: counts for variants with no weight in force: {unknown}")
    for key, w in weights.items():
        if not (math.isfinite(w) and w >= 0):
            raise ValueError(f"{where}: weight of {key!r} must be a finite number >= 0, got {w}")
    for key, c in counts.items():
        _check_counts(0, c, f"{where} count of {key!r}")
    wsum = sum(weights.values())
    if wsum <= 0:
        raise ValueError(f"{where}: weights sum to 0")
    total = int(sum(counts.get(k, 0) for k in weights))
    observed = {k: int(counts.get(k, 0)) for k in weights}
    expected = {k: total * w / wsum for k, w in weights.items()}
    # A variant at weight 0 that still received traffic is a mismatch by definition.
    leaked = [k for k, w in weights.items() if w == 0 and observed[k] > 0]
    live = [k for k, w in weights.items() if w > 0]
    if leaked:
        note = f"traffic reached variants at weight 0: {sorted(leaked)}"
        # chi2 is infinite here; None keeps the result JSON-safe.
        return SrmPart(revision, total, observed, expected, None, len(live), 0.0, True, note)
    if total == 0 or len(live) < 2:
        note = "no traffic" if total == 0 else "a single live variant: nothing to compare"
        return SrmPart(revision, total, observed, expected, 0.0, 0, 1.0, False, note)
    chi2 = float(sum((observed[k] - expected[k]) ** 2 / expected[k] for k in live))
    df = len(live) - 1
    p = float(sps.chi2.sf(chi2, df))
    return SrmPart(revision, total, observed, expected, chi2, df, p, p < alpha, "")


def sample_ratio_mismatch(
    revisions: Sequence[tuple[str, Mapping[str, int], Mapping[str, float]]],
    alpha: float = SRM_ALPHA,
) -> SrmResult:
    """Chi-square goodness of fit of assignment counts against the weights in force.

    One test per config revision (weights change between revisions, so pooling counts would
    mix different expectations), then a combined test summing the independent chi-squares and
    their degrees of freedom. Flagged when any part has p < alpha.
    """
    if not revisions:
        raise ValueError("sample_ratio_mismatch: no revisions given")
    parts = [_srm_part(str(rev), counts, weights, alpha) for rev, counts, weights in revisions]
    df = sum(p.df for p in parts)
    chi2: float | None
    if any(p.chi2 is None for p in parts):
        chi2, p_comb = None, 0.0
    else:
        chi2 = float(sum(p.chi2 or 0.0 for p in parts))
        p_comb = float(sps.chi2.sf(chi2, df)) if df > 0 else 1.0
    observed: dict[str, int] = {}
    expected: dict[str, float] = {}
    for p in parts:
        for k, v in p.observed.items():
            observed[k] = observed.get(k, 0) + v
        for k, e in p.expected.items():
            expected[k] = expected.get(k, 0.0) + e
    combined = SrmPart(
        "combined",
        sum(p.total for p in parts),
        observed,
        expected,
        chi2,
        df,
        p_comb,
        p_comb < alpha,
        "sum of per-revision chi-squares",
    )
    bad = [p for p in parts if p.flagged] + ([combined] if combined.flagged else [])
    if bad:
        worst = min(bad, key=lambda p: p.p_value)
        message = (
            f"Sample ratio mismatch (p={worst.p_value:.2g} < {alpha} in revision "
            f"{worst.revision}): assignment does not follow the weights; results may be biased."
        )
        if worst.note:
            message += f" {worst.note}."
    else:
        message = ""
    return SrmResult(bool(bad), alpha, combined, parts, message)


# ---------------------------------------------------------------------------------------------
# Verdict against the SLA target


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    verdict: str  # "meets" | "misses" | "not enough data"
    target: float
    attainment: Interval | None
    n: int
    n_needed: int | None  # total samples needed to decide, when not enough data
    message: str

    def as_dict(self) -> dict[str, Any]:
        return _asdict(self)


MEETS, MISSES, NOT_ENOUGH = "meets", "misses", "not enough data"


def _wilson_excludes(p: float, n: int, target: float, z: float) -> bool:
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return centre - half >= target if p >= target else centre + half < target


def sample_size_to_decide(p: float, target: float, conf: float = DEFAULT_CONF) -> int | None:
    """Smallest n at which a Wilson interval around an observed share ``p`` excludes ``target``.

    None when p == target: no sample size can separate an estimate from itself.
    """
    if not (0 <= p <= 1 and 0 < target < 1):
        raise ValueError(f"sample_size_to_decide: need 0<=p<=1 and 0<target<1, got {p}, {target}")
    if p == target:
        return None
    z = _z(conf)
    hi = 1
    while not _wilson_excludes(p, hi, target, z):
        hi *= 2
        if hi > 1 << 62:
            return None
    lo = hi // 2
    while lo + 1 < hi:  # invariant: lo does not exclude (or is 0), hi does
        mid = (lo + hi) // 2
        if _wilson_excludes(p, mid, target, z):
            hi = mid
        else:
            lo = mid
    return hi


def sla_verdict(hits: int, n: int, target: float, conf: float = DEFAULT_CONF) -> Verdict:
    """Meets when the whole Wilson interval is >= target, misses when it is below, else undecided.

    The sample size needed assumes the observed attainment stays where it is: the interval
    width shrinks like 1/sqrt(n) until it no longer straddles the target.
    """
    _check_counts(hits, n, "sla_verdict")
    if not (0 < target < 1):
        raise ValueError(f"sla_verdict: target must be a share strictly in (0, 1), got {target}")
    if n == 0:
        return Verdict(NOT_ENOUGH, target, None, 0, None, "no samples yet")
    ci = wilson_interval(hits, n, conf)
    if ci.lo >= target:
        return Verdict(
            MEETS,
            target,
            ci,
            n,
            None,
            f"attainment {ci.estimate:.2%} (CI {ci.lo:.2%}-{ci.hi:.2%}) meets {target:.2%}",
        )
    if ci.hi < target:
        return Verdict(
            MISSES,
            target,
            ci,
            n,
            None,
            f"attainment {ci.estimate:.2%} (CI {ci.lo:.2%}-{ci.hi:.2%}) misses {target:.2%}",
        )
    need = sample_size_to_decide(ci.estimate, target, conf)
    if need is None:
        msg = f"attainment {ci.estimate:.2%} equals the target; more data will not decide it"
    else:
        msg = (
            f"CI {ci.lo:.2%}-{ci.hi:.2%} straddles {target:.2%}; about {need} samples "
            f"({max(need - n, 1)} more) needed if attainment stays at {ci.estimate:.2%}"
        )
        need = max(need, n + 1)
    return Verdict(NOT_ENOUGH, target, ci, n, need, msg)


# ---------------------------------------------------------------------------------------------
# Convenience: every variant against the control, Holm-corrected


@dataclasses.dataclass(frozen=True, slots=True)
class ArmCounts:
    n: int
    hits: int


def compare_attainment(
    control: ArmCounts, variants: Mapping[str, ArmCounts], conf: float = DEFAULT_CONF
) -> dict[str, dict[str, Any]]:
    """{variant: {"difference": Difference.as_dict(), "p_holm": float}} across all variants."""
    diffs = {
        key: attainment_difference(control.hits, control.n, arm.hits, arm.n, conf)
        for key, arm in variants.items()
    }
    holm = holm_adjust({k: d.p_value for k, d in diffs.items() if d.p_value is not None})
    return {k: {"difference": d.as_dict(), "p_holm": holm[k]} for k, d in diffs.items()}
