"""Sample ratio mismatch: assignment counts against the weights in force, per revision."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from scipy import stats as sps

from stats._common import AsDict, check_counts

SRM_ALPHA = 0.001


@dataclasses.dataclass(frozen=True, slots=True)
class SrmPart(AsDict):
    revision: str
    total: int
    observed: dict[str, int]
    expected: dict[str, float]
    chi2: float | None  # None when traffic reached a weight-0 variant (infinite mismatch)
    df: int
    p_value: float
    flagged: bool
    note: str


@dataclasses.dataclass(frozen=True, slots=True)
class SrmResult(AsDict):
    flagged: bool
    alpha: float
    combined: SrmPart
    revisions: list[SrmPart]
    message: str


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
        check_counts(0, c, f"{where} count of {key!r}")
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
