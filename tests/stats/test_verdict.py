"""stats.verdict: the SLA verdict and the sample size to decide.

Checked against scipy, brute force and simulation (seeded, deterministic)."""

from __future__ import annotations

import math

import pytest
from scipy import stats as sps

from stats.quantiles import quantile_estimate
from stats.verdict import MEETS, MISSES, NOT_ENOUGH, sample_size_to_decide, sla_verdict


def test_verdict_meets_misses_and_undecided():
    assert sla_verdict(990, 1000, 0.95).verdict == MEETS
    assert sla_verdict(900, 1000, 0.95).verdict == MISSES
    v = sla_verdict(95, 100, 0.9)
    assert v.verdict == NOT_ENOUGH and v.n_needed > 100
    assert sla_verdict(0, 0, 0.9).n_needed is None


def _wilson_bounds(p, n, z):
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return centre - half, centre + half


@pytest.mark.parametrize(("p", "target"), [(0.95, 0.9), (0.9, 0.95), (0.991, 0.99), (1.0, 0.99)])
def test_sample_size_needed_is_the_first_n_whose_interval_clears_the_target(p, target):
    z = sps.norm.ppf(0.975)
    need = sample_size_to_decide(p, target)

    def decided(n):
        lo, hi = _wilson_bounds(p, n, z)
        return lo >= target if p >= target else hi < target

    assert decided(need) and not decided(need - 1)


def test_sample_size_needed_is_none_when_the_estimate_equals_the_target():
    v = sla_verdict(90, 100, 0.9)
    assert v.verdict == NOT_ENOUGH and v.n_needed is None
    assert "equals the target" in v.message


def test_results_serialize_to_plain_dicts():
    d = sla_verdict(95, 100, 0.9).as_dict()
    assert d["attainment"]["lo"] < 0.9 < d["attainment"]["hi"]
    assert isinstance(quantile_estimate([1.0, 2.0], 0.5).as_dict()["note"], str)
