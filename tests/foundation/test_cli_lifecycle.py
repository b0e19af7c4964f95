"""`manage.py experiment start|pause|resume|conclude|list|show`: the lifecycle from the command
line, through the same transitions, weights store and audit log as the API and the admin."""

import io

import pytest
from django.core.management import CommandError, call_command

from experiments.models import AuditEntry, Experiment
from experiments.services import apply_document
from experiments.weights.publish import current_weights
from tests.cli import as_json, failing


def run_json(*args) -> dict:
    return as_json("experiment", *args)


def refused(*args) -> tuple[str, dict]:
    """The command's error message, and the JSON document it printed on stdout."""
    exc, doc = failing("experiment", *args)
    return str(exc), doc


def audit_of(key: str) -> list[tuple]:
    return list(
        AuditEntry.objects.filter(experiment_key=key)
        .order_by("id")
        .values_list("action", "actor_name", "reason", "before", "after")
    )


@pytest.mark.django_db
@pytest.mark.engine
def test_the_whole_lifecycle_is_audited_under_the_acting_user(experiment, users):
    started = run_json("start", "ttft-opt", "--as", "sam", "--reason", "ramp up")
    assert started["transition"] | {"at": None} == {
        "action": "start",
        "from": "draft",
        "to": "running",
        "reason": "ramp up",
        "actor": "sam",
        "audit_id": AuditEntry.objects.get(action="start").pk,
        "at": None,
    }
    assert started["experiment"]["status"] == "running"
    assert started["experiment"]["allowed_actions"] == ["pause", "conclude"]
    doc, revision = current_weights("ttft-opt")  # starting published the weights
    assert revision > 0 and dict(doc.weights) == {"fp16": 34, "awq": 33, "awq-fa2": 33}

    paused = run_json("pause", "ttft-opt", "--user", "sam")  # --user: the same as --as
    assert (paused["transition"]["from"], paused["transition"]["to"]) == ("running", "paused")
    assert current_weights("ttft-opt")[1] == revision  # pausing keeps the weights
    run_json("resume", "ttft-opt")  # no --as: the audit log says "system", as for set_weights
    concluded = run_json("conclude", "ttft-opt", "--as", "ana", "--reason", "awq-fa2 meets the SLA")
    assert concluded["experiment"]["allowed_actions"] == []
    assert current_weights("ttft-opt") == (None, 0)  # concluding retired them

    moves = [
        entry[:3] for entry in audit_of("ttft-opt") if entry[0] in ("start", "pause", "resume", "conclude")
    ]
    assert moves == [
        ("start", "sam", "ramp up"),
        ("pause", "sam", ""),
        ("resume", "system", ""),
        ("conclude", "ana", "awq-fa2 meets the SLA"),
    ]
    assert AuditEntry.objects.get(action="conclude").actor == users["analyst"]
    assert [e[3:] for e in audit_of("ttft-opt") if e[0] == "conclude"] == [
        ({"status": "running"}, {"status": "concluded"})
    ]


@pytest.mark.django_db
@pytest.mark.parametrize(
    "status, action, allowed",
    [
        ("draft", "pause", "start"),
        ("draft", "conclude", "start"),
        ("running", "start", "pause, conclude"),
        ("running", "resume", "pause, conclude"),
        ("paused", "pause", "resume, conclude"),
        ("concluded", "resume", "none (concluded is final)"),
    ],
)
def test_an_illegal_move_names_the_state_and_the_allowed_moves_and_changes_nothing(
    experiment, users, status, action, allowed
):
    path = {
        "draft": [],
        "running": ["start"],
        "paused": ["start", "pause"],
        "concluded": ["start", "conclude"],
    }
    for step in path[status]:
        call_command("experiment", step, "ttft-opt", "--reason", "setup", stdout=io.StringIO())
    before_audit, before_weights = audit_of("ttft-opt"), current_weights("ttft-opt")[1]
    reason = ["--reason", "try"]
    message, doc = refused(action, "ttft-opt", *reason)
    assert f"cannot {action} an experiment that is {status}" in message
    assert message.endswith(f"Allowed from {status}: {allowed}")
    assert doc["error"]["message"] == message and doc["error"]["field"] == "action"
    assert (doc["experiment"], doc["status"]) == ("ttft-opt", status)
    assert doc["allowed_actions"] == ([] if status == "concluded" else allowed.split(", "))
    assert Experiment.objects.get(key="ttft-opt").status == status
    assert audit_of("ttft-opt") == before_audit and current_weights("ttft-opt")[1] == before_weights


@pytest.mark.django_db
def test_a_conclusion_needs_a_reason_and_a_named_actor_must_exist(experiment, users):
    call_command("experiment", "start", "ttft-opt", stdout=io.StringIO())
    before = audit_of("ttft-opt")
    with pytest.raises(CommandError, match="required: --reason"):
        call_command("experiment", "conclude", "ttft-opt", stdout=io.StringIO())
    message, doc = refused("conclude", "ttft-opt", "--reason", "   ")
    assert doc["error"]["field"] == "--reason" and "it is final" in message
    message, doc = refused("conclude", "ttft-opt", "--reason", "x" * 2001)  # the API's limit
    assert doc["error"]["field"] == "--reason" and "2000 characters" in message
    message, doc = refused("pause", "ttft-opt", "--as", "mallory")
    assert doc == {"error": {"message": "--as: no user named 'mallory'", "field": "--as", "errors": []}}
    message, doc = refused("pause", "nope")
    assert doc["error"] == {
        "message": "no experiment 'nope'; `manage.py experiment list` lists them",
        "field": "key",
        "errors": [],
    }
    assert Experiment.objects.get(key="ttft-opt").status == "running" and audit_of("ttft-opt") == before


@pytest.mark.django_db
@pytest.mark.engine
def test_show_and_list_print_what_the_api_answers(experiment, users, client_for, document):
    call_command("experiment", "start", "ttft-opt", stdout=io.StringIO())
    document["key"], document["name"] = "second", "Second"
    apply_document(document)
    api = client_for("analyst")
    shown = run_json("show", "ttft-opt")
    assert shown == api.get("/api/experiments/ttft-opt/").json()
    listed = run_json("list")
    assert [e["document"]["key"] for e in listed["experiments"]] == ["second", "ttft-opt"]  # newest first
    assert listed["experiments"][1] == shown
    assert [e["document"]["key"] for e in run_json("list", "--status", "draft")["experiments"]] == ["second"]
    assert run_json("list", "--status", "concluded") == {"experiments": []}
    # and for a person: the status and what may follow it
    out = io.StringIO()
    call_command("experiment", "show", "ttft-opt", stdout=out)
    assert "status     running (allowed: pause, conclude)" in out.getvalue()
    out = io.StringIO()
    call_command("experiment", "list", stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["key", "status", "variants", "started", "name"]
    assert lines[1].split()[:3] == ["second", "draft", "3"] and lines[2].split()[:3] == [
        "ttft-opt",
        "running",
        "3",
    ]


@pytest.mark.django_db
@pytest.mark.engine
def test_a_start_the_weights_store_cannot_record_changes_nothing(experiment, monkeypatch):
    from experiments.weights import publish
    from experiments.weights.errors import StoreUnavailable

    def down(*args, **kwargs):
        raise StoreUnavailable("etcd: connection refused")

    monkeypatch.setattr(publish, "publish_weights", down)
    before = audit_of("ttft-opt")
    message, doc = refused("start", "ttft-opt")
    assert "weights store unavailable, nothing changed: etcd: connection refused" in message
    assert doc["error"]["field"] is None and (doc["status"], doc["allowed_actions"]) == ("draft", ["start"])
    assert Experiment.objects.get(key="ttft-opt").status == "draft" and audit_of("ttft-opt") == before
    assert current_weights("ttft-opt") == (None, 0)
