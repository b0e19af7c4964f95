"""A rollout step with an identical_answers guardrail reads the candidate's live requests the
gateway shadowed to the control (fidelity_shadows, under the step's config revision) as one row
however many users, and promotes, rolls back or holds on them; a store that cannot answer holds."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from analysis.definitions import Slo
from experiments import services
from experiments.models import AuditEntry
from experiments.weights.process import weights_store
from rollouts import controller as c
from rollouts import service
from rollouts.controller import Plan
from rollouts.readings import read_step
from stats.clustered import ArmMoments
from stats.sequential.guardrail_spec import Guardrail
from tests.rollouts.conftest import insert_step, shadow_rows
from tests.rollouts.test_readings import RowCounting

KEY = "rollout-demo"
IDENTICAL = {"metric": "identical_answers", "at_least": 0.95}


def answers(users: int, per_user: int, share_different: float, seed: int) -> list[list[int]]:
    """Each user's shadows, 1 = identical; differences spread at random over the shadows."""
    rng = np.random.default_rng(seed)
    flat = np.ones(users * per_user, dtype=int)
    flat[rng.choice(flat.size, round(flat.size * share_different), replace=False)] = 0
    return flat.reshape(users, per_user).tolist()


def plan(*guardrails: Guardrail, cluster_by_user: bool = True) -> Plan:
    return Plan(
        candidate="awq-fa2",
        control="fp16",
        steps=(10, 50, 100),
        min_samples=10,
        min_duration_s=0.0,
        guardrails=guardrails,
        on_breach="rollback",
        notify=(),
        alpha=0.05,
        cluster_by_user=cluster_by_user,
    )


@pytest.fixture(params=["chdb", "server"])
def store(request, shared_store):
    return shared_store(request.param)  # the session's migrated database, empty (tests/sample_dbs.py)


@pytest.mark.services
def test_the_step_reads_the_candidates_shadows_as_one_row_whatever_the_number_of_users(store):
    rev = 7
    got = answers(1500, 3, 0.02, seed=1)
    rows = shadow_rows(KEY, rev, got, not_ok=5)
    store.insert_fidelity_shadows(rows)
    store.insert_fidelity_shadows(rows[:200])  # a batch the gateway sent twice: collapsed
    store.insert_fidelity_shadows(shadow_rows(KEY, rev + 1, answers(50, 2, 0.5, seed=2)))  # next step
    store.insert_fidelity_shadows(shadow_rows(KEY, rev, answers(50, 2, 0.5, seed=3), variant="other"))
    store.insert_fidelity_shadows(shadow_rows("another", rev, answers(50, 2, 0.5, seed=4)))
    insert_step(store, KEY, rev, {"fp16": [100.0] * 20, "awq-fa2": [90.0] * 20})

    counting = RowCounting(store)
    reading = read_step(
        counting, KEY, rev, plan(Guardrail("identical_answers", "at_least", 0.95)), Slo(200.0), keep=False
    )
    assert reading.error == ""
    assert len(counting.rows) == 3 and counting.rows[-1] == 1  # totals, moments, shadows: one row
    assert max(counting.rows) == 2  # no query returns more than a row per arm
    shadows = reading.candidate.shadows
    assert reading.control.shadows is None
    # Expected, per user: a user of their own for each of the "" users' shadows (odd positions).
    n, y = [], []
    for u, mine in enumerate(got):
        for part in [[a] for a in mine] if u % 2 else [mine]:
            n.append(len(part))
            y.append(sum(part))
    want = ArmMoments.from_clusters(np.array(n), np.array(y), binary=True)
    assert shadows.counts() == {
        "shadowed": 4505,
        "ok": 4500,
        "identical": int(np.sum(y)),
        "users": len(n),
    }
    assert shadows.by_user and shadows.per_user.clusters == len(n) == 750 + 750 * 3
    assert shadows.per_user.largest == want.largest == 3
    np.testing.assert_allclose(shadows.per_user.total, want.total, rtol=1e-12)
    np.testing.assert_allclose(shadows.per_user.cross, want.cross, rtol=1e-12)

    # A plan without the guardrail reads no shadows.
    counting = RowCounting(store)
    without = read_step(
        counting, KEY, rev, plan(Guardrail("attainment", "at_least", 0.9)), Slo(200.0), keep=False
    )
    assert without.candidate.shadows is None and len(counting.rows) == 2
    # Users off (the experiment's analysis.cluster_by_user): the same counts, read as requests.
    off = dataclasses.replace(plan(Guardrail("identical_answers", "at_least", 0.95)), cluster_by_user=False)
    plain = read_step(store, KEY, rev, off, Slo(200.0)).candidate.shadows
    assert not plain.by_user and plain.per_user is None and plain.counts() == shadows.counts()


@pytest.mark.services
def test_a_step_without_shadows_reads_zero_and_a_store_that_fails_is_the_readings_error(store):
    reading = read_step(store, KEY, 3, plan(Guardrail("identical_answers", "at_least", 0.95)), Slo(200.0))
    assert reading.error == ""
    assert reading.candidate.shadows.counts() == {"shadowed": 0, "ok": 0, "identical": 0, "users": 0}

    class Broken(RowCounting):
        def query_columns(self, sql, params=None, *, settings=None):
            if "fidelity_shadows" in sql:
                raise OSError("connection reset by peer")
            return super().query_columns(sql, params, settings=settings)

    failed = read_step(
        Broken(store), KEY, 3, plan(Guardrail("identical_answers", "at_least", 0.95)), Slo(200.0)
    )
    assert failed.error == "OSError: connection reset by peer" and failed.candidate is None


# ---- the controller, end to end through the real stores ------------------------------------


def started(doc):
    doc["fidelity"] = {"shadow_share": 0.05}
    doc["rollout"]["guardrails"] = [{"metric": "attainment", "at_least": "sla_target"}, IDENTICAL]
    exp = services.apply_document(doc).experiment
    services.transition(exp, "start")
    first = service.look(KEY, interval_s=0)
    assert first.decision.action == c.START
    return weights_store().get(KEY)[1]


def look_at_a_healthy_step(doc, store, shadows: list[list[int]], *, not_ok: int = 0, notify: str = ""):
    """Start the rollout, record its first step's samples (fast, no error, enough of them) and
    the candidate's shadows, and look."""
    doc["rollout"]["notify"] = [notify] if notify else []
    rev = started(doc)
    insert_step(store, KEY, rev, {"fp16": [100.0] * 450, "awq-fa2": [90.0] * 60})
    store.insert_fidelity_shadows(shadow_rows(KEY, rev, shadows, not_ok=not_ok))
    return service.look(KEY, interval_s=0)


def stored() -> tuple[dict, int]:
    doc, revision = weights_store().get(KEY)
    return dict(doc.weights), revision


def identical_check(numbers: dict) -> dict:
    return next(ch for ch in numbers["verdict"]["checks"] if ch["metric"] == "identical_answers")


def through_the_controller(test):
    """The database (and its engine), and the local weights store: etcd's path is the same."""
    local = pytest.mark.parametrize("weights_backend", ["local"], indirect=True)
    return pytest.mark.django_db(pytest.mark.engine(local(test)))


@through_the_controller
def test_answers_identical_99_percent_of_the_time_pass_the_95_percent_guardrail(
    weights_backend, ch_store, rollout_document, receiver
):
    r = look_at_a_healthy_step(
        rollout_document, ch_store, answers(800, 2, 0.01, seed=5), not_ok=4, notify=receiver.url
    )
    assert r.decision.action == c.PROMOTE, r.note
    check = identical_check(r.decision.numbers)
    assert check["status"] == "ok" and check["inference"] == "user-clustered"
    assert check["interval"]["lo"] >= 0.95
    assert check["counts"] == {"shadowed": 1604, "ok": 1600, "identical": 1584, "users": 1200}
    entry = AuditEntry.objects.filter(experiment_key=KEY, action="rollout_promote").get()
    assert identical_check(entry.after["decision"]["numbers"])["counts"] == check["counts"]
    assert identical_check(receiver.bodies[-1]["numbers"])["counts"] == check["counts"]


@through_the_controller
def test_answers_identical_80_percent_of_the_time_roll_the_candidate_back(
    weights_backend, ch_store, rollout_document, receiver
):
    r = look_at_a_healthy_step(rollout_document, ch_store, answers(400, 2, 0.20, seed=6), notify=receiver.url)
    assert r.decision.action == c.ROLLBACK and r.percent == 0, r.note
    assert "identical_answers" in r.decision.reason
    assert stored()[0] == {"fp16": 100, "awq-fa2": 0}
    check = identical_check(r.decision.numbers)
    assert check["status"] == "breach" and check["interval"]["hi"] < 0.95
    assert check["counts"] == {"shadowed": 800, "ok": 800, "identical": 640, "users": 600}
    entry = AuditEntry.objects.filter(experiment_key=KEY, action="rollout_rollback").get()
    assert "identical_answers" in entry.reason
    assert identical_check(receiver.bodies[-1]["numbers"])["status"] == "breach"


@through_the_controller
def test_without_compared_shadows_the_step_holds_however_healthy_its_samples(
    weights_backend, ch_store, rollout_document
):
    r = look_at_a_healthy_step(rollout_document, ch_store, [], not_ok=30)  # the control never answered
    assert r.decision.action == c.HOLD, r.note
    assert "not yet shown to hold" in r.note and "identical_answers" in r.note
    check = identical_check(r.decision.numbers)
    assert check["status"] == "unclear"
    assert check["counts"] == {"shadowed": 30, "ok": 0, "identical": 0, "users": 0}


@through_the_controller
def test_the_sample_store_down_holds_a_step_with_the_guardrail(
    weights_backend, ch_store, rollout_document, settings
):
    from samples import factory

    started(rollout_document)
    settings.CLICKHOUSE_URL = "clickhouse://default:@127.0.0.1:9/nowhere"  # nothing listens on 9
    factory._cache.clear()
    before = stored()
    r = service.look(KEY, interval_s=0)
    assert r.decision.action == c.HOLD and "never promoting blind" in r.note
    assert stored() == before
    factory._cache.clear()
