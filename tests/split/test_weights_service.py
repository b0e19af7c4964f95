"""publish_weights and the set_weights / assign commands, over the local store and real etcd."""

from __future__ import annotations

import io
import time

import pytest
from django.core.management import CommandError, call_command

from experiments import services
from experiments.assignment import assign
from experiments.models import AuditEntry, Experiment
from experiments.weights import process
from experiments.weights.errors import ConflictError, StoreUnavailable, WeightsError
from experiments.weights.publish import UnknownExperimentError, preview_move, publish_weights
from experiments.weights.router import Router, UnknownExperiment

RAMP = {"fp16": 50, "awq": 30, "awq-fa2": 20}


@pytest.fixture
def running(experiment, users, weights_backend):
    """The demo experiment (34/33/33), started: its first weights are published."""
    services.transition(experiment, "start", users["product"], reason="go")
    experiment.refresh_from_db()
    return experiment


def stored(key="ttft-opt"):
    return process.weights_store().get(key)


@pytest.mark.engine
def test_starting_an_experiment_publishes_its_weights(running):
    doc, revision = stored()
    assert dict(doc.weights) == {"fp16": 34, "awq": 33, "awq-fa2": 33}
    assert doc.salt == running.salt and doc.control == "fp16" and revision > 0
    entry = AuditEntry.objects.get(action="set_weights")
    assert entry.reason == "experiment started" and entry.after["revision"] == revision


@pytest.mark.engine
def test_publish_rebalances_updates_variants_audits_and_moves_the_minimum(running, users):
    before, r1 = stored()
    doc, r2 = publish_weights(running, RAMP, users["sre"], "ramp fp16", expected_revision=r1)
    assert r2 > r1 and stored() == (doc, r2)
    assert running.weights() == RAMP
    entry = AuditEntry.objects.filter(action="set_weights", reason="ramp fp16").get()
    assert entry.actor_name == "sam" and entry.reason == "ramp fp16"
    assert entry.before == {"weights": dict(before.weights), "revision": r1}
    assert entry.after["revision"] == r2 and entry.after["moved_share"] == pytest.approx(0.16)
    assert doc.actor == "sam"
    # Users outside the moved buckets keep their variant.
    same = sum(
        assign(doc.salt, f"u{i}", before.allocation) == assign(doc.salt, f"u{i}", doc.allocation)
        for i in range(5000)
    )
    assert 0.80 < same / 5000 < 0.88  # 84 % expected


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"fp16": 50, "awq": 30, "gptq": 20}, "weights.gptq: unknown variant"),
        ({"fp16": 50, "awq": 50}, "weights: missing ['awq-fa2']"),
        ({"fp16": 70, "awq": 50, "awq-fa2": -20}, "weights.awq-fa2: must be >= 0, got -20"),
        ({"fp16": 50.5, "awq": 29.5, "awq-fa2": 20}, "weights.fp16: must be an integer percent"),
        ({"fp16": 50, "awq": 30, "awq-fa2": 30}, "weights: must sum to 100, got 110"),
    ],
)
def test_bad_weights_are_rejected_and_nothing_is_written(running, users, weights, message):
    before = stored()
    audited = AuditEntry.objects.count()
    with pytest.raises(WeightsError) as info:
        publish_weights(running, weights, users["sre"], "bad")
    assert any(message in e for e in info.value.errors), info.value.errors
    assert stored() == before
    assert running.weights() == {"fp16": 34, "awq": 33, "awq-fa2": 33}
    assert AuditEntry.objects.count() == audited


def test_weights_of_a_concluded_or_draft_or_unknown_experiment_cannot_change(
    experiment, users, weights_backend
):
    with pytest.raises(WeightsError, match="is a draft"):
        publish_weights(experiment, RAMP, users["sre"], "too early")
    services.transition(experiment, "start", users["product"])
    services.transition(experiment, "conclude", users["product"])
    assert stored() is None  # concluding retired the weights
    with pytest.raises(WeightsError, match="'ttft-opt' is concluded"):
        publish_weights("ttft-opt", RAMP, users["sre"], "too late")
    assert stored() is None
    with pytest.raises(UnknownExperimentError, match="unknown experiment 'nope'"):
        publish_weights("nope", RAMP, users["sre"], "who")


@pytest.mark.engine
def test_concluding_retires_the_weights_so_routers_stop_assigning(running, users):
    store = process.weights_store()
    router = Router(store)
    try:
        assert router.start(wait=10)
        assert router.assign("ttft-opt", "u1").variant in RAMP
        _doc, revision = stored()
        services.transition(running, "conclude", users["product"], reason="shipped awq")
        assert stored() is None
        entry = AuditEntry.objects.get(action="retire_weights")
        assert entry.reason == "experiment concluded" and entry.before == {"revision": revision}
        assert entry.after["weights"] is None and entry.after["revision"] > revision
        deadline = time.monotonic() + 10
        while "ttft-opt" in router.snapshot.entries and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(UnknownExperiment, match="no weights for experiment 'ttft-opt'"):
            router.assign("ttft-opt", "u1")
    finally:
        router.stop()


@pytest.mark.engine
def test_pausing_keeps_the_weights(running, users):
    before = stored()
    services.transition(running, "pause", users["product"])
    assert stored() == before
    assert not AuditEntry.objects.filter(action="retire_weights").exists()


@pytest.mark.engine
def test_a_conclusion_the_store_cannot_record_rolls_back(running, users, monkeypatch):
    store = process.weights_store()

    def down(key):
        raise StoreUnavailable(f"{store.description}: down for the test")

    monkeypatch.setattr(store, "delete", down)
    with pytest.raises(StoreUnavailable, match="down for the test"):
        services.transition(running, "conclude", users["product"])
    running.refresh_from_db()
    assert running.status == "running" and running.concluded_at is None
    assert stored() is not None
    assert not AuditEntry.objects.filter(action__in=["conclude", "retire_weights"]).exists()


def test_missing_reason_is_rejected(running, users):
    with pytest.raises(WeightsError, match="reason: required"):
        publish_weights(running, RAMP, users["sre"], "  ")


@pytest.mark.engine
def test_stale_expected_revision_is_a_conflict_and_nothing_is_written(running, users):
    _, r1 = stored()
    publish_weights(running, RAMP, users["sre"], "first sre", expected_revision=r1)
    after_first = stored()
    with pytest.raises(ConflictError, match=f"expected revision {r1}"):
        publish_weights(running, {"fp16": 10, "awq": 45, "awq-fa2": 45}, users["admin"], "second", r1)
    assert stored() == after_first
    assert running.weights() == RAMP


@pytest.mark.engine
def test_store_write_losing_the_race_rolls_back_the_database(running, users, monkeypatch):
    """Someone writes between our read and our compare-and-set: the CAS fails and the Variant
    rows and audit entry of our transaction are rolled back."""
    store = process.weights_store()
    real_put = store.put

    def racing_put(key, doc, expected_revision):
        current, revision = store.get(key)
        store.put_raw(key, current.dumps(), revision)  # a concurrent writer bumps the revision
        return real_put(key, doc, expected_revision)

    monkeypatch.setattr(store, "put", racing_put)
    audited = AuditEntry.objects.count()
    with pytest.raises(ConflictError):
        publish_weights(running, RAMP, users["sre"], "raced")
    assert running.weights() == {"fp16": 34, "awq": 33, "awq-fa2": 33}
    assert AuditEntry.objects.count() == audited


def test_preview_says_how_many_users_move_and_writes_nothing(running, users):
    before = stored()
    plan = preview_move("ttft-opt", RAMP, users["sre"], "look")
    assert plan.move.moved_share == pytest.approx(0.16)
    assert plan.current_revision == before[1]
    assert stored() == before


# Commands ----------------------------------------------------------------------------------


def run(*args, stdin: str | None = None) -> str:
    out = io.StringIO()
    kwargs = {"stdin": io.StringIO(stdin)} if stdin is not None else {}
    call_command(*args, stdout=out, stderr=io.StringIO(), **kwargs)
    return out.getvalue()


@pytest.mark.engine
def test_set_weights_shows_the_move_then_writes(running, users):
    out = run("set_weights", "ttft-opt", "fp16=50", "awq=30", "awq-fa2=20", "--reason", "ramp", "--as", "sam")
    assert "fp16      34 ->  50  *" in out
    assert "16.00% of users change variant" in out
    assert "written at revision" in out
    assert dict(stored()[0].weights) == RAMP and stored()[0].actor == "sam"


def test_set_weights_dry_run_writes_nothing(running):
    before = stored()
    out = run("set_weights", "ttft-opt", "fp16=50", "awq=30", "awq-fa2=20", "--reason", "x", "--dry-run")
    assert "dry run: nothing written" in out and stored() == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["fp16=50", "awq=30", "gptq=20"], "weights.gptq: unknown variant"),
        (["fp16=fifty", "awq=30", "awq-fa2=20"], "'fp16=fifty': weight must be an integer percent"),
        (["fp16", "awq=30"], "'fp16': expected VARIANT=PERCENT"),
        (["fp16=50", "fp16=50"], "variant 'fp16' given twice"),
        (["fp16=50", "awq=30", "awq-fa2=30"], "weights: must sum to 100, got 110"),
    ],
)
def test_set_weights_rejects_bad_input_and_writes_nothing(running, args, message):
    before = stored()
    with pytest.raises(CommandError, match="nothing changed") as info:
        run("set_weights", "ttft-opt", *args, "--reason", "x")
    assert message in str(info.value)
    assert stored() == before


@pytest.mark.engine
def test_set_weights_stale_revision_is_a_conflict(running):
    _, revision = stored()
    with pytest.raises(CommandError, match="conflict, nothing changed"):
        run(
            "set_weights",
            "ttft-opt",
            "fp16=50",
            "awq=30",
            "awq-fa2=20",
            "--reason",
            "x",
            "--expected-revision",
            str(revision - 1),
        )


def test_set_weights_unknown_experiment(weights_backend, db):
    with pytest.raises(CommandError, match="no experiment 'nope'"):
        run("set_weights", "nope", "a=100", "--reason", "x")


def test_assign_streams_one_line_per_user_matching_the_router(running):
    doc, revision = stored()
    users_in = [f"user-{i}" for i in range(3000)] + ["", "Ünïcødé"]
    out = run("assign", "ttft-opt", "--with-revision", stdin="\n".join(users_in) + "\n")
    lines = out.splitlines()
    assert len(lines) == 3001  # the empty line is skipped
    for line in lines:
        user, variant, rev = line.split("\t")
        assert variant == assign(doc.salt, user, doc.allocation) and int(rev) == revision
    plain = run("assign", "ttft-opt", stdin="user-1\r\nuser-2\n")
    assert plain == (
        f"user-1\t{assign(doc.salt, 'user-1', doc.allocation)}\n"
        f"user-2\t{assign(doc.salt, 'user-2', doc.allocation)}\n"
    )


def test_assign_unknown_experiment_fails_clearly(weights_backend, db):
    with pytest.raises(CommandError, match="no experiment 'nope'"):
        run("assign", "nope", stdin="u1\n")


def test_experiment_row_exists_for_these_tests(running):
    # guards the fixtures: the running experiment is the one the commands act on
    assert Experiment.objects.get(key="ttft-opt").status == "running"


def test_publishing_the_weights_already_stored_writes_no_revision_and_no_audit(running, users):
    _, r1 = stored()
    audits = AuditEntry.objects.filter(action="set_weights").count()
    doc, r2 = publish_weights(running, {"fp16": 34, "awq": 33, "awq-fa2": 33}, users["sre"], "same again")
    assert r2 == r1 and stored()[1] == r1 and dict(doc.weights) == {"fp16": 34, "awq": 33, "awq-fa2": 33}
    assert AuditEntry.objects.filter(action="set_weights").count() == audits
    assert preview_move(running, {"fp16": 34, "awq": 33, "awq-fa2": 33}).unchanged
    assert not preview_move(running, RAMP).unchanged


def test_set_weights_command_says_unchanged_and_writes_nothing(running):
    _, r1 = stored()
    out = io.StringIO()
    call_command("set_weights", "ttft-opt", "fp16=34", "awq=33", "awq-fa2=33", "--reason", "noop", stdout=out)
    assert f"unchanged: already at these weights (revision {r1}), nothing written" in out.getvalue()
    assert stored()[1] == r1


def test_assign_command_on_a_draft_names_its_status(experiment, weights_backend):
    with pytest.raises(CommandError, match="is a draft: its weights are published when it starts"):
        call_command("assign", "ttft-opt", stdin=io.StringIO("u1\n"), stdout=io.StringIO())
