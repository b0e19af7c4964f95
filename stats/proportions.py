"""Proportions: the Wilson interval (the one implementation), SLA attainment, goodput.

Proportions take counts (``count()``, ``countIf(<meets every SLO>)``), so only aggregates
travel from ClickHouse.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from stats._common import DEFAULT_CONF, AsDict, check_conf, check_counts, z_of


@dataclasses.dataclass(frozen=True, slots=True)
class Interval(AsDict):
    estimate: float
    lo: float
    hi: float
    conf: float


def wilson_centre_half(p: Any, n: Any, z: float) -> tuple[Any, Any]:
    """Centre and half-width of the Wilson score interval for share ``p`` of ``n`` samples.

    The one Wilson computation: scalars (``wilson_interval``, the sample-size search in
    verdict.py) and numpy arrays (``wilson_bounds``) go through the same arithmetic.
    """
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return centre, half


def wilson_interval(hits: int, n: int, conf: float = DEFAULT_CONF) -> Interval:
    check_counts(hits, n, "wilson_interval")
    check_conf(conf, "wilson_interval")
    if n == 0:
        raise ValueError("wilson_interval: n is 0, a proportion needs at least one sample")
    p = hits / n
    centre, half = wilson_centre_half(p, n, z_of(conf))
    centre, half = float(centre), float(half)
    # Clamp float fuzz so the interval always contains the estimate and stays in [0, 1].
    return Interval(p, max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half)), conf)


def wilson_bounds(
    hits: np.ndarray | Sequence[int],
    n: np.ndarray | Sequence[int],
    conf: float = DEFAULT_CONF,
) -> tuple[np.ndarray, np.ndarray]:
    """Vectorized Wilson (lo, hi) for many cells at once (segment heatmaps, simulations)."""
    check_conf(conf, "wilson_bounds")
    h = np.asarray(hits, dtype=float)
    m = np.asarray(n, dtype=float)
    if (m <= 0).any() or (h < 0).any() or (h > m).any():
        raise ValueError("wilson_bounds: need n > 0 and 0 <= hits <= n in every cell")
    p = h / m
    centre, half = wilson_centre_half(p, m, z_of(conf))
    return np.clip(np.minimum(p, centre - half), 0, 1), np.clip(np.maximum(p, centre + half), 0, 1)


@dataclasses.dataclass(frozen=True, slots=True)
class Attainment(AsDict):
    n: int
    hits: int
    errors: int
    error_rate: float
    attainment: Interval
    goodput_rps: float | None  # requests per second meeting every SLO; None without a window


def sla_attainment(
    n: int,
    hits: int,
    errors: int = 0,
    window_s: float | None = None,
    conf: float = DEFAULT_CONF,
) -> Attainment:
    """``hits`` must already count errors as misses: countIf(outcome = 'ok' AND every SLO)."""
    check_counts(hits, n, "sla_attainment")
    check_counts(errors, n, "sla_attainment(errors)")
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
