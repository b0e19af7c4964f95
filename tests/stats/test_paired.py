"""stats.paired: mirror mode: McNemar, Wilcoxon signed-rank.

Checked against scipy, brute force and simulation (seeded, deterministic)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from stats.paired import mcnemar_attainment, wilcoxon_paired


def test_mcnemar_p_value_is_the_mid_p_binomial_of_discordant_pairs():
    r = mcnemar_attainment(both_hit=800, control_only=30, variant_only=55, both_miss=115)
    exact = sps.binomtest(30, 85, 0.5).pvalue
    # mid-p = exact two-sided minus the probability of the observed split (symmetric case)
    assert r.difference.p_value == pytest.approx(exact - sps.binom.pmf(30, 85, 0.5))
    assert r.difference.p_value < exact
    assert r.difference.estimate == pytest.approx((55 - 30) / 1000)
    assert r.control_attainment == 0.83 and r.variant_attainment == 0.855
    assert r.difference.lo <= r.difference.estimate <= r.difference.hi


def test_mcnemar_false_positive_rate_in_simulated_aa_is_near_alpha():
    rng = np.random.default_rng(21)
    reps, n = 2500, 300
    # Correlated pairs: shared per-request difficulty, identical arms.
    difficulty = rng.uniform(size=(reps, n))
    c = difficulty + 0.1 * rng.normal(size=(reps, n)) < 0.9
    v = difficulty + 0.1 * rng.normal(size=(reps, n)) < 0.9
    both, co, vo = (c & v).sum(1), (c & ~v).sum(1), (~c & v).sum(1)
    ps = np.array(
        [
            mcnemar_attainment(int(a), int(b), int(d), n - int(a + b + d)).difference.p_value
            for a, b, d in zip(both, co, vo, strict=True)
        ]
    )
    assert 0.03 <= np.mean(ps < 0.05) <= 0.07


def test_wilcoxon_paired_matches_scipy_and_handles_all_zero_differences():
    rng = np.random.default_rng(22)
    d = rng.normal(5.0, 20.0, size=300)
    r = wilcoxon_paired(d)
    assert r.p_value == pytest.approx(sps.wilcoxon(d).pvalue)
    assert r.median_difference == pytest.approx(np.median(d))
    z = wilcoxon_paired(np.zeros(10))
    assert z.p_value == 1.0 and z.n_nonzero == 0
