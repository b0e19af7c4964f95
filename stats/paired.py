"""Mirror mode: paired tests on the same requests (McNemar, Wilcoxon signed-rank)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from scipy import special
from scipy import stats as sps

from stats._common import DEFAULT_CONF, AsDict, check_counts, clean_samples, z_of
from stats.comparisons import Difference


@dataclasses.dataclass(frozen=True, slots=True)
class PairedAttainment(AsDict):
    n_pairs: int
    control_attainment: float
    variant_attainment: float
    difference: Difference
    discordant_variant_only: int  # variant met the SLA, control missed
    discordant_control_only: int


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
        check_counts(0, value, f"mcnemar_attainment({name})")
    n = sum(cells)
    if n == 0:
        raise ValueError("mcnemar_attainment: no pairs")
    d = (variant_only - control_only) / n
    p = mcnemar_mid_p(control_only, variant_only)
    b, c = control_only + 0.5, variant_only + 0.5
    nn = n + 2.0
    d_adj = (c - b) / nn
    var = ((b + c) - (c - b) ** 2 / nn) / nn**2
    half = z_of(conf) * math.sqrt(max(var, 0.0))
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
class PairedRankTest(AsDict):
    n_pairs: int
    n_nonzero: int
    median_difference: float  # median of variant - control per request
    statistic: float
    p_value: float
    method: str


def wilcoxon_paired(
    differences: np.ndarray | Sequence[float],
) -> PairedRankTest:
    """Wilcoxon signed-rank on per-request differences (variant - control TTFT).

    Pass only pairs where both arms produced a TTFT; failed requests are attainment misses,
    compared by ``mcnemar_attainment``. Zero differences are dropped (Wilcoxon's convention).
    """
    d = clean_samples(differences, "wilcoxon_paired")
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
