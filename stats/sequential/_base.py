"""What the sequential modules share: the interval they return and the argument checks."""

from __future__ import annotations

import dataclasses
import math
import numbers

from stats._common import AsDict

DEFAULT_ALPHA = 0.05
# Beta(1, 1): the uniform mixture. Fixed before any data is seen, as validity requires; a
# prior concentrated near the expected share narrows the sequence there and widens it elsewhere.
DEFAULT_PRIOR: tuple[float, float] = (1.0, 1.0)


@dataclasses.dataclass(frozen=True, slots=True)
class SequentialInterval(AsDict):
    """An anytime-valid interval: with probability >= 1 - alpha it holds at every look at once.

    ``None`` bounds are infinite (too few samples for that side yet); ``estimate`` is None
    without samples. Safe to read mid-run, unlike the fixed-horizon intervals of the report.
    """

    estimate: float | None
    lo: float | None
    hi: float | None
    alpha: float
    method: str


def check_alpha(alpha: float, where: str) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0.0 < alpha < 1.0:
        raise ValueError(f"{where}: alpha must be strictly between 0 and 1, got {alpha!r}")


def check_prior(prior: tuple[float, float], where: str) -> tuple[float, float]:
    try:
        a, b = (float(x) for x in prior)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: prior must be a pair (a, b) of positive numbers, got {prior!r}") from None
    if not (a > 0 and b > 0 and math.isfinite(a) and math.isfinite(b)):
        raise ValueError(f"{where}: prior must be a pair (a, b) of positive finite numbers, got {prior!r}")
    return a, b


def finite_or_none(x: float) -> float | None:
    """JSON-safe bound: an infinite side is None."""
    x = float(x)
    return x if math.isfinite(x) else None
