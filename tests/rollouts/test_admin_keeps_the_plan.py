"""Saving an experiment's change form in the admin keeps its rollout plan: the admin has no
plan field, and the document it applies carries the stored plan unchanged."""

from __future__ import annotations

import pytest
from django.test import Client

from experiments import services
from experiments.models import AuditEntry, Experiment
from tests.foundation.test_admin import form_data

pytestmark = [pytest.mark.django_db, pytest.mark.engine]

KEY = "rollout-demo"


def save_change_form(user, experiment: Experiment, document: dict) -> None:
    client = Client()
    client.force_login(user)
    r = client.post(f"/admin/experiments/experiment/{experiment.pk}/change/", form_data(document, experiment))
    assert r.status_code == 302, r.content.decode()[:3000]


@pytest.mark.parametrize("role", ["product", "admin"])
def test_saving_a_draft_in_the_admin_keeps_its_plan(users, rollout_document, role):
    rollout_document["hypothesis"] = "AWQ + FA2 is as fast"
    experiment = services.apply_document(rollout_document, actor=users["product"]).experiment
    plan = experiment.rollout
    assert plan is not None

    save_change_form(users[role], experiment, {**rollout_document, "name": "renamed in the admin"})

    experiment.refresh_from_db()
    assert experiment.name == "renamed in the admin"
    assert experiment.rollout == plan
    update = AuditEntry.objects.filter(experiment_key=KEY, action="update").latest("id")
    assert update.after["rollout"]["steps"] == plan["steps"]
    assert update.before["rollout"] == update.after["rollout"]


def test_saving_a_running_experiment_in_the_admin_keeps_its_plan(users, rollout_document):
    rollout_document["hypothesis"] = "AWQ + FA2 is as fast"
    experiment = services.apply_document(rollout_document, actor=users["product"]).experiment
    experiment = services.transition(experiment, "start", users["product"])
    plan = experiment.rollout

    save_change_form(users["product"], experiment, {**rollout_document, "hypothesis": "changed"})

    experiment.refresh_from_db()
    assert experiment.hypothesis == "changed" and experiment.rollout == plan


def test_saving_without_a_change_writes_nothing(users, rollout_document):
    rollout_document["hypothesis"] = "AWQ + FA2 is as fast"
    experiment = services.apply_document(rollout_document, actor=users["product"]).experiment
    save_change_form(users["product"], experiment, rollout_document)
    assert not AuditEntry.objects.filter(experiment_key=KEY, action="update").exists()
    experiment.refresh_from_db()
    assert experiment.rollout is not None
