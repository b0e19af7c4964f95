"""Why requests miss the SLA: factor attribution, TTFT phases, segments. Pure numpy.

- Factors: variants carry tags (quantization=awq, attention=fa2). The difference between the
  control and a variant (attainment, p99 TTFT, any per-cell metric) is split into per-factor
  contributions: exact Shapley values when every combination of the differing factors was run,
  otherwise the effects of an additive least-squares model over all observed cells.
- Phases: how the TTFT of missed requests splits into schedule lag, connect, headers,
  headers -> first event, first event -> first content.
- Segments: attainment per bucket, and the Kitagawa mix-vs-rate split of a difference between
  two variants into "different traffic" and "different per-segment performance".
All differences are ``variant - control`` (or ``b - a``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from analysis.stats import DEFAULT_CONF, wilson_interval

SHAPLEY, ADDITIVE = "shapley", "additive"
# Numerical tolerance for "this contrast lies in the row space of the design".
_ESTIMABLE_TOL = 1e-8


@dataclasses.dataclass(frozen=True, slots=True)
class Cell:
    """One observed configuration: its factor levels and the metric measured there."""

    tags: Mapping[str, str]
    value: float
    weight: float = 1.0  # e.g. the sample count, so large cells count more in the fit


def _validate_cells(cells: Mapping[str, Cell], control: str) -> list[str]:
    if control not in cells:
        raise ValueError(f"attribute_factors: control {control!r} is not among the cells")
    factors = sorted(cells[control].tags)
    for key, cell in cells.items():
        if sorted(cell.tags) != factors:
            raise ValueError(
                f"attribute_factors: variant {key!r} has factors {sorted(cell.tags)}, the control "
                f"has {factors}; every variant must tag the same factors"
            )
        if not math.isfinite(cell.value):
            raise ValueError(f"attribute_factors: variant {key!r} has a non-finite value")
        if not (math.isfinite(cell.weight) and cell.weight > 0):
            raise ValueError(f"attribute_factors: variant {key!r} needs a weight > 0")
    return factors


def _shapley(k: int, v: Mapping[int, float]) -> list[float]:
    """Shapley values of k players from the value of every coalition (bitmask -> value)."""
    phi = [0.0] * k
    fact = [math.factorial(i) for i in range(k + 1)]
    for i in range(k):
        bit = 1 << i
        for mask in range(1 << k):
            if mask & bit:
                continue
            s = mask.bit_count()
            phi[i] += fact[s] * fact[k - s - 1] / fact[k] * (v[mask | bit] - v[mask])
    return phi


def _coalition_values(
    cells: Mapping[str, Cell], control: str, variant: str, differing: Sequence[str]
) -> dict[int, float] | None:
    """Metric for each mix of control/variant levels, or None if some combination was not run."""
    base, target = cells[control].tags, cells[variant].tags
    # The corners are the control and the variant themselves, so the total is exact.
    full = (1 << len(differing)) - 1
    values: dict[int, float] = {0: cells[control].value, full: cells[variant].value}
    for mask in range(1, full):
        want = dict(base)
        for i, f in enumerate(differing):
            if mask >> i & 1:
                want[f] = target[f]
        match = [c for c in cells.values() if dict(c.tags) == want]
        if not match:
            return None
        wsum = sum(c.weight for c in match)
        values[mask] = sum(c.value * c.weight for c in match) / wsum
    return values


def _additive_fit(
    cells: Mapping[str, Cell], factors: Sequence[str], control: str
) -> tuple[np.ndarray, dict[tuple[str, str], int], np.ndarray]:
    """Weighted least squares: value ~ intercept + sum of factor-level effects.

    The control's level of each factor is the reference (effect 0). Returns the coefficients,
    the column of every non-reference (factor, level), and the projector onto the row space
    of the design (to test which contrasts the observed cells can estimate).
    """
    columns: dict[tuple[str, str], int] = {}
    for f in factors:
        ref = cells[control].tags[f]
        for level in sorted({c.tags[f] for c in cells.values()} - {ref}):
            columns[(f, level)] = len(columns) + 1
    keys = list(cells)
    x = np.zeros((len(keys), len(columns) + 1))
    x[:, 0] = 1.0
    for row, key in enumerate(keys):
        for f in factors:
            col = columns.get((f, cells[key].tags[f]))
            if col is not None:
                x[row, col] = 1.0
    w = np.sqrt(np.array([cells[k].weight for k in keys]))
    y = np.array([cells[k].value for k in keys])
    xw = x * w[:, None]
    beta, *_ = np.linalg.lstsq(xw, y * w, rcond=None)
    row_space = np.linalg.pinv(xw) @ xw
    return beta, columns, row_space


def _estimable(contrast: np.ndarray, row_space: np.ndarray) -> bool:
    return bool(np.allclose(contrast @ row_space, contrast, atol=_ESTIMABLE_TOL))


def _attribute_one(
    cells: Mapping[str, Cell], factors: Sequence[str], control: str, variant: str
) -> dict[str, Any]:
    base, target = cells[control].tags, cells[variant].tags
    differing = [f for f in factors if base[f] != target[f]]
    total = cells[variant].value - cells[control].value
    levels = {f: {"control": base[f], "variant": target[f]} for f in differing}
    contributions: dict[str, float] = {}
    note = ""
    coalition = _coalition_values(cells, control, variant, differing) if differing else {}
    if not differing:
        method = SHAPLEY
        note = "same factor levels as the control: nothing to attribute"
    elif coalition is not None:
        # 1. every combination was run: exact Shapley over the differing factors.
        method = SHAPLEY
        contributions = dict(zip(differing, _shapley(len(differing), coalition), strict=True))
    else:
        # 2. incomplete design: additive model over all cells; contribution = level effect.
        method = ADDITIVE
        beta, columns, row_space = _additive_fit(cells, factors, control)
        size = len(columns) + 1
        unidentified: list[str] = []
        for f in differing:
            contrast = np.zeros(size)
            contrast[columns[(f, target[f])]] = 1.0
            if _estimable(contrast, row_space):
                contributions[f] = float(contrast @ beta)
            else:
                unidentified.append(f)
        if unidentified:
            # 3. factors that always changed together: only their joint effect is estimable.
            contrast = np.zeros(size)
            for f in unidentified:
                contrast[columns[(f, target[f])]] = 1.0
            if _estimable(contrast, row_space):
                contributions["+".join(unidentified)] = float(contrast @ beta)
                note = f"{', '.join(unidentified)} never varied apart: only their joint effect"
            else:
                note = f"{', '.join(unidentified)} cannot be estimated from the cells run"
        fitted = sum(contributions.values())
        if abs(total - fitted) > 1e-9 * max(1.0, abs(total)):
            note = (note + "; " if note else "") + (
                "residual = interactions the additive model cannot express"
            )
    residual = total - sum(contributions.values())
    if abs(residual) <= 1e-12 * max(1.0, abs(total)):
        residual = 0.0
    shares = {f: (c / total if total else None) for f, c in contributions.items()}
    return {
        "total": total,
        "method": method,
        "contributions": contributions,
        "shares": shares,
        "residual": residual,
        "residual_share": residual / total if total else None,
        "levels": levels,
        "note": note,
    }


def attribute_factors(
    cells: Mapping[str, Cell], control: str, variants: Sequence[str] | None = None
) -> dict[str, dict[str, Any]]:
    """Per-factor contributions to ``cells[v].value - cells[control].value`` for each variant.

    Returns ``{variant: {"total", "method": "shapley"|"additive", "contributions": {factor:
    value}, "shares": {factor: fraction of total or None}, "residual", "residual_share",
    "levels": {factor: {"control", "variant"}}, "note"}}``. Shapley contributions sum to the
    total exactly (interactions are split equally between the factors involved); additive
    contributions sum to the model's fitted difference, the rest is ``residual``.
    Factors with the same level in both are left out.
    """
    factors = _validate_cells(cells, control)
    chosen = [k for k in cells if k != control] if variants is None else list(variants)
    for v in chosen:
        if v not in cells:
            raise ValueError(f"attribute_factors: variant {v!r} is not among the cells")
    return {v: _attribute_one(cells, factors, control, v) for v in chosen if v != control}


def render_attribution(
    entry: Mapping[str, Any],
    labels: Mapping[str, str] | None = None,
    higher_is_better: bool = True,
) -> str:
    """ "AWQ: 30% of the gain, FlashAttention-2: 25%, other: 45%" from one attribute_factors entry.

    ``labels`` maps a level ("awq"), or "factor=level", to its display name. For a metric where
    lower is better (p99 TTFT) pass higher_is_better=False so a drop reads as a gain.
    """
    total = entry["total"]
    contributions: Mapping[str, float] = entry["contributions"]
    if not total:
        return "no difference to attribute"
    labels = labels or {}
    levels = entry.get("levels", {})

    def name(factor: str) -> str:
        parts = []
        for f in factor.split("+"):
            level = levels.get(f, {}).get("variant", "")
            parts.append(labels.get(f"{f}={level}") or labels.get(level) or (f"{f}={level}" if level else f))
        return " + ".join(parts)

    gain = (total > 0) == higher_is_better
    word = "gain" if gain else "loss"
    items = sorted(contributions.items(), key=lambda kv: -abs(kv[1]))
    texts = []
    for i, (factor, value) in enumerate(items):
        share = value / total
        texts.append(f"{name(factor)}: {share:.0%}" + (f" of the {word}" if i == 0 else ""))
    residual = entry.get("residual", 0.0)
    if abs(residual / total) >= 0.005:
        texts.append(f"other (interactions, unexplained): {residual / total:.0%}")
    if not texts:
        return f"no factor differs; the whole {word} is unexplained"
    return ", ".join(texts)


# ---------------------------------------------------------------------------------------------
# Phases of TTFT for missed requests

PHASES: tuple[str, ...] = (
    "schedule_lag",
    "connect",
    "headers",
    "headers_to_first_event",
    "first_event_to_first_content",
)
PHASE_LABELS: dict[str, str] = {
    "schedule_lag": "schedule lag",
    "connect": "connect",
    "headers": "time to headers",
    "headers_to_first_event": "headers to first event",
    "first_event_to_first_content": "first event to first content",
}


def phase_arrays(
    schedule_lag_ms: np.ndarray | Sequence[float] | None,
    connect_ms: np.ndarray | Sequence[float | None],
    ttfb_ms: np.ndarray | Sequence[float | None],
    ttft_event_ms: np.ndarray | Sequence[float | None],
    ttft_ms: np.ndarray | Sequence[float | None],
) -> dict[str, np.ndarray]:
    """Per-request phases (ms) from StreamResult fields; they sum to lag + ttft_ms.

    The StreamResult clock starts when the request is written, so schedule lag (how late the
    replay sent it) comes before it and is added on top. connect_ms is None on a reused
    connection (0 ms of connect); a missing lag (not a replay) is 0. Other missing values stay
    NaN and phase_breakdown drops those requests.
    """

    def arr(x: Any) -> np.ndarray:
        return np.array([np.nan if v is None else v for v in x], dtype=float)

    ttft = arr(ttft_ms)
    n = ttft.size
    lag = np.zeros(n) if schedule_lag_ms is None else np.nan_to_num(arr(schedule_lag_ms))
    connect = np.nan_to_num(arr(connect_ms))
    ttfb, event = arr(ttfb_ms), arr(ttft_event_ms)
    for label, a in (
        ("schedule_lag_ms", lag),
        ("connect_ms", connect),
        ("ttfb_ms", ttfb),
    ):
        if a.shape != (n,):
            raise ValueError(f"phase_arrays: {label} has shape {a.shape}, ttft_ms has ({n},)")
    if event.shape != (n,):
        raise ValueError(f"phase_arrays: ttft_event_ms has shape {event.shape}, ttft_ms ({n},)")
    return {
        "schedule_lag": lag,
        "connect": connect,
        "headers": ttfb - connect,
        "headers_to_first_event": event - ttfb,
        "first_event_to_first_content": ttft - event,
    }


def _check_phase_keys(keys: Sequence[str], where: str) -> None:
    unknown = sorted(set(keys) - set(PHASES))
    missing = sorted(set(PHASES) - set(keys))
    if unknown or missing:
        raise ValueError(f"{where}: phases must be exactly {PHASES}; unknown {unknown}, missing {missing}")


def phase_breakdown(
    phases: Mapping[str, np.ndarray | Sequence[float]],
) -> dict[str, Any]:
    """Share of TTFT per phase over missed requests, from per-request arrays.

    Per phase: mean_ms, median_ms, mean_share (mean over requests of phase / total; these sum
    to 1), median_share (do not sum to 1), share_of_total (sum of phase / sum of totals).
    Requests with a missing phase or a non-positive total are dropped and counted.
    """
    _check_phase_keys(list(phases), "phase_breakdown")
    mat = np.vstack([np.asarray(phases[p], dtype=float) for p in PHASES])
    if mat.ndim != 2:
        raise ValueError("phase_breakdown: every phase must be a 1-d array")
    total = mat.sum(axis=0)
    keep = np.isfinite(mat).all(axis=0) & (total > 0)
    if (mat[:, keep] < 0).any():
        bad = [p for p, row in zip(PHASES, mat[:, keep]) if (row < 0).any()]
        raise ValueError(
            f"phase_breakdown: negative durations in {bad}; timestamps out of order "
            "(headers before connect, first content before first event?)"
        )
    mat, total = mat[:, keep], total[keep]
    out: dict[str, Any] = {
        "n": int(keep.sum()),
        "dropped": int((~keep).sum()),
        "phases": {},
    }
    share = mat / total if total.size else mat
    for i, p in enumerate(PHASES):
        has = total.size > 0
        out["phases"][p] = {
            "label": PHASE_LABELS[p],
            "mean_ms": float(mat[i].mean()) if has else None,
            "median_ms": float(np.median(mat[i])) if has else None,
            "mean_share": float(share[i].mean()) if has else None,
            "median_share": float(np.median(share[i])) if has else None,
            "share_of_total": float(mat[i].sum() / total.sum()) if has else None,
        }
    return out


def phase_breakdown_from_sums(sums: Mapping[str, float], count: int) -> dict[str, Any]:
    """The same split from ClickHouse sums over missed requests (sumIf per phase, countIf)."""
    _check_phase_keys(list(sums), "phase_breakdown_from_sums")
    if count < 0:
        raise ValueError(f"phase_breakdown_from_sums: count must be >= 0, got {count}")
    total = float(sum(sums[p] for p in PHASES))
    bad = [p for p in PHASES if not math.isfinite(sums[p]) or sums[p] < 0]
    if bad:
        raise ValueError(f"phase_breakdown_from_sums: phases {bad} have a negative or NaN sum")
    out: dict[str, Any] = {"n": int(count), "dropped": 0, "phases": {}}
    for p in PHASES:
        out["phases"][p] = {
            "label": PHASE_LABELS[p],
            "mean_ms": sums[p] / count if count else None,
            "share_of_total": sums[p] / total if total > 0 else None,
        }
    return out


# ---------------------------------------------------------------------------------------------
# Segments

# Interior cut points; bucket i holds edges[i-1] <= x < edges[i] (open at both ends).
PROMPT_TOKEN_EDGES: tuple[float, ...] = (128, 512, 2048, 8192)
INFLIGHT_EDGES: tuple[float, ...] = (2, 4, 8, 16, 32, 64)


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
