"""A rollout step and setup errors (a 4xx the variant answered as configured or called, but 408
and 429): a step's reading counts them apart, no guardrail reads them, so a client's bad
requests never roll a candidate back; and a candidate that refuses what the control serves (every
request 401) is halted for a person to look, never promoted."""

from __future__ import annotations

import numpy as np
import pytest

from analysis.definitions import Slo
from rollouts import controller as c
from rollouts.controller import Plan, State, StepReading, StoreView, decide_step
from rollouts.readings import read_step
from samples import synthetic
from stats.sequential.arm_snapshot import ArmSnapshot
from stats.sequential.guardrail_spec import Guardrail
from stats.sequential.guardrails import BREACH, HALT, PASS, UNDECIDED, decide
from stats.sequential.setup_errors import setup_error_check
from tests.rollouts.test_controller import arm, plan_of

EXP, RUN, REV = "roll-setup", 10**12 + 31, 9
GUARDRAILS = (
    Guardrail("attainment", "at_least_over_control", -0.01),
    Guardrail("error_rate", "at_most_over_control", 0.005),
)


def _setup(snap: ArmSnapshot, k: int) -> ArmSnapshot:
    """The arm as read with k setup errors besides its judged requests."""
    return ArmSnapshot(snap.n, snap.hits, snap.errors, snap.latencies, snap.per_user, k)


def test_a_clients_bad_requests_never_breach_a_guardrail():
    """Read as errors, a bad client's 200 requests refused as 404 on the candidate alone would be
    a 4.8% error rate against the control's 0: a breach, a rollback. Apart, no guardrail sees
    them: at most the setup check pauses the step for a person (never a rollback); and with
    alike clients on both arms, as the router's random split gives, the step passes."""
    control, candidate = arm(4000), arm(4000)
    as_errors = ArmSnapshot(4200, 4000, 200, candidate.latencies)
    assert decide(GUARDRAILS, control, as_errors, min_samples=1000).decision == BREACH
    alone = decide(GUARDRAILS, control, _setup(candidate, 200), min_samples=1000)
    assert alone.decision != BREACH and all(ch.status != BREACH for ch in alone.checks)
    alike = decide(GUARDRAILS, _setup(control, 190), _setup(candidate, 200), min_samples=1000)
    assert alike.decision == PASS
    assert alike.setup is not None and not alike.setup.flagged
    assert (alike.setup.control, alike.setup.candidate) == (190, 200)


def test_a_candidate_answering_every_request_401_is_halted_never_promoted():
    control = arm(3000)
    for looked in (5, 50, 3000):  # from its first requests on
        candidate = _setup(ArmSnapshot(0, 0, 0, {}), looked)
        got = decide(GUARDRAILS, control, candidate, min_samples=0)
        assert got.decision == HALT, looked
        assert "setup error" in got.reason and "check its model name" in got.reason


def test_no_judged_request_never_passes_even_without_a_minimum():
    """Both arms refuse everything (the gateway's own credentials are wrong): nothing to tell
    them apart by, and nothing judged: undecided, not a pass on no evidence."""
    both = _setup(ArmSnapshot(0, 0, 0, {}), 500)
    got = decide(GUARDRAILS, both, both, min_samples=0)
    assert got.decision == UNDECIDED
    assert "0 of 1 samples (and 500 setup errors, not judged)" in got.reason


def test_the_setup_error_check_holds_its_alpha_when_both_arms_get_alike_bad_clients():
    """A/A: both arms refuse 1% of requests (alike clients); the check's false alarms stay
    below alpha over many simulated steps, however the shares fall."""
    rng = np.random.default_rng(3)
    flagged = 0
    trials = 400
    for _ in range(trials):
        n = int(rng.integers(200, 5000))
        k_c, k_v = rng.binomial(n, 0.01, size=2)
        control = ArmSnapshot(n - k_c, n - k_c, 0, {}, None, int(k_c))
        candidate = ArmSnapshot(n - k_v, n - k_v, 0, {}, None, int(k_v))
        check = setup_error_check(control, candidate, 0.05)
        flagged += check.flagged
    assert flagged / trials <= 0.05


def test_the_controller_pauses_a_misconfigured_candidate_and_keeps_the_weights(rollout_document):
    plan = plan_of(rollout_document)
    state = State(status=c.RUNNING, step=0, step_started_s=0.0, last_seen_revision=7)
    store = StoreView(revision=7, weights=plan.weights_at(0))
    refused = _setup(arm(0), 200)  # an empty latency histogram, as read_step gives
    d = decide_step(
        plan, state, store, StepReading(arm(1800), refused, {"fp16": 1800, "awq-fa2": 200}), 600.0
    )
    assert d.action == c.PAUSE and d.weights is None
    assert "setup error" in d.reason
    assert d.numbers["verdict"]["setup"]["flagged"] is True


@pytest.fixture(params=["chdb", "server"])
def store(request, shared_store):
    return shared_store(request.param)  # the session's migrated database, empty (tests/sample_dbs.py)


def test_a_steps_reading_counts_setup_errors_apart(store):
    spec = synthetic.SyntheticSpec(
        experiment=EXP,
        mode="split",
        n=3000,
        seed=4,
        run_id=RUN,
        config_revisions=(REV,),
        variants=[synthetic.VariantSpec("base", 50, {}, control=True), synthetic.VariantSpec("cand", 50, {})],
    )
    cols = synthetic.generate(spec).columns
    cols["mode"] = np.full(len(cols["mode"]), "live", dtype=object)
    cand_ok = np.flatnonzero((cols["variant"] == "cand") & (cols["outcome"] == "ok"))
    refused, load = cand_ok[:30], cand_ok[30:42]
    for rows, status in ((refused, 404), (load, 429)):
        cols["outcome"][rows] = "http_4xx"
        cols["http_status"][rows] = status
        for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
            cols[name][rows] = np.nan
    store.insert_columns(cols)
    for per_user in (False, True):
        plan = Plan(
            candidate="cand",
            control="base",
            steps=(5, 50, 100),
            min_samples=100,
            min_duration_s=0.0,
            guardrails=GUARDRAILS,
            on_breach="rollback",
            notify=(),
            alpha=0.05,
            cluster_by_user=per_user,
        )
        reading = read_step(store, EXP, REV, plan, Slo(200.0))
        assert reading.error == ""
        mine = cols["variant"] == "cand"
        judged = mine & ~np.isin(np.arange(mine.size), refused)
        cand = reading.candidate
        assert cand.setup_errors == 30 and reading.control.setup_errors == 0
        assert cand.n == int(judged.sum())
        assert cand.errors == int((judged & (cols["outcome"] != "ok")).sum())  # the 429s among them
        assert reading.users["cand"] == int(np.unique(cols["user_id"][mine]).size)  # refused users count
