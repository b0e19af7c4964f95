"""read_share called directly: what check_guardrail reports for a share guardrail is its reading
(stats.sequential.share_reading). How each reading behaves across many steps is tested through
check_guardrail and decide in test_sequential.py."""

from __future__ import annotations

import numpy as np
import pytest

from stats.sequential._base import DEFAULT_PRIOR
from stats.sequential.adjusted import DEFAULT_TARGET_N
from stats.sequential.arm_snapshot import ATTAINMENT, ERROR_RATE, ArmSnapshot, UserSums
from stats.sequential.guardrail_spec import Guardrail
from stats.sequential.guardrails import check_guardrail
from stats.sequential.means import MeanSequence, difference_interval
from stats.sequential.share_reading import (
    CLUSTERED,
    CLUSTERED_SHARE,
    MIN_EVENTS,
    REQUESTS,
    GuardrailReading,
    read_share,
)

MIN_CLUSTERS = 50


def users(n_users: int, per_user: int, hits_every: int, errors_every: int) -> ArmSnapshot:
    """An arm of ``n_users`` alike users, ``per_user`` requests each."""
    n = np.full(n_users, per_user)
    hits = np.array([per_user - per_user // hits_every - per_user // errors_every] * n_users)
    errors = np.full(n_users, per_user // errors_every)
    # users differ a little so the clustered variance is not 0
    hits[::2] -= 1
    sums = UserSums(n, hits, errors)
    return ArmSnapshot(int(n.sum()), int(hits.sum()), int(errors.sum()), per_user=sums)


def read(metric, over_control, control, candidate, alpha=0.01):
    """read_share of a guardrail on ``metric`` (the rule and limit play no part in the reading)."""
    g = Guardrail(metric, "at_most_over_control" if over_control else "at_least", 0.0)
    return read_share(g, control, candidate, alpha, DEFAULT_PRIOR, True, MIN_CLUSTERS, DEFAULT_TARGET_N)


def test_without_per_user_aggregates_the_exact_sequence_reads_at_the_whole_alpha():
    control, candidate = ArmSnapshot(1000, 950, 10), ArmSnapshot(800, 700, 40)
    got = read(ERROR_RATE, True, control, candidate)
    assert isinstance(got, GuardrailReading) and got.inference == REQUESTS
    assert got.note == "no per-user aggregates in this reading: requests read as independent draws"
    want = difference_interval(MeanSequence(1000, 10, 0.01), MeanSequence(800, 40, 0.01), 0.01)
    assert got.interval == want
    alone = read(ATTAINMENT, False, control, candidate)
    assert alone.interval == MeanSequence(800, 700, 0.01).interval()


def test_with_enough_users_the_clustered_sequence_reads_and_check_guardrail_reports_it():
    control, candidate = users(200, 20, 10, 20), users(200, 20, 8, 20)
    got = read(ATTAINMENT, False, control, candidate)
    assert got.inference == CLUSTERED and got.interval.alpha == pytest.approx(0.01 * CLUSTERED_SHARE)
    assert 0.0 <= got.interval.lo <= got.interval.hi <= 1.0
    check = check_guardrail(
        Guardrail(ATTAINMENT, "at_least", 0.5), control, candidate, 0.01, min_clusters=MIN_CLUSTERS
    )
    assert (check.interval, check.inference, check.inference_note) == (got.interval, got.inference, got.note)


def test_too_few_events_read_the_exact_sequence_at_the_rest_of_the_alpha_and_say_which_arm():
    control, candidate = users(200, 20, 10, 20), users(200, 20, 10, 1000)  # no candidate error
    got = read(ERROR_RATE, True, control, candidate)
    assert got.inference == REQUESTS and got.interval.alpha == pytest.approx(0.01 * (1 - CLUSTERED_SHARE))
    assert f"candidate has 0 errors and 4000 successes, not {MIN_EVENTS} of each" in got.note
