"""Segments: bucketing, attainment per bucket, and the Kitagawa mix-vs-rate split of a
difference between two variants into "different traffic" and "different per-segment
performance". All differences are ``b - a``. Pure numpy."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from analysis.definitions import MAX_TIME_BUCKETS, TIME_BUCKETS_S
from stats._common import DEFAULT_CONF
from stats.proportions import wilson_interval


def choose_bucket_s(window_s: float) -> int:
    """The smallest time bucket (definitions.TIME_BUCKETS_S) giving <= MAX_TIME_BUCKETS buckets."""
    for b in TIME_BUCKETS_S:
        if window_s / b <= MAX_TIME_BUCKETS:
            return b
    return TIME_BUCKETS_S[-1]


def _check_edges(edges: Sequence[float]) -> None:
    if not edges or any(not math.isfinite(e) for e in edges) or list(edges) != sorted(set(edges)):
        raise ValueError(f"bucket edges must be finite and strictly increasing, got {edges}")


def bucket_index(values: np.ndarray | Sequence[float], edges: Sequence[float]) -> np.ndarray:
    """Bucket of each value: the number of edges <= x.

    ClickHouse equivalent: ``arrayCount(e -> e <= x, [edges])``.
    """
    _check_edges(edges)
    return np.searchsorted(np.asarray(edges, dtype=float), np.asarray(values), side="right")


def bucket_labels(edges: Sequence[float]) -> list[str]:
    """Labels for bucket_index 0..len(edges): "<128", "128-512", ..., ">=8192" (lo inclusive)."""
    _check_edges(edges)
    e = [f"{x:g}" for x in edges]
    return [f"<{e[0]}"] + [f"{a}-{b}" for a, b in itertools.pairwise(e)] + [f">={e[-1]}"]


def attainment_by_segment(
    counts: Mapping[str, tuple[int, int]], conf: float = DEFAULT_CONF
) -> dict[str, dict[str, Any]]:
    """{segment: {"n", "hits", "attainment", "lo", "hi"}} from {segment: (n, hits)}.

    Segments with no samples are kept with None so a heatmap shows them as empty cells.
    """
    out: dict[str, dict[str, Any]] = {}
    for seg, (n, hits) in counts.items():
        if n == 0:
            out[seg] = {"n": 0, "hits": 0, "attainment": None, "lo": None, "hi": None}
            continue
        ci = wilson_interval(hits, n, conf)
        out[seg] = {
            "n": n,
            "hits": hits,
            "attainment": ci.estimate,
            "lo": ci.lo,
            "hi": ci.hi,
        }
    return out


def mix_rate_decomposition_rates(
    a: Mapping[str, tuple[int, float]], b: Mapping[str, tuple[int, float]]
) -> dict[str, Any]:
    """Kitagawa split of rate(b) - rate(a) from {segment: (n, rate)} per variant.

    total = sum_s w_b r_b - w_a r_a
          = sum_s (w_b - w_a)(r_a + r_b)/2   [mix: b got a different traffic mix]
          + sum_s (r_b - r_a)(w_a + w_b)/2   [rate: b does better/worse in the same segment]
    The two parts sum exactly to the total. A segment seen by only one variant has no rate to
    compare, so its whole contribution is mix (its missing rate is set to the other's).
    """
    segments = list(dict.fromkeys([*a, *b]))
    for label, side in (("a", a), ("b", b)):
        for seg, (n, rate) in side.items():
            if n < 0 or (n > 0 and not math.isfinite(rate)):
                raise ValueError(f"mix_rate_decomposition: segment {seg!r} of {label} is invalid")
    na = sum(a[s][0] for s in a)
    nb = sum(b[s][0] for s in b)
    if na == 0 or nb == 0:
        raise ValueError(f"mix_rate_decomposition: both sides need samples (a={na}, b={nb})")
    per: dict[str, dict[str, float | None]] = {}
    mix = rate = 0.0
    total_a = total_b = 0.0
    for s in segments:
        n_a, r_a = a.get(s, (0, math.nan))
        n_b, r_b = b.get(s, (0, math.nan))
        wa, wb = n_a / na, n_b / nb
        ra = r_a if n_a > 0 else None
        rb = r_b if n_b > 0 else None
        if ra is None and rb is None:
            ra_eff = rb_eff = 0.0
        else:
            ra_eff = ra if ra is not None else rb
            rb_eff = rb if rb is not None else ra
        assert ra_eff is not None and rb_eff is not None
        m = (wb - wa) * (ra_eff + rb_eff) / 2.0
        r = (rb_eff - ra_eff) * (wa + wb) / 2.0
        mix += m
        rate += r
        total_a += wa * ra_eff
        total_b += wb * rb_eff
        per[s] = {
            "share_a": wa,
            "share_b": wb,
            "rate_a": ra,
            "rate_b": rb,
            "mix": m,
            "rate": r,
        }
    total = total_b - total_a
    if abs(total) < 1e-12:
        dominant, text = "none", "no difference between the two"
    else:
        dominant = "mix" if abs(mix) > abs(rate) else "rate"
        text = (
            f"{mix / total:.0%} of the difference comes from traffic mix, "
            f"{rate / total:.0%} from per-segment performance"
        )
        if dominant == "mix":
            text += "; it differs mostly because it got different traffic"
    return {
        "total": total,
        "mix": mix,
        "rate": rate,
        "rate_a": total_a,
        "rate_b": total_b,
        "dominant": dominant,
        "text": text,
        "segments": per,
    }


def mix_rate_decomposition(
    a: Mapping[str, tuple[int, int]], b: Mapping[str, tuple[int, int]]
) -> dict[str, Any]:
    """Mix-vs-rate split of attainment(b) - attainment(a) from {segment: (n, hits)}."""
    for label, side in (("a", a), ("b", b)):
        for seg, (n, hits) in side.items():
            if not (0 <= hits <= n):
                raise ValueError(f"mix_rate_decomposition: segment {seg!r} of {label} has hits={hits}, n={n}")
    return mix_rate_decomposition_rates(
        {s: (n, h / n if n else math.nan) for s, (n, h) in a.items()},
        {s: (n, h / n if n else math.nan) for s, (n, h) in b.items()},
    )
