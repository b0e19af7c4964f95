"""Shared checks and constants of stats: stdlib only at import time.

quantiles.py imports this module and must stay importable without numpy/scipy (replay and
streaming use ``nearest_rank``), so numpy and scipy are imported inside the functions here.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np

DEFAULT_CONF = 0.95


class AsDict:
    """The results the report serializes: ``as_dict`` is ``dataclasses.asdict``, defined once."""

    __slots__ = ()

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]


def check_conf(conf: float, where: str) -> None:
    if not (isinstance(conf, float | int) and 0.0 < conf < 1.0):
        raise ValueError(f"{where}: conf must be strictly between 0 and 1, got {conf!r}")


def check_counts(hits: int, n: int, where: str) -> None:
    for name, value in (("hits", hits), ("n", n)):
        # numbers.Integral covers int and numpy integers (numpy registers them) without numpy.
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{where}: {name} must be an integer count, got {value!r}")
        if value < 0:
            raise ValueError(f"{where}: {name} must be >= 0, got {value}")
    if hits > n:
        raise ValueError(f"{where}: hits ({hits}) cannot exceed n ({n})")


@functools.lru_cache(maxsize=64)
def z_of(conf: float) -> float:
    """Two-sided normal quantile for a confidence level: z with P(|Z| <= z) = conf."""
    from scipy import stats as sps

    return float(sps.norm.ppf(0.5 + conf / 2.0))


def clean_samples(samples: np.ndarray | Sequence[float], where: str) -> np.ndarray:
    """A flat float array of samples; NaN (a metric that never happened) is refused."""
    import numpy as np

    arr = np.asarray(samples, dtype=float).ravel()
    if np.isnan(arr).any():
        raise ValueError(
            f"{where}: samples contain NaN; drop requests without this metric first "
            "(they are SLA misses, not latencies)"
        )
    return arr
