"""The weights store and the database agree when either write fails.

The store is written last inside the transaction; a store failure rolls the database back, and
a failure after the store write (the audit entry, a transition's listener, the COMMIT) undoes
the store write and audits the undo (experiments/weights/publish.py)."""

from __future__ import annotations

import pytest
from django.db import OperationalError, connections

from experiments import audit, services
from experiments.models import AuditEntry, Experiment
from experiments.signals import experiment_transitioned
from experiments.weights import process
from experiments.weights.errors import StoreUnavailable
from experiments.weights.publish import publish_weights

pytestmark = pytest.mark.engine

START = {"fp16": 34, "awq": 33, "awq-fa2": 33}
RAMP = {"fp16": 50, "awq": 30, "awq-fa2": 20}


@pytest.fixture
def running(experiment, users, weights_backend):
    services.transition(experiment, "start", users["product"], reason="go")
    experiment.refresh_from_db()
    return experiment


def stored(key="ttft-opt"):
    found = process.weights_store().get(key)
    return (dict(found[0].weights), found[1]) if found else None


def db_weights(key="ttft-opt") -> dict:
    return Experiment.objects.get(key=key).weights()


def actions() -> list[str]:
    return list(AuditEntry.objects.order_by("id").values_list("action", flat=True))


@pytest.fixture
def failing_commit():
    """Make the next COMMIT fail, as a database that goes away at that moment would."""
    wrapper = connections["default"]

    def fail():
        del wrapper.commit  # once: the class's commit again
        raise OperationalError("server closed the connection unexpectedly (test)")

    def arm():
        wrapper.commit = fail

    yield arm
    wrapper.__dict__.pop("commit", None)


def fail_audit_of(monkeypatch, action: str) -> None:
    real = audit.record

    def record(actor, experiment, what, **kwargs):
        if what == action:
            raise OperationalError(f"audit insert failed (test): {what}")
        return real(actor, experiment, what, **kwargs)

    monkeypatch.setattr(audit, "record", record)


# 1. The store write fails: the database rolls back -------------------------------------------


@pytest.mark.django_db
def test_a_store_write_that_fails_leaves_database_store_and_audit_as_they_were(running, users, monkeypatch):
    store = process.weights_store()
    before, log = stored(), actions()

    def down(*args):
        raise StoreUnavailable("down for the test")

    monkeypatch.setattr(store, "put_raw", down)
    with pytest.raises(StoreUnavailable, match="down for the test"):
        publish_weights(running, RAMP, users["sre"], "ramp")
    monkeypatch.undo()
    assert stored() == before and db_weights() == START and actions() == log


# 2. A failure after the store write: the store write is undone and audited ---------------------


@pytest.mark.django_db
def test_an_audit_entry_that_fails_after_the_store_write_undoes_it(running, users, monkeypatch):
    (weights, r1), log = stored(), actions()
    fail_audit_of(monkeypatch, "set_weights")
    with pytest.raises(OperationalError, match="audit insert failed"):
        publish_weights(running, RAMP, users["sre"], "ramp")
    now, r3 = stored()
    assert now == weights == START == db_weights()
    assert actions() == [*log, "weights_rolled_back"]
    entry = AuditEntry.objects.get(action="weights_rolled_back")
    r2 = entry.before["revision"]
    assert r1 < r2 < r3 and entry.before["weights"] == RAMP
    assert entry.after == {"revision": r3, "restored_revision": r1}
    assert entry.actor_name == "sam" and "audit insert failed" in entry.reason


@pytest.mark.django_db(transaction=True)
def test_a_commit_that_fails_after_the_store_write_undoes_it(running, users, failing_commit):
    r1, log = stored()[1], actions()
    failing_commit()
    with pytest.raises(OperationalError, match="closed the connection"):
        publish_weights(running, RAMP, users["sre"], "ramp")
    assert stored()[0] == START == db_weights()
    assert actions() == [*log, "weights_rolled_back"]  # no set_weights: it rolled back
    entry = AuditEntry.objects.get(action="weights_rolled_back")
    assert entry.before["weights"] == RAMP and entry.after["restored_revision"] == r1
    assert entry.after["revision"] == stored()[1]


@pytest.mark.django_db
def test_a_start_that_fails_after_publishing_leaves_no_weights(experiment, users, weights_backend):
    def refuse(**kwargs):
        raise RuntimeError("a listener refused the start")

    experiment_transitioned.connect(refuse)
    try:
        with pytest.raises(RuntimeError, match="refused the start"):
            services.transition(experiment, "start", users["product"])
    finally:
        experiment_transitioned.disconnect(refuse)
    experiment.refresh_from_db()
    assert experiment.status == "draft"
    assert stored() is None  # routers do not assign users of a draft
    assert actions() == ["create", "weights_rolled_back"]
    entry = AuditEntry.objects.get(action="weights_rolled_back")
    assert entry.before["weights"] == START and entry.after["restored_revision"] == 0


@pytest.mark.django_db(transaction=True)
def test_a_conclusion_whose_commit_fails_puts_the_weights_back(running, users, failing_commit):
    before = stored()
    failing_commit()
    with pytest.raises(OperationalError):
        services.transition(running, "conclude", users["product"])
    running.refresh_from_db()
    assert running.status == "running"
    assert stored()[0] == before[0]  # routers keep assigning a running experiment's users
    assert actions()[-1] == "weights_rolled_back" and "conclude" not in actions()


@pytest.mark.django_db
def test_a_conclusion_a_listener_refuses_puts_the_weights_back(running, users):
    def refuse(**kwargs):
        raise RuntimeError("replays could not be cancelled")

    experiment_transitioned.connect(refuse)
    try:
        with pytest.raises(RuntimeError):
            services.transition(running, "conclude", users["product"])
    finally:
        experiment_transitioned.disconnect(refuse)
    running.refresh_from_db()
    assert running.status == "running" and stored()[0] == START


# 3. The undo itself fails: the disagreement is audited for an SRE ------------------------------


@pytest.mark.django_db
def test_an_undo_the_store_refuses_is_audited_with_the_revision_left(running, users, monkeypatch, caplog):
    store = process.weights_store()
    fail_audit_of(monkeypatch, "set_weights")
    real_put = store.put_raw
    calls = []

    def put_then_go_down(key, raw, expected_revision):
        calls.append(expected_revision)
        if len(calls) > 1:
            raise StoreUnavailable("down for the test")
        return real_put(key, raw, expected_revision)

    monkeypatch.setattr(store, "put_raw", put_then_go_down)
    with pytest.raises(OperationalError, match="audit insert failed"):
        publish_weights(running, RAMP, users["sre"], "ramp")
    weights, revision = stored()
    assert weights == RAMP and db_weights() == START  # they disagree: the audit says so
    entry = AuditEntry.objects.get(action="weights_rollback_failed")
    assert entry.before == {"revision": revision, "weights": RAMP} and entry.after is None
    assert "down for the test" in entry.reason
    assert "could not be undone" in caplog.text and "set_weights" in caplog.text
