"""Sequential sample ratio mismatch: an e-value and a p-value valid under continuous monitoring.

The construction (Lindon & Malek 2022, "Anytime-valid inference for multinomial count data"):
under the null, assignments are multinomial with the configured shares theta. The Bayes factor
of a Dirichlet(k * theta) mixture against the null,

    E_n = Gamma(k) / Gamma(k + n) * prod_i Gamma(k theta_i + x_i) / Gamma(k theta_i)
          / prod_i theta_i^x_i,

is a nonnegative martingale with E_0 = 1 under the null, so P(E_n >= 1/alpha at any n) <= alpha
(Ville). The anytime p-value is min(1, 1 / max over looks of E_n): it only goes down, and
P(it ever drops to alpha or below) <= alpha however often it is read. Flag when it does.

Run it per config revision (weights fixed): a rollout step is one revision, so the controller
tests each step's own split. The chi-square of stats.srm read at every look is not valid: its
false alarm rate grows with the number of looks (bench/bench_sequential.py shows how far).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence

import numpy as np
from scipy import special

from stats._common import AsDict
from stats.sequential._base import check_alpha
from stats.srm import SRM_ALPHA

# k, the prior's concentration: the mixture is most sensitive to share shifts of about
# sqrt(theta (1 - theta) / k), i.e. 1.6 points at a 50/50 split with k = 1000, and still
# detects larger shifts quickly (the prior is spread enough not to miss them).
DEFAULT_CONCENTRATION = 1000.0


def srm_log_e_values(
    counts: np.ndarray | Sequence[Sequence[int]],
    weights: np.ndarray | Sequence[float],
    concentration: float = DEFAULT_CONCENTRATION,
) -> np.ndarray:
    """log E_n for counts of shape (..., arms) against ``weights`` (vectorized; +inf when an arm
    at weight 0 received traffic)."""
    x = np.asarray(counts, dtype=float)
    w = np.asarray(weights, dtype=float)
    if w.ndim != 1 or x.shape[-1:] != w.shape:
        raise ValueError(f"srm_log_e_values: counts {x.shape} need one column per weight {w.shape}")
    if not (np.isfinite(w).all() and (w >= 0).all() and w.sum() > 0):
        raise ValueError("srm_log_e_values: weights must be finite, >= 0 and not all 0")
    if not (np.isfinite(concentration) and concentration > 0):
        raise ValueError(f"srm_log_e_values: concentration must be > 0, got {concentration!r}")
    if (x < 0).any() or (x != np.floor(x)).any():
        raise ValueError("srm_log_e_values: counts must be integers >= 0")
    theta = w / w.sum()
    live = theta > 0
    leaked = (x[..., ~live] > 0).any(axis=-1)
    xs, th = x[..., live], theta[live]
    prior = concentration * th
    n = xs.sum(axis=-1)
    log_e = (
        special.gammaln(concentration)
        - special.gammaln(concentration + n)
        + (special.gammaln(prior + xs) - special.gammaln(prior)).sum(axis=-1)
        - (xs * np.log(th)).sum(axis=-1)
    )
    return np.where(leaked, np.inf, log_e)


@dataclasses.dataclass(frozen=True, slots=True)
class SrmCheck(AsDict):
    """One look: counts, the e-value now, the anytime p-value so far, and whether it flags."""

    counts: dict[str, int]
    weights: dict[str, float]
    log_e_value: float | None  # log E_n at this look; None: infinite (traffic reached an arm at weight 0)
    p_value: float  # anytime p-value: 1 / the largest e-value at any look so far
    alpha: float
    flagged: bool
    message: str


@dataclasses.dataclass(frozen=True, slots=True)
class SrmSequence:
    """Sequential SRM state for one revision's weights: counts and the largest e-value seen.

    ``update`` adds a batch of per-arm counts (O(arms)) and returns the next state. The p-value
    depends on the looks taken (it is 1 / the largest e-value at a look); the e-value itself
    depends only on the totals.
    """

    weights: Mapping[str, float]
    alpha: float = SRM_ALPHA
    concentration: float = DEFAULT_CONCENTRATION
    counts: Mapping[str, int] = dataclasses.field(default_factory=dict)
    max_log_e: float = 0.0

    def __post_init__(self) -> None:
        check_alpha(self.alpha, "SrmSequence")
        if not self.weights:
            raise ValueError("SrmSequence: no weights given")
        for key, w in self.weights.items():
            if isinstance(w, bool) or not isinstance(w, numbers.Real) or not (math.isfinite(w) and w >= 0):
                raise ValueError(f"SrmSequence: weight of {key!r} must be a finite number >= 0, got {w!r}")
        if sum(self.weights.values()) <= 0:
            raise ValueError("SrmSequence: weights sum to 0")
        if not (math.isfinite(self.concentration) and self.concentration > 0):
            raise ValueError(f"SrmSequence: concentration must be > 0, got {self.concentration!r}")
        counts = self._checked(self.counts, "SrmSequence")
        object.__setattr__(self, "weights", dict(self.weights))
        object.__setattr__(self, "counts", {k: counts.get(k, 0) for k in self.weights})

    def _checked(self, counts: Mapping[str, int], where: str) -> dict[str, int]:
        unknown = sorted(set(counts) - set(self.weights))
        if unknown:
            raise ValueError(f"{where}: counts for arms with no weight: {unknown}")
        for key, c in counts.items():
            if isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 0:
                raise ValueError(f"{where}: count of {key!r} must be an integer >= 0, got {c!r}")
        return {k: int(v) for k, v in counts.items()}

    def log_e_value(self) -> float:
        keys = list(self.weights)
        return float(
            srm_log_e_values(
                [self.counts[k] for k in keys], [self.weights[k] for k in keys], self.concentration
            )
        )

    def update(self, counts: Mapping[str, int]) -> SrmSequence:
        """Add a batch of assignments per arm and take a look."""
        add = self._checked(counts, "SrmSequence.update")
        total = {k: self.counts[k] + add.get(k, 0) for k in self.weights}
        nxt = dataclasses.replace(self, counts=total)
        return dataclasses.replace(nxt, max_log_e=max(self.max_log_e, nxt.log_e_value()))

    def check(self) -> SrmCheck:
        now = self.log_e_value()
        best = max(self.max_log_e, now)
        p = 0.0 if math.isinf(best) else min(1.0, math.exp(-best))
        flagged = p <= self.alpha
        message = ""
        if flagged:
            leaked = [k for k, w in self.weights.items() if w == 0 and self.counts[k] > 0]
            message = (
                f"Sample ratio mismatch (anytime p={p:.2g} <= {self.alpha}): assignment counts "
                f"{self.counts} do not follow the weights {self.weights}; the split is broken"
            )
            if leaked:
                message += f"; traffic reached arms at weight 0: {leaked}"
        return SrmCheck(
            dict(self.counts),
            dict(self.weights),
            None if math.isinf(now) else now,
            p,
            self.alpha,
            flagged,
            message,
        )
