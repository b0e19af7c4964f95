"""Who may add or change the rollout plan of a running or paused experiment.

The plan decides the traffic weights once the experiment runs (the controller writes them), so
changing it then is a traffic change: it needs the permission the weights need,
``experiments.change_weights`` (the sre role; superusers hold every permission). A draft's plan
is part of defining the experiment (the product role), as before. Every path is covered: the API
(PUT/PATCH), the document path (apply_document, the command line) and the admin."""

from __future__ import annotations

import copy

import pytest
from django.test import Client

from experiments import services
from experiments.document import DocumentError
from experiments.models import AuditEntry, Experiment
from experiments.weights.process import weights_store
from rollouts import controller as c
from rollouts import service

pytestmark = pytest.mark.django_db

KEY = "rollout-demo"
URL = f"/api/experiments/{KEY}/"


def running(doc, users, status: str = "running") -> Experiment:
    experiment = services.apply_document(doc, actor=users["product"]).experiment
    experiment = services.transition(experiment, "start", users["product"])
    if status == "paused":
        experiment = services.transition(experiment, "pause", users["product"])
    return experiment


def stored_plan() -> dict | None:
    return Experiment.objects.get(key=KEY).rollout


def hostile_plan(doc) -> dict:
    plan = copy.deepcopy(doc["rollout"])
    plan["steps"] = [99, 100]
    return plan


def updates() -> int:
    return AuditEntry.objects.filter(experiment_key=KEY, action="update").count()


# ---- the API ----------------------------------------------------------------------------------


@pytest.mark.parametrize("status", ["running", "paused"])
def test_product_cannot_change_the_plan_of_a_started_experiment_over_the_api(
    client_for, users, rollout_document, status
):
    running(rollout_document, users, status)
    before, audited = stored_plan(), updates()
    r = client_for("product").patch(URL, {"rollout": hostile_plan(rollout_document)}, format="json")
    assert r.status_code == 400, r.content
    errors = r.json()
    assert list(errors) == ["rollout.steps"]
    assert "experiments.change_weights" in errors["rollout.steps"][0]
    assert f"is {status}" in errors["rollout.steps"][0]
    assert stored_plan() == before and updates() == audited


@pytest.mark.engine
def test_a_refused_plan_never_reaches_the_weights(client_for, users, rollout_document):
    """The controller's first look after the refused change uses the plan as it was: 10%."""
    running(rollout_document, users)
    client_for("product").patch(URL, {"rollout": hostile_plan(rollout_document)}, format="json")
    assert service.look(KEY, interval_s=0).decision.action == c.START
    assert dict(weights_store().get(KEY)[0].weights) == {"fp16": 90, "awq-fa2": 10}


@pytest.mark.engine
def test_product_cannot_add_or_remove_a_plan_once_started(client_for, users, rollout_document):
    plan = rollout_document.pop("rollout")
    running(rollout_document, users)
    r = client_for("product").patch(URL, {"rollout": plan}, format="json")
    assert r.status_code == 400 and "experiments.change_weights" in r.json()["rollout"][0]
    assert "adding a rollout plan" in r.json()["rollout"][0]
    assert stored_plan() is None
    # PUT of the whole document without the plan that is stored: removing it is refused too.
    Experiment.objects.filter(key=KEY).update(rollout=plan)
    services_doc = services.export_document(Experiment.objects.get(key=KEY))
    del services_doc["rollout"]
    r = client_for("product").put(URL, services_doc, format="json")
    assert r.status_code == 400 and "removing the rollout plan" in r.json()["rollout"][0]
    assert stored_plan() == plan


@pytest.mark.parametrize("role", ["sre", "admin"])
@pytest.mark.engine
def test_sre_and_superusers_change_the_plan_of_a_running_experiment(
    client_for, users, rollout_document, role
):
    running(rollout_document, users)
    r = client_for(role).patch(URL, {"rollout": hostile_plan(rollout_document)}, format="json")
    assert r.status_code == 200, r.content
    assert stored_plan()["steps"] == [99, 100]
    assert any(ch.startswith("rollout:") and "'steps': [99, 100]" in ch for ch in r.json()["changes"])
    entry = AuditEntry.objects.filter(experiment_key=KEY, action="update").latest("id")
    assert entry.actor_name == users[role].username


@pytest.mark.engine
def test_sre_may_change_the_plan_and_nothing_else(client_for, users, rollout_document):
    running(rollout_document, users)
    sre = client_for("sre")
    r = sre.patch(URL, {"name": "renamed", "rollout": hostile_plan(rollout_document)}, format="json")
    assert r.status_code == 403 and "experiments.change_experiment" in r.json()["detail"]
    assert Experiment.objects.get(key=KEY).name == rollout_document["name"]
    assert stored_plan()["steps"] == [10, 50, 100]
    assert sre.patch(URL, {"hypothesis": "h"}, format="json").status_code == 403
    assert (
        sre.post("/api/experiments/", {**rollout_document, "key": "other"}, format="json").status_code == 403
    )


def test_product_still_defines_the_plan_of_a_draft(client_for, users, rollout_document):
    services.apply_document(rollout_document, actor=users["product"])
    r = client_for("product").patch(URL, {"rollout": hostile_plan(rollout_document)}, format="json")
    assert r.status_code == 200 and stored_plan()["steps"] == [99, 100]


def test_product_still_changes_the_rest_of_a_running_experiment_with_a_plan(
    client_for, users, rollout_document
):
    running(rollout_document, users)
    r = client_for("product").patch(URL, {"name": "renamed"}, format="json")
    assert r.status_code == 200 and r.json()["changes"] == ["name: 'AWQ + FA2 rollout' -> 'renamed'"]


# ---- the document path --------------------------------------------------------------------------


@pytest.mark.engine
def test_apply_document_refuses_a_plan_change_by_a_user_without_the_permission(users, rollout_document):
    running(rollout_document, users)
    changed = {**rollout_document, "rollout": hostile_plan(rollout_document)}
    with pytest.raises(DocumentError) as caught:
        services.apply_document(changed, actor=users["product"])
    assert [e.path for e in caught.value.errors] == ["rollout.steps"]
    with pytest.raises(DocumentError):
        services.check_document(changed, actor=users["product"])
    assert stored_plan()["steps"] == [10, 50, 100]
    assert services.apply_document(changed, actor=users["sre"]).changes
    assert stored_plan()["steps"] == [99, 100]


def test_the_command_line_applies_as_the_user_it_names(users, rollout_document, tmp_path):
    """apply_experiment --as NAME is that user's change; without --as it is the operator's."""
    import json

    from django.core.management import call_command
    from django.core.management.base import CommandError

    running(rollout_document, users)
    path = tmp_path / "doc.json"
    path.write_text(json.dumps({**rollout_document, "rollout": hostile_plan(rollout_document)}))
    with pytest.raises(CommandError, match="experiments.change_weights"):
        call_command("apply_experiment", str(path), "--as", users["product"].username)
    assert stored_plan()["steps"] == [10, 50, 100]
    call_command("apply_experiment", str(path))
    assert stored_plan()["steps"] == [99, 100]


# ---- the admin --------------------------------------------------------------------------------


def test_the_admin_cannot_change_the_plan(users, rollout_document):
    """The admin has no plan field: a product user saving a running experiment keeps the plan
    as it is, whatever the request carries."""
    from tests.foundation.test_admin import form_data

    experiment = running(rollout_document, users)
    client = Client()
    client.force_login(users["product"])
    data = form_data({**rollout_document, "hypothesis": "h", "name": "renamed"}, experiment)
    data["rollout"] = '{"candidate": "awq-fa2", "steps": [99, 100]}'
    r = client.post(f"/admin/experiments/experiment/{experiment.pk}/change/", data)
    assert r.status_code == 302, r.content.decode()[:3000]
    experiment.refresh_from_db()
    assert (
        experiment.name == "renamed" and experiment.rollout == services.export_document(experiment)["rollout"]
    )
    assert experiment.rollout["steps"] == [10, 50, 100]
