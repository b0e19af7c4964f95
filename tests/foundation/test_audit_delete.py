"""Deleting experiments: the admin's bulk action goes through the audited
service like the delete page and the API; an experiment with runs is protected."""

from __future__ import annotations

import pytest
from django.test import Client

from experiments import services
from experiments.models import AuditEntry, Experiment
from workers.models import ReplayRun

pytestmark = [pytest.mark.django_db, pytest.mark.engine]

LIST_URL = "/admin/experiments/experiment/"


def admin_client(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def bulk_delete(client, *experiments, confirm: bool):
    data = {"action": "delete_selected", "_selected_action": [e.pk for e in experiments]}
    if confirm:
        data["post"] = "yes"
    return client.post(LIST_URL, data, follow=True)


def test_bulk_delete_of_drafts_is_audited_per_experiment(users, experiment, document):
    document["key"] = "second"
    second = services.apply_document(document, actor=users["product"]).experiment
    client = admin_client(users["product"])
    page = bulk_delete(client, experiment, second, confirm=False)
    assert page.status_code == 200 and "Are you sure" in page.content.decode()  # Django's confirmation
    assert Experiment.objects.count() == 2
    page = bulk_delete(client, experiment, second, confirm=True).content.decode()
    assert not Experiment.objects.exists()
    entries = AuditEntry.objects.filter(action="delete")
    assert sorted(entries.values_list("experiment_key", flat=True)) == ["second", "ttft-opt"]
    assert all(e.actor_name == "pat" and e.before["key"] == e.experiment_key for e in entries)
    assert "Deleted (audited): " in page


def test_bulk_delete_refuses_a_running_experiment_and_deletes_nothing(users, experiment, document):
    document["key"] = "second"
    draft = services.apply_document(document, actor=users["product"]).experiment
    Experiment.objects.filter(pk=experiment.pk).update(status="running")
    page = bulk_delete(admin_client(users["admin"]), experiment, draft, confirm=True).content.decode()
    assert "Experiment ttft-opt is running: only drafts can be deleted" in page
    assert Experiment.objects.count() == 2
    assert not AuditEntry.objects.filter(action="delete").exists()


def test_an_experiment_with_runs_cannot_be_deleted(users, experiment, client_for):
    ReplayRun.objects.create(experiment=experiment, source="x", status="done")
    with pytest.raises(
        services.ProtectedExperimentError,
        match="cannot be deleted: 1 replay run and the samples they recorded refer to it",
    ):
        services.delete_experiment(experiment, actor=users["product"])
    response = client_for("product").delete(f"/api/experiments/{experiment.key}/")
    assert response.status_code == 409 and "cannot be deleted" in response.json()["detail"]
    # A bulk delete posted without the confirmation page's check is refused the same way.
    page = bulk_delete(admin_client(users["admin"]), experiment, confirm=True).content.decode()
    assert "Experiment &#x27;ttft-opt&#x27; cannot be deleted: 1 replay run and" in page
    assert Experiment.objects.filter(pk=experiment.pk).exists()
    assert not AuditEntry.objects.filter(action="delete").exists()
