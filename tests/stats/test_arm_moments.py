"""stats.clustered.ArmMoments: one arm's per-user sums reduced over users (what the SLA report's
query returns) gives the clustered and adjusted statistics of the per-user arrays, to rounding."""

from __future__ import annotations

import numpy as np
import pytest

from stats.adjusted import ArmData, adjusted_difference
from stats.clustered import ArmMoments, ClusterSums, clustered_difference, clustered_mean, moment_layout

RTOL = 1e-9  # the same algebra, summed in another order


def requests(rng: np.random.Generator, users: int, shift: float = 0.0, without_user: float = 0.1):
    """TTFT-like requests from heavy-tailed users with their own effect, some without a user (None)."""
    n = 1 + rng.poisson(rng.lognormal(1.0, 1.2, users))
    uid = np.repeat(np.arange(users), n).astype(object)
    prompt = np.clip(rng.lognormal(6.0, 1.0, uid.size), 4, 16000).round()
    max_tokens = rng.choice([128.0, 256.0, 512.0], uid.size)
    ttft = (90 + 0.04 * prompt) * np.exp(
        rng.normal(0, 0.3, users)[uid.astype(int)] + rng.normal(0, 0.3, uid.size)
    )
    uid[rng.random(uid.size) < without_user] = None
    return ttft + shift, np.c_[prompt, max_tokens], uid


def close(a, b, rtol=RTOL):
    if a is None or b is None:
        return a is b
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-300)


@pytest.mark.parametrize("binary", [False, True])
def test_clustered_mean_and_difference_from_moments_equal_the_per_user_path(binary):
    rng = np.random.default_rng(3)
    (yc, _xc, uc), (yv, _xv, uv) = requests(rng, 300), requests(rng, 250, shift=5.0)
    if binary:
        yc, yv = (yc < 150).astype(float), (yv < 150).astype(float)
    arms = [ClusterSums.from_samples(y, u, binary=binary) for y, u in ((yc, uc), (yv, uv))]
    for arm in arms:
        want, got = clustered_mean(arm), clustered_mean(arm.arm_moments())
        for field in (
            "estimate",
            "se",
            "lo",
            "hi",
            "se_iid",
            "design_effect",
            "effective_clusters",
            "largest_cluster_share",
        ):
            assert close(getattr(want, field), getattr(got, field)), field
        assert (want.n, want.clusters, want.note, want.method) == (got.n, got.clusters, got.note, got.method)
        assert want.design_effect > 1.5  # the users' requests are correlated
    want = clustered_difference(*arms)
    got = clustered_difference(*(a.arm_moments() for a in arms))
    for field in ("estimate", "se", "lo", "hi", "p_value", "se_iid", "design_effect"):
        assert close(getattr(want, field), getattr(got, field)), field


def test_adjusted_difference_from_moments_equals_the_per_user_path():
    rng = np.random.default_rng(4)
    (yc, xc, uc), (yv, xv, uv) = requests(rng, 400), requests(rng, 380, shift=4.0)
    names = ("prompt_tokens", "max_tokens")
    for binary in (False, True):
        a, b = (yc < 150).astype(float) if binary else yc, (yv < 150).astype(float) if binary else yv
        c, v = ArmData.from_samples(a, xc, uc, names), ArmData.from_samples(b, xv, uv, names)
        want = adjusted_difference(c, v)
        got = adjusted_difference(c.arm_moments(binary), v.arm_moments(binary))
        for field in (
            "estimate",
            "se",
            "lo",
            "hi",
            "p_value",
            "unadjusted",
            "se_unadjusted",
            "se_iid",
            "control_mean",
            "variant_mean",
        ):
            assert close(getattr(want, field), getattr(got, field), 1e-8), field
        assert abs(want.variance_reduction - got.variance_reduction) < 1e-9
        assert np.allclose(want.theta, got.theta, rtol=1e-8)
        assert (want.covariates, want.control_clusters, want.variant_n) == (
            got.covariates,
            got.control_clusters,
            got.variant_n,
        )
        assert want.variance_reduction > 0.05 or binary  # the prompt explains much of TTFT


def test_select_keeps_the_moments_of_the_chosen_covariates():
    rng = np.random.default_rng(5)
    y, x, u = requests(rng, 120)
    full = ArmData.from_samples(y, x, u, ("prompt_tokens", "max_tokens")).arm_moments()
    for keep in (["max_tokens"], ["prompt_tokens"], ["max_tokens", "prompt_tokens"], []):
        cols = [{"prompt_tokens": 0, "max_tokens": 1}[k] for k in keep]
        alone = ArmData.from_samples(y, x[:, cols] if cols else None, u, keep or None).arm_moments()
        picked = full.select(keep)
        assert picked.covariates == tuple(keep) and len(picked.total) == len(moment_layout(len(keep)))
        assert np.allclose(picked.total, alone.total, rtol=1e-12)
        assert np.allclose(picked.cross, alone.cross, rtol=1e-12)
    with pytest.raises(ValueError, match=r"\['output_tokens'\] not among the covariates"):
        full.select(["output_tokens"])


def test_requests_without_a_user_are_clusters_of_one_in_the_moments():
    y = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    arm = ClusterSums.from_samples(y, np.array(["a", "a", None, None, "b"], dtype=object)).arm_moments()
    assert arm.clusters == 4 and arm.largest == 2 and arm.n == 5
    assert arm.cross[0, 0] == 2 * 2 + 1 + 1 + 1  # sum of n_g^2


@pytest.mark.parametrize(
    "change, message",
    [
        ({"cross": np.array([[2.0, 1.0], [0.0, 3.0]])}, "cross must be symmetric"),
        ({"total": np.array([2.0, 1.0, 0.0])}, "total has shape"),
        ({"clusters": 0}, "clusters must be a whole number >= 1"),
        ({"clusters": 3}, "cannot come from 3 users"),
        ({"largest": 3}, "cannot come from 1 users of at most 3|exceeds the requests"),
        ({"binary": True, "total": np.array([2.0, 3.0])}, "0/1 metric needs 0 <= sum <= n"),
        ({"sum_yy": -1.0}, "sum_yy must be a finite number >= 0"),
        ({"total": np.array([2.0, np.nan])}, "contains NaN"),
    ],
)
def test_bad_moments_are_refused_naming_the_field(change, message):
    fields = {
        "total": np.array([2.0, 1.0]),
        "cross": np.array([[4.0, 2.0], [2.0, 1.0]]),
        "clusters": 1,
        "largest": 2,
        **change,
    }
    with pytest.raises(ValueError, match=message):
        ArmMoments(**fields)


def test_adjusted_difference_refuses_mixing_arrays_and_moments():
    rng = np.random.default_rng(6)
    y, x, u = requests(rng, 50)
    arm = ArmData.from_samples(y, x, u)
    with pytest.raises(TypeError, match="both ArmData or both ArmMoments"):
        adjusted_difference(arm, arm.arm_moments())
