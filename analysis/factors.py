"""Why a variant differs from the control, per factor: Shapley or additive attribution.

Variants carry tags (quantization=awq, attention=fa2). The difference between the control and a
variant (attainment, p99 TTFT, any per-cell metric) is split into per-factor contributions:
exact Shapley values when every combination of the differing factors was run, otherwise the
effects of an additive least-squares model over all observed cells. Pure numpy.
All differences are ``variant - control``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

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


def _percent(share: float) -> str:
    """A share as a whole percent; one that rounds to 0 is "0%", never "-0%"."""
    return "0%" if abs(share) < 0.005 else f"{share:.0%}"


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
        texts.append(f"{name(factor)}: {_percent(value / total)}" + (f" of the {word}" if i == 0 else ""))
    residual = entry.get("residual", 0.0)
    if abs(residual / total) >= 0.005:
        texts.append(f"other (interactions, unexplained): {_percent(residual / total)}")
    if not texts:
        return f"no factor differs; the whole {word} is unexplained"
    return ", ".join(texts)
