"""The pure rollout decision (rollouts/controller.py), table-driven: every action, and the
numbers it carries."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments.document import validate_document
from rollouts import controller as c
from rollouts.controller import Plan, State, StepReading, StoreView, decide_step
from stats.sequential.arm_snapshot import ArmSnapshot, UserSums
from stats.sequential.quantiles import LatencyHistogram, latency_edges

EDGES = latency_edges(2_000.0, 1.0)


def plan_of(doc, **change) -> Plan:
    doc["rollout"].update(change)
    valid = validate_document(doc)
    return Plan.from_document(valid["rollout"], control="fp16", sla_target=valid["sla"]["target"])


def arm(n: int, miss: float = 0.0, err: float = 0.0, ttft: float = 100.0) -> ArmSnapshot:
    """n requests: a share ``err`` failed, a share ``miss`` slow (ttft 400 ms), the rest fast."""
    errors = int(round(n * err))
    slow = int(round(n * miss))
    fast = n - errors - slow
    hist = LatencyHistogram(EDGES).update(np.r_[np.full(fast, ttft), np.full(slow, 400.0)])
    return ArmSnapshot(n, fast, errors, {"ttft_ms": hist})


def reading(control: ArmSnapshot, candidate: ArmSnapshot, users=None) -> StepReading:
    return StepReading(control, candidate, users or {"fp16": control.n, "awq-fa2": candidate.n})


@pytest.fixture
def plan(rollout_document) -> Plan:
    return plan_of(rollout_document)


def test_the_plan_resolves_sla_target_and_splits_alpha_across_steps(plan):
    assert plan.guardrails[0].threshold == 0.95
    assert plan.step_alpha == pytest.approx(0.05 / 3)
    assert plan.weights_at(0) == {"fp16": 90, "awq-fa2": 10}
    assert plan.latencies() == ["ttft_ms"]


GOOD = StoreView({"fp16": 90, "awq-fa2": 10}, 7)


@pytest.mark.parametrize(
    ("name", "state", "store", "read", "now", "action", "to_step", "weights", "words"),
    [
        (
            "first look starts",
            State(),
            StoreView({"fp16": 100, "awq-fa2": 0}, 3),
            None,
            0,
            c.START,
            0,
            {"fp16": 90, "awq-fa2": 10},
            "starting the rollout at 10%",
        ),
        (
            "weights store down",
            State(step=0, last_seen_revision=7),
            StoreView(None, None, "etcd down"),
            None,
            0,
            c.HOLD,
            0,
            None,
            "weights store unavailable (etcd down)",
        ),
        (
            "sample store down",
            State(step=0, last_seen_revision=7),
            GOOD,
            StepReading(error="EOF"),
            0,
            c.HOLD,
            0,
            None,
            "never promoting blind",
        ),
        (
            "a person changed the weights",
            State(step=0, last_seen_revision=7),
            StoreView({"fp16": 80, "awq-fa2": 20}, 9),
            None,
            0,
            c.YIELD,
            0,
            None,
            "a person is in charge",
        ),
        (
            "same weights, newer revision",
            State(step=0, last_seen_revision=7),
            StoreView({"fp16": 90, "awq-fa2": 10}, 8),
            None,
            0,
            c.YIELD,
            0,
            None,
            "revision 7 -> 8",
        ),
        (
            "too few samples",
            State(step=0, step_started_s=0, last_seen_revision=7),
            GOOD,
            reading(arm(441), arm(49)),
            10,
            c.HOLD,
            0,
            None,
            "candidate has 49 of 50",
        ),
        (
            "healthy: promote",
            State(step=0, step_started_s=0, last_seen_revision=7),
            GOOD,
            reading(arm(900), arm(100)),
            10,
            c.PROMOTE,
            1,
            {"fp16": 50, "awq-fa2": 50},
            "promoting to 50%",
        ),
        (
            "healthy before 100: complete",
            State(step=1, step_started_s=0, last_seen_revision=7),
            StoreView({"fp16": 50, "awq-fa2": 50}, 7),
            reading(arm(500), arm(500)),
            10,
            c.COMPLETE,
            2,
            {"fp16": 0, "awq-fa2": 100},
            "awq-fa2 to 100%",
        ),
        (
            "slow candidate: rollback",
            State(step=0, step_started_s=0, last_seen_revision=7),
            GOOD,
            reading(arm(900), arm(100, miss=0.6)),
            10,
            c.ROLLBACK,
            None,
            {"fp16": 100, "awq-fa2": 0},
            "guardrail breached",
        ),
        (
            "failing candidate: rollback",
            State(step=0, step_started_s=0, last_seen_revision=7),
            GOOD,
            reading(arm(900), arm(100, err=0.5)),
            10,
            c.ROLLBACK,
            None,
            {"fp16": 100, "awq-fa2": 0},
            "error_rate",
        ),
        (
            "split broken: pause",
            State(step=0, step_started_s=0, last_seen_revision=7),
            GOOD,
            reading(arm(900), arm(100), users={"fp16": 500, "awq-fa2": 500}),
            10,
            c.PAUSE,
            0,
            None,
            "Sample ratio mismatch",
        ),
    ],
)
def test_decisions(plan, name, state, store, read, now, action, to_step, weights, words):
    d = decide_step(plan, state, store, read, now)
    assert d.action == action, (name, d.reason)
    assert d.to_step == to_step and d.weights == weights, name
    assert words in d.reason, (name, d.reason)


def test_breach_with_pause_in_the_plan_pauses_and_keeps_the_weights(rollout_document):
    plan = plan_of(rollout_document, on_breach="pause")
    d = decide_step(
        plan,
        State(step=0, step_started_s=0, last_seen_revision=7),
        GOOD,
        reading(arm(900), arm(100, miss=0.6)),
        10,
    )
    assert d.action == c.PAUSE and d.weights is None and d.state_after == c.PAUSED
    assert "paused per plan" in d.reason


def test_a_young_step_holds_until_min_duration(rollout_document):
    plan = plan_of(rollout_document, min_duration="10m")
    state = State(step=0, step_started_s=1000.0, last_seen_revision=7)
    young = decide_step(plan, state, GOOD, reading(arm(900), arm(100)), 1000.0 + 599)
    assert young.action == c.HOLD and "step has run 599 of 600 s" in young.reason
    old = decide_step(plan, state, GOOD, reading(arm(900), arm(100)), 1000.0 + 600)
    assert old.action == c.PROMOTE


def test_a_breach_needs_no_minimum(rollout_document):
    # Breaches are decided at any look: the sequences allow it.
    plan = plan_of(rollout_document, min_samples=10_000, min_duration="1h")
    d = decide_step(
        plan,
        State(step=0, step_started_s=0, last_seen_revision=7),
        GOOD,
        reading(arm(900), arm(100, err=0.6)),
        1,
    )
    assert d.action == c.ROLLBACK


def test_the_decision_carries_the_numbers(plan):
    d = decide_step(
        plan,
        State(step=0, step_started_s=0, last_seen_revision=7),
        GOOD,
        reading(arm(900, miss=0.01), arm(100, miss=0.6)),
        12,
    )
    v = d.numbers["verdict"]
    assert v["n_control"] == 900 and v["n_candidate"] == 100 and v["elapsed_s"] == 12
    attainment = next(ch for ch in v["checks"] if ch["metric"] == "attainment")
    assert attainment["status"] == "breach" and attainment["threshold"] == 0.95
    assert attainment["interval"]["estimate"] == pytest.approx(0.4)
    assert attainment["interval"]["hi"] < 0.95
    assert v["alpha"] == pytest.approx(plan.step_alpha)
    assert v["srm"]["counts"] == {"fp16": 900, "awq-fa2": 100}


def test_the_srm_evidence_carries_over_looks_within_a_step(plan):
    state = State(step=0, step_started_s=0, last_seen_revision=7)
    d1 = decide_step(plan, state, GOOD, reading(arm(900), arm(100), {"fp16": 870, "awq-fa2": 130}), 5)
    assert d1.srm_log_e > 0
    # The next look keeps the largest e-value seen (the anytime p-value only goes down).
    later = State(step=0, step_started_s=0, last_seen_revision=7, srm_max_log_e=d1.srm_log_e + 50)
    d2 = decide_step(plan, later, GOOD, reading(arm(900), arm(100)), 6)
    assert d2.action == c.PAUSE and d2.srm_log_e == pytest.approx(d1.srm_log_e + 50)


def test_a_single_step_plan_completes_at_once(rollout_document):
    plan = plan_of(rollout_document, steps=[100])
    d = decide_step(plan, State(), StoreView({"fp16": 100, "awq-fa2": 0}, 1), None, 0)
    assert d.action == c.COMPLETE and d.weights == {"fp16": 0, "awq-fa2": 100}


def test_a_stopped_rollout_is_not_decided(plan):
    with pytest.raises(ValueError, match="rollout is yielded"):
        decide_step(plan, State(status=c.YIELDED, step=0), GOOD, None, 0)


def test_a_look_without_a_reading_keeps_the_srm_evidence(plan):
    state = State(step=0, step_started_s=0, last_seen_revision=7, srm_max_log_e=3.5)
    for store, read in ((StoreView(None, None, "down"), None), (GOOD, StepReading(error="EOF"))):
        d = decide_step(plan, state, store, read, 5)
        assert d.action == c.HOLD and d.srm_log_e == 3.5


def users_arm(rng, users: int, n: int, miss_of_long: float = 0.0) -> ArmSnapshot:
    """n requests from ``users`` heavy-tailed users with their own prompt sizes, with per-user
    aggregates (rollouts.readings); a request on a long prompt misses the SLA with probability
    ``miss_of_long`` more."""
    w = rng.lognormal(0.0, 1.0, users)
    who = rng.choice(users, size=n, p=w / w.sum())
    prompt = np.maximum(rng.normal(1500.0, 500.0, users)[who] + rng.normal(0.0, 200.0, n), 1.0).round()
    max_tokens = rng.choice([256.0, 512.0], size=n)
    failed = rng.random(n) < 0.02
    hit = ~failed & (rng.random(n) > 0.05 + miss_of_long * (prompt > 2000))
    x = np.stack([prompt, max_tokens], axis=1)
    _, code = np.unique(who, return_inverse=True)
    g = int(code.max()) + 1

    def per_user(v):
        return np.bincount(code, weights=v, minlength=g)

    sums = UserSums(
        per_user(np.ones(n)).astype(int),
        per_user(hit).astype(int),
        per_user(failed).astype(int),
        ("prompt_tokens", "max_tokens"),
        np.stack([per_user(x[:, k]) for k in range(2)], 1),
        np.stack([np.stack([per_user(x[:, k] * x[:, m]) for m in range(2)], 1) for k in range(2)], 1),
        np.stack([per_user(x[:, k] * hit) for k in range(2)], 1),
        np.stack([per_user(x[:, k] * failed) for k in range(2)], 1),
    )
    hist = LatencyHistogram(EDGES).update(np.where(hit, 100.0, 400.0)[~failed])
    return ArmSnapshot(n, int(hit.sum()), int(failed.sum()), {"ttft_ms": hist}, sums)


def test_the_decision_json_names_the_inference_of_each_guardrail(rollout_document):
    rng = np.random.default_rng(7)
    rollout_document["rollout"]["guardrails"].append({"metric": "attainment", "at_least_over_control": -0.01})
    plan = plan_of(rollout_document)
    control, cand = users_arm(rng, 900, 9000), users_arm(rng, 100, 1000, miss_of_long=0.8)
    d = decide_step(
        plan,
        State(step=0, step_started_s=0, last_seen_revision=7),
        GOOD,
        reading(control, cand, {"fp16": 900, "awq-fa2": 100}),
        10,
    )
    assert d.action == c.ROLLBACK, d.reason
    out = json.loads(json.dumps(d.as_dict(), allow_nan=False))
    assert out["numbers"]["analysis"] == {"cluster_by_user": True, "adjust": True}
    checks = out["numbers"]["verdict"]["checks"]
    assert [ch["inference"] for ch in checks] == [
        "user-clustered",
        "user-clustered, adjusted",
        "order statistics",
        "user-clustered, adjusted",
    ]
    attainment_over = checks[3]
    assert attainment_over["status"] == "breach"
    assert attainment_over["covariates"] == ["prompt_tokens", "max_tokens"]
    assert 0.0 < attainment_over["variance_reduction"] < 1.0
    assert "user-clustered, adjusted on prompt_tokens, max_tokens, variance -" in attainment_over["message"]
    assert "not adjusted" in checks[2]["inference_note"] and checks[0]["variance_reduction"] is None

    # The experiment's analysis block turns the adjustment off: clustered, unadjusted, and said so.
    off = Plan.from_document(
        validate_document(rollout_document)["rollout"],
        control="fp16",
        sla_target=0.95,
        analysis={"adjust": False},
    )
    d = decide_step(
        off,
        State(step=0, step_started_s=0, last_seen_revision=7),
        GOOD,
        reading(control, cand, {"fp16": 900, "awq-fa2": 100}),
        10,
    )
    checks = d.as_dict()["numbers"]["verdict"]["checks"]
    assert d.numbers["analysis"] == {"cluster_by_user": True, "adjust": False}
    assert checks[3]["inference"] == "user-clustered" and "analysis.adjust" in checks[3]["inference_note"]
    # A reading without per-user aggregates (cluster_by_user off): every share read per request.
    bare = [ArmSnapshot(a.n, a.hits, a.errors, a.latencies) for a in (control, cand)]
    d = decide_step(
        plan,
        State(step=0, step_started_s=0, last_seen_revision=7),
        GOOD,
        reading(*bare, {"fp16": 900, "awq-fa2": 100}),
        10,
    )
    inference = [ch["inference"] for ch in d.as_dict()["numbers"]["verdict"]["checks"]]
    assert inference == ["requests", "requests", "order statistics", "requests"]
