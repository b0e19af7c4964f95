"""The controller's glue against the real stores: weights (local files and real etcd), samples
(the real ClickHouse server), the audit log, webhooks, the lease and the compare-and-set."""

from __future__ import annotations

import re
import threading
import types

import pytest
from django.core.management import call_command
from django.db import connections

from experiments import services
from experiments.models import AuditEntry, Experiment
from experiments.weights.process import weights_store
from experiments.weights.publish import publish_weights
from rollouts import controller as c
from rollouts import service
from rollouts.models import RolloutState
from tests.rollouts.conftest import Receiver, insert_step

pytestmark = [pytest.mark.django_db, pytest.mark.engine]

KEY = "rollout-demo"


def started(doc) -> Experiment:
    exp = services.apply_document(doc).experiment
    return services.transition(exp, "start")


def stored_weights() -> tuple[dict, int]:
    doc, revision = weights_store().get(KEY)
    return dict(doc.weights), revision


def actions() -> list[str]:
    return list(
        AuditEntry.objects.filter(experiment_key=KEY, action__startswith="rollout_")
        .order_by("at", "id")
        .values_list("action", flat=True)
    )


def healthy(n_control: int, n_candidate: int) -> dict:
    return {"fp16": [100.0] * n_control, "awq-fa2": [90.0] * n_candidate}


def test_a_healthy_candidate_promotes_step_by_step_to_100(
    weights_backend, ch_store, rollout_document, receiver
):
    rollout_document["rollout"]["notify"] = [receiver.url]
    started(rollout_document)
    assert stored_weights()[0] == {"fp16": 100, "awq-fa2": 0}

    first = service.look(KEY, interval_s=0)
    assert first.decision.action == c.START and first.percent == 10
    weights, rev1 = stored_weights()
    assert weights == {"fp16": 90, "awq-fa2": 10} and first.revision == rev1

    # Too few samples under this step's revision: hold. Samples of another revision do not count.
    seq = insert_step(ch_store, KEY, rev1, healthy(90, 10))
    seq = insert_step(ch_store, KEY, rev1 + 1000, healthy(0, 500), seq0=seq)
    held = service.look(KEY, interval_s=0)
    assert held.decision.action == c.HOLD, held.note
    assert "candidate has 10 of 50" in held.note

    seq = insert_step(ch_store, KEY, rev1, healthy(360, 40), seq0=seq)
    promoted = service.look(KEY, interval_s=0)
    assert promoted.decision.action == c.PROMOTE, promoted.note
    weights, rev2 = stored_weights()
    assert weights == {"fp16": 50, "awq-fa2": 50} and rev2 > rev1 and promoted.step == 1

    seq = insert_step(ch_store, KEY, rev2, healthy(200, 200), seq0=seq)
    done = service.look(KEY, interval_s=0)
    assert done.decision.action == c.COMPLETE and done.status == c.COMPLETED, done.note
    assert stored_weights()[0] == {"fp16": 0, "awq-fa2": 100}
    # The database's Variant rows follow the store (publish_weights).
    assert Experiment.objects.get(key=KEY).weights() == {"fp16": 0, "awq-fa2": 100}
    # Finished: later looks decide nothing.
    after = service.look(KEY, interval_s=0)
    assert after.decision is None and "completed" in after.note

    assert actions() == ["rollout_start", "rollout_hold", "rollout_promote", "rollout_complete"]
    assert [b["action"] for b in receiver.bodies] == ["start", "hold", "promote", "complete"]
    last = receiver.bodies[-1]
    assert last["experiment"] == KEY and last["weights"] == {"fp16": 0, "awq-fa2": 100}
    assert last["numbers"]["verdict"]["n_candidate"] == 200


def test_a_slow_candidate_is_rolled_back_and_the_audit_and_webhook_say_why(
    weights_backend, ch_store, rollout_document, receiver
):
    rollout_document["rollout"]["notify"] = [receiver.url]
    started(rollout_document)
    service.look(KEY, interval_s=0)
    _, rev1 = stored_weights()
    insert_step(ch_store, KEY, rev1, {"fp16": [100.0] * 270, "awq-fa2": [400.0] * 25 + [None] * 5})
    r = service.look(KEY, interval_s=0)
    assert r.decision.action == c.ROLLBACK and r.status == c.ROLLED_BACK and r.percent == 0
    assert stored_weights()[0] == {"fp16": 100, "awq-fa2": 0}
    entry = AuditEntry.objects.filter(experiment_key=KEY, action="rollout_rollback").get()
    assert "guardrail breached" in entry.reason and "attainment" in entry.reason
    checks = {ch["metric"]: ch for ch in entry.after["decision"]["numbers"]["verdict"]["checks"]}
    assert checks["attainment"]["status"] == "breach" and checks["attainment"]["interval"]["estimate"] == 0.0
    # The step read per-user aggregates (the default analysis), but 30 candidate users are too few
    # for the clustered sequence: the exact one decided, and the entry says so.
    assert entry.after["decision"]["numbers"]["analysis"] == {"cluster_by_user": True, "adjust": True}
    assert checks["attainment"]["inference"] == "requests"
    assert "candidate has 30 users of the 50" in checks["attainment"]["inference_note"]
    assert checks["p99_ttft_ms"]["inference"] == "order statistics"
    assert entry.actor_name == "rollout-controller"
    body = receiver.bodies[-1]
    assert body["action"] == "rollback" and body["percent"] == 0 and "guardrail breached" in body["reason"]


def test_a_person_changing_the_weights_between_looks_makes_the_controller_yield(
    weights_backend, ch_store, rollout_document, users
):
    started(rollout_document)
    service.look(KEY, interval_s=0)
    _, rev1 = stored_weights()
    _, human = publish_weights(KEY, {"fp16": 70, "awq-fa2": 30}, users["sre"], "hand tuning")
    insert_step(ch_store, KEY, rev1, healthy(450, 50))
    r = service.look(KEY, interval_s=0)
    assert r.decision.action == c.YIELD and r.status == c.YIELDED
    assert stored_weights() == ({"fp16": 70, "awq-fa2": 30}, human)  # untouched
    again = service.look(KEY, interval_s=0)
    assert again.decision is None and stored_weights()[1] == human
    assert (
        "a person is in charge" in AuditEntry.objects.get(experiment_key=KEY, action="rollout_yield").reason
    )


def test_a_write_racing_the_controller_wins_and_the_controller_yields(
    weights_backend, ch_store, rollout_document, users, monkeypatch
):
    """The person writes after the controller read the store but before its compare-and-set."""
    started(rollout_document)
    service.look(KEY, interval_s=0)
    _, rev1 = stored_weights()
    insert_step(ch_store, KEY, rev1, healthy(450, 50))
    real = service.controller.decide_step

    def decide_then_person_writes(*args, **kw):
        d = real(*args, **kw)
        publish_weights(KEY, {"fp16": 95, "awq-fa2": 5}, users["sre"], "back off a bit")
        return d

    monkeypatch.setattr(service.controller, "decide_step", decide_then_person_writes)
    r = service.look(KEY, interval_s=0)
    assert r.decision.action == c.PROMOTE and r.status == c.YIELDED, r.note
    assert "yields" in r.note
    assert stored_weights()[0] == {"fp16": 95, "awq-fa2": 5}


def test_the_sample_store_down_holds_and_is_audited(weights_backend, rollout_document, settings):
    settings.CLICKHOUSE_URL = "clickhouse://default:@127.0.0.1:9/nowhere"  # nothing listens on 9
    from samples import factory

    factory._cache.clear()
    started(rollout_document)
    service.look(KEY, interval_s=0)
    before = stored_weights()
    r = service.look(KEY, interval_s=0)
    assert r.decision.action == c.HOLD and "never promoting blind" in r.note
    assert stored_weights() == before
    assert actions()[-1] == "rollout_hold"
    factory._cache.clear()


def test_the_weights_store_down_holds(rollout_document, settings, ch_store):
    started(rollout_document)
    service.look(KEY, interval_s=0)
    from experiments.weights import process

    settings.ETCD_ENDPOINTS = [("127.0.0.1", 9)]  # an etcd that does not answer
    process.reset_for_tests()
    r = service.look(KEY, interval_s=0)
    assert r.decision.action == c.HOLD and "weights store unavailable" in r.note
    assert RolloutState.objects.get(experiment__key=KEY).step == 0


def test_one_decision_per_interval_however_many_controllers(weights_backend, ch_store, rollout_document):
    started(rollout_document)
    results, errors = [], []
    barrier = threading.Barrier(4)

    def controller_process():
        try:
            barrier.wait()
            results.append(service.look(KEY, interval_s=60))
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=controller_process) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    decided = [r for r in results if r.decision is not None]
    assert len(decided) == 1, [r.note for r in results]
    assert all("not due" in r.note for r in results if r.decision is None)
    assert actions() == ["rollout_start"]
    # Within the interval a later look (e.g. by hand) is refused too.
    assert service.look(KEY, interval_s=60).decision is None


# Threads need committed rows: this one test runs outside the test transaction.
test_one_decision_per_interval_however_many_controllers = pytest.mark.django_db(transaction=True)(
    test_one_decision_per_interval_however_many_controllers
)


class Killed(BaseException):
    pass


def kill_after_the_store_write(monkeypatch) -> None:
    """One look that dies between its weights-store write and its database commit."""
    real_audit = service._audit

    def die_before_commit(experiment, action, *a, **kw):
        if action == "rollout_promote":
            raise Killed  # the process dies: its transaction never commits
        return real_audit(experiment, action, *a, **kw)

    with monkeypatch.context() as m:
        # A killed process runs no undo of its store write.
        m.setattr("experiments.weights.publish._on_failure", lambda undo: None)
        m.setattr(service, "_audit", die_before_commit)
        with pytest.raises(Killed):
            service.look(KEY, interval_s=0)


def test_a_controller_killed_after_its_store_write_does_not_step_twice(
    weights_backend, ch_store, rollout_document, monkeypatch
):
    started(rollout_document)
    service.look(KEY, interval_s=0)
    _, rev1 = stored_weights()
    insert_step(ch_store, KEY, rev1, healthy(450, 50))

    kill_after_the_store_write(monkeypatch)
    weights, rev2 = stored_weights()
    assert weights == {"fp16": 50, "awq-fa2": 50}  # the write landed
    state = RolloutState.objects.get(experiment__key=KEY)
    assert state.step == 0 and state.last_seen_revision == rev1 and state.pending["to_step"] == 1

    r = service.look(KEY, interval_s=0)
    assert r.decision is None and "adopted, no second step" in r.note
    state.refresh_from_db()
    assert (state.step, state.last_seen_revision, state.status, state.pending) == (1, rev2, c.RUNNING, None)
    assert Experiment.objects.get(key=KEY).weights() == {"fp16": 50, "awq-fa2": 50}
    # The next look reads the new step's (empty) samples: a hold, not another promotion.
    nxt = service.look(KEY, interval_s=0)
    assert nxt.decision.action == c.HOLD and stored_weights() == (weights, rev2)
    assert actions() == ["rollout_start", "rollout_recovered", "rollout_hold"]


def test_a_failing_webhook_is_audited_and_does_not_undo_the_decision(
    weights_backend, ch_store, rollout_document
):
    broken = Receiver(status=500)
    try:
        rollout_document["rollout"]["notify"] = [broken.url, "http://127.0.0.1:9/nothing-listens"]
        started(rollout_document)
        r = service.look(KEY, interval_s=0)
    finally:
        broken.close()
    assert r.decision.action == c.START and stored_weights()[0] == {"fp16": 90, "awq-fa2": 10}
    assert [n.get("error", "")[:8] for n in r.notified][0] == "HTTP 500"
    assert "ConnectError" in r.notified[1]["error"]
    failed = AuditEntry.objects.get(experiment_key=KEY, action="rollout_notify_failed")
    assert len(failed.after["webhooks"]) == 2


def test_the_command_prints_state_decision_and_why(weights_backend, ch_store, rollout_document, capsys):
    import io
    import json

    started(rollout_document)
    out = io.StringIO()
    call_command("rollout", KEY, "--once", "--interval", "0", stdout=out)
    text = out.getvalue()
    assert "rollout running, step 1 (10%)" in text and "decision: start" in text
    out = io.StringIO()
    call_command("rollout", KEY, "--once", "--json", "--interval", "0", stdout=out)
    doc = json.loads(out.getvalue())
    assert doc["decision"]["action"] == "hold" and doc["status"] == "running" and doc["percent"] == 10
    assert "candidate has 0 of 50" in doc["note"]


def test_the_command_names_an_experiment_without_a_plan(rollout_document):
    from django.core.management.base import CommandError

    del rollout_document["rollout"]
    started(rollout_document)
    with pytest.raises(CommandError, match="has no rollout plan"):
        call_command("rollout", KEY, "--once")


def test_the_periodic_task_looks_at_every_running_rollout(
    weights_backend, ch_store, rollout_document, settings
):
    from rollouts.tasks import rollout_tick

    settings.ROLLOUT_INTERVAL_S = 60
    started(rollout_document)
    assert rollout_tick() == {KEY: "start"}
    assert "not due" in rollout_tick()[KEY]  # the same interval: no second decision


def test_the_timeline_page_shows_each_decision_with_its_numbers(
    weights_backend, ch_store, rollout_document, users, client
):
    started(rollout_document)
    service.look(KEY, interval_s=0)
    _, rev1 = stored_weights()
    insert_step(ch_store, KEY, rev1, {"fp16": [100.0] * 270, "awq-fa2": [400.0] * 30})
    service.look(KEY, interval_s=0)
    url = f"/rollouts/{KEY}/"
    assert client.get(url).status_code == 302  # anonymous: to the login page
    client.force_login(users["nobody"])
    assert client.get(url).status_code == 403
    client.force_login(users["analyst"])
    page = client.get(url)
    assert page.status_code == 200
    html = page.content.decode()
    assert 'id="rollout-status">rolled_back<' in html
    assert html.index('class="action-rollback"') < html.index('class="action-start"')  # newest first
    assert "270 / 30" in html and 'class="breach"' in html and "candidate attainment 0.000%" in html
    assert client.get("/rollouts/no-such-experiment/").status_code == 404


def test_the_admin_lists_the_state_read_only(weights_backend, ch_store, rollout_document, users, client):
    started(rollout_document)
    service.look(KEY, interval_s=0)
    client.force_login(users["admin"])
    page = client.get("/admin/rollouts/rolloutstate/")
    assert page.status_code == 200 and f"/rollouts/{KEY}/" in page.content.decode()
    state = RolloutState.objects.get(experiment__key=KEY)
    change = client.get(f"/admin/rollouts/rolloutstate/{state.pk}/change/").content.decode()
    assert 'type="submit"' not in change or 'name="_save"' not in change


def test_an_etcd_restart_mid_step_holds_then_carries_on(private_etcd, settings, ch_store, rollout_document):
    from experiments.weights import process
    from tests.split.conftest import PRIVATE_ETCD_PORT

    settings.ETCD_ENDPOINTS = [("127.0.0.1", PRIVATE_ETCD_PORT)]
    settings.ETCD_PREFIX = "/abplat-test/private/"
    process.reset_for_tests()
    started(rollout_document)
    assert service.look(KEY, interval_s=0).decision.action == c.START
    _, rev1 = stored_weights()
    private_etcd.stop()
    down = service.look(KEY, interval_s=0)
    assert down.decision.action == c.HOLD and "weights store unavailable" in down.note
    private_etcd.start()
    insert_step(ch_store, KEY, rev1, healthy(450, 50))
    up = service.look(KEY, interval_s=0)
    assert up.decision.action == c.PROMOTE, up.note
    assert stored_weights()[0] == {"fp16": 50, "awq-fa2": 50}
    process.reset_for_tests()


def test_the_lease_and_step_age_follow_the_database_clock_not_the_hosts(
    weights_backend, ch_store, rollout_document, monkeypatch
):
    """A host whose clock runs an hour ahead neither takes the lease early nor ages a step."""
    import time as time_module

    started(rollout_document)
    assert service.look(KEY, interval_s=60).decision.action == c.START
    real = time_module.time
    monkeypatch.setattr(time_module, "time", lambda: real() + 3600)
    skewed = service.look(KEY, interval_s=60)
    assert skewed.decision is None and "not due" in skewed.note
    RolloutState.objects.filter(experiment__key=KEY).update(lease_until_s=0)
    # A plan changed mid-rollout: export, edit, apply (the weights are the controller's now).
    current = services.export_document(Experiment.objects.get(key=KEY))
    current["rollout"]["min_duration"] = "10m"
    services.apply_document(current)
    _, rev1 = stored_weights()
    insert_step(ch_store, KEY, rev1, healthy(450, 50))
    young = service.look(KEY, interval_s=60)
    assert young.decision.action == c.HOLD, young.note
    # aged by the database's clock (a second or so, the test's own time), not the host's hour
    ran = re.search(r"step has run (\d+) of 600 s", young.note)
    assert ran is not None and int(ran.group(1)) < 60, young.note


def test_webhooks_are_checked_again_when_sent(
    weights_backend, ch_store, rollout_document, receiver, settings
):
    """The allowlist may shrink after the document was applied, and a name may resolve inward:
    such webhooks are refused at send time, audited, and the decision stands."""
    port = receiver.url.split(":")[2].split("/")[0]
    rollout_document["rollout"]["notify"] = [receiver.url, f"https://localhost:{port}/hook"]
    started(rollout_document)
    settings.VARIANT_ALLOWED_HOSTS = ["10.9.9.9"]
    r = service.look(KEY, interval_s=0)
    assert r.decision.action == c.START and stored_weights()[0] == {"fp16": 90, "awq-fa2": 10}
    assert receiver.bodies == []  # nothing reached the receiver
    errors = [n["error"] for n in r.notified]
    assert "outside the variant allowlist" in errors[0] and "plain http" in errors[0]
    assert "non-public addresses" in errors[1]
    assert AuditEntry.objects.filter(experiment_key=KEY, action="rollout_notify_failed").count() == 1
    settings.VARIANT_ALLOWED_HOSTS = ["127.0.0.0/8"]
    service.look(KEY, interval_s=0)
    assert [b["action"] for b in receiver.bodies] == ["hold"]


def test_a_killed_look_then_etcd_down_keeps_the_pending_change_until_it_can_tell(
    private_etcd, settings, ch_store, rollout_document, monkeypatch
):
    from experiments.weights import process
    from tests.split.conftest import PRIVATE_ETCD_PORT

    settings.ETCD_ENDPOINTS = [("127.0.0.1", PRIVATE_ETCD_PORT)]
    settings.ETCD_PREFIX = "/abplat-test/private/"
    process.reset_for_tests()
    started(rollout_document)
    service.look(KEY, interval_s=0)
    _, rev1 = stored_weights()
    insert_step(ch_store, KEY, rev1, healthy(450, 50))
    kill_after_the_store_write(monkeypatch)
    private_etcd.stop()
    down = service.look(KEY, interval_s=0)
    assert down.decision.action == c.HOLD
    assert RolloutState.objects.get(experiment__key=KEY).pending["to_step"] == 1
    private_etcd.start()
    up = service.look(KEY, interval_s=0)
    assert up.decision is None and "adopted, no second step" in up.note, up.note
    state = RolloutState.objects.get(experiment__key=KEY)
    assert (state.step, state.status, state.pending) == (1, c.RUNNING, None)
    assert stored_weights()[0] == {"fp16": 50, "awq-fa2": 50}
    process.reset_for_tests()


def test_the_plan_follows_the_experiments_analysis_block(rollout_document):
    rollout_document["analysis"] = {"adjust": False}
    plan = service.plan_of(services.apply_document(rollout_document).experiment)
    assert (plan.cluster_by_user, plan.adjust) == (True, False)
    rollout_document["analysis"] = {"cluster_by_user": False}
    plan = service.plan_of(services.apply_document(rollout_document).experiment)
    assert (plan.cluster_by_user, plan.adjust) == (False, True)
    # Anything without the block (or with it as a mapping) reads leniently: both on by default.
    assert service.analysis_of(types.SimpleNamespace()) == {"cluster_by_user": True, "adjust": True}
    assert service.analysis_of(types.SimpleNamespace(analysis={"adjust": False}))["adjust"] is False


def test_looks_read_the_step_through_its_kept_sums_unless_turned_off(
    weights_backend, ch_store, rollout_document, settings, monkeypatch
):
    import json

    from rollouts import readings
    from samples.schema import ROLLOUT_FOLDS_TABLE

    def folds() -> list[dict]:
        rows = ch_store.query(
            f"SELECT state FROM {ROLLOUT_FOLDS_TABLE} WHERE experiment = %(e)s AND state != '' "
            "ORDER BY generation, fold",
            {"e": KEY},
        )
        return [json.loads(r[0]) for r in rows]

    started(rollout_document)
    service.look(KEY, interval_s=0)
    _, rev1 = stored_weights()
    insert_step(ch_store, KEY, rev1, {"fp16": [100.0] * 80 + [None] * 10, "awq-fa2": [90.0] * 10})
    settings.ROLLOUT_KEPT_SUMS = False
    whole = service.look(KEY, interval_s=0)
    assert whole.decision.action == c.HOLD and folds() == []
    # ten minutes on, every sample is older than the kept sums' lag: the look keeps them all
    later = readings.time.time() + 600
    monkeypatch.setattr(readings, "time", types.SimpleNamespace(time=lambda: later))
    settings.ROLLOUT_KEPT_SUMS = True
    settings.ROLLOUT_KEPT_LAG_S = 45
    through = service.look(KEY, interval_s=0)
    assert through.decision.action == c.HOLD and through.note == whole.note
    a, b = (dict(r.decision.as_dict()["numbers"]["verdict"]) for r in (whole, through))
    assert a.pop("elapsed_s") < b.pop("elapsed_s")  # the step's age, by the database's clock
    assert a == b and a["n_control"] == 90
    assert [f["rows"] for f in folds()] == [100]
    upto = ch_store.query(
        f"SELECT upto_ms FROM {ROLLOUT_FOLDS_TABLE} WHERE experiment = %(e)s AND state != ''", {"e": KEY}
    )
    assert upto == [(int(later * 1000) - 45_000,)]  # kept up to now less the setting's lag


def test_a_finished_rollout_leaves_none_of_its_kept_sums(
    weights_backend, ch_store, rollout_document, settings
):
    # Its index would hold the store's memory until the experiment's next rollout.
    from analysis.definitions import Slo
    from rollouts import kept
    from samples.schema import ROLLOUT_FOLDS_TABLE, ROLLOUT_SUMS_INDEX_PREFIX, ROLLOUT_USER_SUMS_TABLE

    def indexes() -> list[str]:
        prefix = f"{ROLLOUT_SUMS_INDEX_PREFIX}{kept._experiment_key(KEY)}_"
        rows = ch_store.query(
            "SELECT name FROM system.tables WHERE database = currentDatabase() AND startsWith(name, %(p)s)",
            {"p": prefix},
        )
        return [r[0] for r in rows]

    def removals() -> dict[str, int]:
        # the mutations removing every row of the experiment (a step's own forget others, AND NOT)
        rows = ch_store.query(
            "SELECT table, count() FROM system.mutations WHERE database = currentDatabase() "
            "AND position(command, %(k)s) > 0 AND position(command, ' AND ') = 0 GROUP BY table",
            {"k": f"experiment = '{KEY}'"},
        )
        return dict(rows)

    settings.ROLLOUT_KEPT_SUMS = True
    other = "kept-other-rollout"
    kept.KeptStep(ch_store, other, 1, ("a", "b"), Slo(200.0), ()).read(10**12)  # another experiment's
    started(rollout_document)
    service.look(KEY, interval_s=0)
    _, rev1 = stored_weights()
    seq = insert_step(ch_store, KEY, rev1, {"fp16": [100.0] * 270, "awq-fa2": [90.0] * 10})
    held = service.look(KEY, interval_s=0)
    assert held.status == c.RUNNING and len(indexes()) == 1  # the look kept the step's sums
    insert_step(ch_store, KEY, rev1, {"fp16": [100.0] * 30, "awq-fa2": [400.0] * 50 + [None] * 10}, seq0=seq)
    removals_before = removals()
    r = service.look(KEY, interval_s=0)
    assert r.decision.action == c.ROLLBACK and r.status == c.ROLLED_BACK
    assert indexes() == []
    # the rows go by mutations the store applies in the background: one more asked of each table
    assert {t: n - removals_before.get(t, 0) for t, n in removals().items()} == {
        ROLLOUT_FOLDS_TABLE: 1,
        ROLLOUT_USER_SUMS_TABLE: 1,
    }
    theirs = kept.KeptStep(ch_store, other, 1, ("a", "b"), Slo(200.0), ())
    assert theirs._index_folds(theirs.newest().generation) == {1}  # another experiment's are left
