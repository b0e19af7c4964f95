"""Variant vs control: attainment and quantile differences, rank tests, Holm correction.

Differences are ``variant - control``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, overload

import numpy as np
from scipy import stats as sps

from stats._common import DEFAULT_CONF, AsDict, check_conf, check_counts, clean_samples
from stats.proportions import wilson_bounds, wilson_interval
from stats.quantiles import QuantileEstimate, quantile_estimate

# Below these expected counts the normal approximation of the two-proportion test is poor.
_MIN_EXPECTED_FOR_Z = 5.0


@dataclasses.dataclass(frozen=True, slots=True)
class Difference(AsDict):
    estimate: float  # variant - control
    lo: float | None
    hi: float | None
    conf: float
    p_value: float | None
    method: str


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
    check_counts(control_hits, control_n, "attainment_difference(control)")
    check_counts(variant_hits, variant_n, "attainment_difference(variant)")
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


def attainment_difference_bounds(
    control_hits: np.ndarray | Sequence[int],
    control_n: np.ndarray | Sequence[int],
    variant_hits: np.ndarray | Sequence[int],
    variant_n: np.ndarray | Sequence[int],
    conf: float = DEFAULT_CONF,
) -> tuple[np.ndarray, np.ndarray]:
    """``attainment_difference``'s Newcombe CI, vectorized for many cells (simulations)."""
    hc, nc = np.asarray(control_hits, dtype=float), np.asarray(control_n, dtype=float)
    hv, nv = np.asarray(variant_hits, dtype=float), np.asarray(variant_n, dtype=float)
    lc, uc = wilson_bounds(hc, nc, conf)
    lv, uv = wilson_bounds(hv, nv, conf)
    pc, pv = hc / nc, hv / nv
    d = pv - pc
    lo = d - np.sqrt((pv - lv) ** 2 + (uc - pc) ** 2)
    hi = d + np.sqrt((uv - pv) ** 2 + (pc - lc) ** 2)
    return np.clip(np.minimum(d, lo), -1.0, 1.0), np.clip(np.maximum(d, hi), -1.0, 1.0)


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
    check_conf(conf, "quantile_difference_conf")
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
class RankTest(AsDict):
    statistic: float  # U of the variant
    p_value: float
    prob_variant_greater: float  # P(V > C) + 0.5 P(V = C), the common-language effect size
    n_control: int
    n_variant: int
    method: str


def mann_whitney(control: np.ndarray | Sequence[float], variant: np.ndarray | Sequence[float]) -> RankTest:
    c = clean_samples(control, "mann_whitney(control)")
    v = clean_samples(variant, "mann_whitney(variant)")
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
