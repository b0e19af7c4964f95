"""The identical_answers guardrail: the candidate's share of shadowed live answers identical to
the control's, a one-arm share against a fixed limit read through the anytime-valid sequences
(stats.sequential.share_reading), with users as the unit when the shadows are read by user.

Simulated steps: users arrive with heavy-tailed request counts and answers alike within a user
(each user's own chance of an identical answer, drawn around the true share), and the
controller looks after every batch of users."""

from __future__ import annotations

import numpy as np
import pytest

from stats.clustered import ArmMoments
from stats.sequential.arm_snapshot import ArmSnapshot, Shadows
from stats.sequential.guardrail_spec import Guardrail
from stats.sequential.guardrails import BREACH, OK, PASS, UNCLEAR, UNDECIDED, check_guardrail, decide
from stats.sequential.share_reading import CLUSTERED, REQUESTS

ALPHA = 0.1
CONTROL = ArmSnapshot(0, 0, 0)  # the guardrail reads the candidate's shadows only
AT_LEAST_95 = Guardrail("identical_answers", "at_least", 0.95)


def candidate(shadows: Shadows, n: int = 0) -> ArmSnapshot:
    return ArmSnapshot(n, n, 0, shadows=shadows)


def shadows_of(n: np.ndarray, y: np.ndarray, *, by_user: bool, not_ok: int = 0) -> Shadows:
    """Shadows of users sending n compared shadows, y of them identical (and ``not_ok`` more)."""
    moments = ArmMoments.from_clusters(n, y, binary=True) if by_user else None
    big_n = int(n.sum())
    return Shadows(big_n + not_ok, big_n, int(y.sum()), int((n > 0).sum()), moments, by_user)


def simulate(share: float, limit: float, *, by_user: bool, runs: int = 300, seed: int = 0) -> dict:
    """Per run, 10 looks at 100, 200, ..., 1000 users: the share of runs with a breach at some
    look, with "ok" at some look, and with some look's interval missing the true share."""
    rng = np.random.default_rng(seed)
    g = Guardrail("identical_answers", "at_least", limit)
    looks, per_look = 10, 100
    seen = {"breach": 0, "ok": 0, "miss": 0}
    for _ in range(runs):
        users = looks * per_look
        n = 1 + np.minimum(rng.lognormal(0.0, 1.3, users).astype(int), 200)  # heavy users
        y = rng.binomial(n, rng.beta(share * 2.0, (1.0 - share) * 2.0, users))  # alike within a user
        run = {"breach": False, "ok": False, "miss": False}
        for k in range(1, looks + 1):
            m = k * per_look
            check = check_guardrail(g, CONTROL, candidate(shadows_of(n[:m], y[:m], by_user=by_user)), ALPHA)
            iv = check.interval
            run["breach"] |= check.status == BREACH
            run["ok"] |= check.status == OK
            run["miss"] |= (iv.lo is not None and iv.lo > share) or (iv.hi is not None and iv.hi < share)
        for key, hit in run.items():
            seen[key] += hit
    return {key: count / runs for key, count in seen.items()}


def test_at_the_limit_looked_at_every_batch_false_breaches_false_passes_and_misses_stay_within_alpha():
    by_user = simulate(0.95, 0.95, by_user=True)
    # the truth sits on the limit: a breach and an "ok" are both wrong
    assert by_user["breach"] <= ALPHA and by_user["ok"] <= ALPHA
    assert by_user["miss"] <= ALPHA
    # The same steps read as independent requests: overconfident, the error rates far above alpha.
    per_request = simulate(0.95, 0.95, by_user=False)
    assert per_request["miss"] > 1.5 * ALPHA and per_request["breach"] > ALPHA


@pytest.mark.parametrize("share, breach, ok", [(0.97, False, True), (0.90, True, False)])
def test_a_share_clear_of_the_limit_is_decided_on_its_side_and_the_sequence_covers_it(share, breach, ok):
    got = simulate(share, 0.95, by_user=True, seed=1)
    assert got["miss"] <= ALPHA
    wrong, right = ("ok", "breach") if breach else ("breach", "ok")
    assert got[wrong] == 0.0  # never decided on the wrong side
    assert got[right] >= 0.7  # and within 1000 users mostly decided on the right one


def test_a_heavy_user_repeating_their_requests_does_not_make_the_reading_more_certain():
    # Every user's requests (and outcomes) repeated 10 and 100 times: as many users, answers no
    # better known. Read by user the interval keeps its width; read per request it narrows by
    # sqrt(k) and "shows" the guardrail holds.
    rng = np.random.default_rng(3)
    n = rng.integers(1, 6, 300)
    y = rng.binomial(n, rng.beta(0.96 * 2, 0.04 * 2, 300))
    widths = {}
    for k in (1, 10, 100):
        for by_user in (True, False):
            check = check_guardrail(
                AT_LEAST_95, CONTROL, candidate(shadows_of(n * k, y * k, by_user=by_user)), 0.05
            )
            widths[k, by_user] = check.interval.hi - check.interval.lo
            assert check.interval.estimate == pytest.approx(y.sum() / n.sum())
            if by_user:
                assert (check.status, check.inference) == (UNCLEAR, CLUSTERED)
        assert widths[k, True] >= 0.7 * widths[1, True]
    assert widths[100, False] < 0.15 * widths[1, False]
    per_request = check_guardrail(
        AT_LEAST_95, CONTROL, candidate(shadows_of(n * 100, y * 100, by_user=False)), 0.05
    )
    assert per_request.status == OK and per_request.inference == REQUESTS


def test_no_compared_shadow_never_passes_the_step_and_the_numbers_count_the_rest():
    snap = candidate(Shadows(40, 0, 0, by_user=True), n=5000)
    full = ArmSnapshot(5000, 5000, 0)
    check = check_guardrail(AT_LEAST_95, full, snap, 0.05)
    assert check.status == UNCLEAR and check.interval.estimate is None
    assert check.counts == {"shadowed": 40, "ok": 0, "identical": 0, "users": 0}
    assert "0 identical of 0 compared" in check.message and "40 of 40 shadowed not compared" in check.message
    d = decide([Guardrail("attainment", "at_least", 0.9), AT_LEAST_95], full, snap, min_samples=100)
    assert d.decision == UNDECIDED and "not yet shown to hold" in d.reason and "identical_answers" in d.reason
    numbers = d.as_dict()["checks"][1]
    assert numbers["metric"] == "identical_answers" and numbers["counts"]["shadowed"] == 40


def test_a_step_passes_only_once_enough_identical_answers_show_the_limit_holds():
    rng = np.random.default_rng(5)
    full = ArmSnapshot(5000, 5000, 0)
    few = rng.binomial(1, 0.99, 30)  # 30 users, one shadow each: too few to show >= 95%
    d = decide([AT_LEAST_95], full, candidate(shadows_of(np.ones(30, int), few, by_user=True), 5000))
    assert d.decision == UNDECIDED and d.checks[0].inference == REQUESTS
    assert "too few for the user-clustered sequence" in d.checks[0].inference_note
    n = rng.integers(1, 8, 1500)
    y = rng.binomial(n, 0.99)
    d = decide([AT_LEAST_95], full, candidate(shadows_of(n, y, by_user=True, not_ok=12), 5000))
    assert d.decision == PASS and d.checks[0].status == OK and d.checks[0].inference == CLUSTERED
    assert d.checks[0].interval.lo >= 0.95
    assert d.checks[0].counts == {
        "shadowed": int(n.sum()) + 12,
        "ok": int(n.sum()),
        "identical": int(y.sum()),
        "users": 1500,
    }
    y = rng.binomial(n, 0.80)
    d = decide([AT_LEAST_95], full, candidate(shadows_of(n, y, by_user=True), 5000))
    assert d.decision == BREACH and d.checks[0].interval.hi < 0.95
    assert "candidate identical_answers" in d.reason and "limit >= 95.000%" in d.reason


def test_at_most_reads_the_same_interval_on_the_other_side():
    n = np.full(400, 3)
    y = np.random.default_rng(2).binomial(n, 0.5)
    snap = candidate(shadows_of(n, y, by_user=True))
    low = check_guardrail(Guardrail("identical_answers", "at_least", 0.95), CONTROL, snap, 0.05)
    high = check_guardrail(Guardrail("identical_answers", "at_most", 0.95), CONTROL, snap, 0.05)
    assert low.interval == high.interval
    assert (low.status, high.status) == (BREACH, OK)


def test_the_guardrail_and_its_shadows_refuse_bad_input_by_name():
    for rule in ("at_least_over_control", "at_most_over_control"):
        with pytest.raises(
            ValueError, match=f"{rule} does not apply: .*\\(the reference, identical to itself\\)"
        ):
            Guardrail("identical_answers", rule, 0.0)
    with pytest.raises(ValueError, match=r"at_least must be a share in \[0, 1\]"):
        Guardrail("identical_answers", "at_least", 95)
    with pytest.raises(ValueError, match="must be attainment, error_rate, identical_answers or a quantile"):
        Guardrail("identical_answer", "at_least", 0.95)
    with pytest.raises(ValueError, match="identical <= ok <= shadowed"):
        Shadows(10, 11, 0)
    with pytest.raises(ValueError, match="need their per-user moments"):
        Shadows(10, 10, 9, 4, None, by_user=True)
    with pytest.raises(ValueError, match="per-user moments hold"):
        Shadows(10, 10, 9, 3, ArmMoments.from_clusters([5, 5], [4, 5], binary=True))
    with pytest.raises(ValueError, match="needs the candidate's shadowed requests"):
        check_guardrail(AT_LEAST_95, CONTROL, ArmSnapshot(10, 10, 0), 0.05)
