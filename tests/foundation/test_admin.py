"""The admin: same validation as the API, lifecycle actions, read-only fields, roles."""

import json

import pytest
from django.test import Client

from experiments.models import AuditEntry, Experiment

ADD_URL = "/admin/experiments/experiment/add/"


def change_url(experiment) -> str:
    return f"/admin/experiments/experiment/{experiment.pk}/change/"


def admin_client(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def form_data(document, experiment=None) -> dict:
    data = {
        "key": document["key"],
        "name": document["name"],
        "hypothesis": document["hypothesis"],
        "sla_ttft_ms": document["sla"]["ttft_ms"],
        "sla_target": document["sla"]["target"],
        "sla_tpot_ms": "",
        "sla_e2e_ms": "",
        "variants-TOTAL_FORMS": len(document["variants"]),
        "variants-INITIAL_FORMS": 0,
        "variants-MIN_NUM_FORMS": 2,
        "variants-MAX_NUM_FORMS": 1000,
    }
    # the Analysis checkboxes as the form renders them (a browser posts only the checked ones)
    analysis = document.get("analysis") or {}
    for name in ("cluster_by_user", "adjust"):
        if analysis.get(name, True):
            data[f"analysis_{name}"] = "on"
    fidelity = document.get("fidelity") or {}
    if fidelity.get("store_answers", False):  # the Answers checkbox
        data["fidelity_store_answers"] = "on"
    data["fidelity_score_share"] = fidelity.get("score_share", 0.0)
    data["fidelity_score_top_k"] = fidelity.get("score_top_k", 20)
    data["fidelity_shadow_share"] = fidelity.get("shadow_share", 0.0)
    existing = {v.key: v.pk for v in experiment.variants.all()} if experiment else {}
    data["variants-INITIAL_FORMS"] = len(existing)
    for i, v in enumerate(document["variants"]):
        prefix = f"variants-{i}-"
        data.update(
            {
                prefix + "key": v["key"],
                prefix + "weight": v["weight"],
                prefix + "endpoint": v["endpoint"],
                prefix + "model": v["model"],
                prefix + "api": v.get("api", "chat"),
                prefix + "factors": json.dumps(v.get("factors", {})),
                prefix + "engine_args": json.dumps(v.get("engine_args", {})),
            }
        )
        if v.get("control"):
            data[prefix + "control"] = "on"
        if v["key"] in existing:
            data[prefix + "id"] = existing[v["key"]]
            data[prefix + "experiment"] = experiment.pk
    return data


@pytest.mark.django_db
@pytest.mark.engine
def test_product_creates_experiment_with_inline_variants(users, document):
    response = admin_client(users["product"]).post(ADD_URL, form_data(document))
    assert response.status_code == 302, response.content.decode()[:3000]
    experiment = Experiment.objects.get(key="ttft-opt")
    assert experiment.owner == users["product"]
    assert list(experiment.variants.values_list("key", "weight")) == [
        ("fp16", 34),
        ("awq", 33),
        ("awq-fa2", 33),
    ]
    assert AuditEntry.objects.filter(action="create", actor_name="pat").exists()


@pytest.mark.django_db
def test_admin_rejects_what_the_api_rejects_and_writes_nothing(users, document):
    document["variants"][0]["weight"] = 10
    document["variants"][1]["factors"] = {"quantization": "awq"}
    response = admin_client(users["product"]).post(ADD_URL, form_data(document))
    assert response.status_code == 200
    page = response.content.decode()
    assert "weights must sum to 100" in page and "variants[1].factors" in page
    assert not Experiment.objects.exists()


@pytest.mark.django_db
@pytest.mark.engine
def test_admin_edit_of_draft_updates_variants(users, experiment, document):
    document["variants"][0]["weight"], document["variants"][1]["weight"] = 40, 27
    response = admin_client(users["product"]).post(change_url(experiment), form_data(document, experiment))
    assert response.status_code == 302, response.content.decode()[:3000]
    assert experiment.weights() == {"fp16": 40, "awq": 27, "awq-fa2": 33}


@pytest.mark.django_db
def test_running_experiment_has_key_salt_and_weights_read_only(users, experiment):
    Experiment.objects.filter(pk=experiment.pk).update(status="running")
    page = admin_client(users["product"]).get(change_url(experiment)).content.decode()
    assert 'name="key"' not in page and 'name="salt"' not in page
    assert 'name="variants-0-weight"' not in page and experiment.salt in page
    assert 'name="variants-0-endpoint"' in page


@pytest.mark.django_db
@pytest.mark.engine
def test_lifecycle_actions_respect_transitions(users, experiment):
    client = admin_client(users["product"])
    url = "/admin/experiments/experiment/"
    response = client.post(
        url, {"action": "resume_experiments", "_selected_action": [experiment.pk]}, follow=True
    )
    assert "cannot resume an experiment that is draft" in response.content.decode()
    Experiment.objects.filter(pk=experiment.pk).update(status="running")
    client.post(url, {"action": "pause_experiments", "_selected_action": [experiment.pk]})
    experiment.refresh_from_db()
    assert experiment.status == "paused"


@pytest.mark.django_db
@pytest.mark.parametrize("role", ["sre", "analyst"])
def test_readers_view_but_cannot_add_change_or_run_lifecycle(users, experiment, document, role):
    client = admin_client(users[role])
    assert client.get("/admin/experiments/experiment/").status_code == 200
    assert client.get(change_url(experiment)).status_code == 200
    assert client.get(ADD_URL).status_code == 403
    document["name"] = "hijack"
    assert client.post(change_url(experiment), form_data(document, experiment)).status_code == 403
    page = client.get("/admin/experiments/experiment/").content.decode()
    assert "pause_experiments" not in page
    experiment.refresh_from_db()
    assert experiment.name == "TTFT optimizations"


@pytest.mark.django_db
def test_user_without_role_is_kept_out(users, experiment):
    users["nobody"].is_staff = True
    users["nobody"].save()
    assert admin_client(users["nobody"]).get(change_url(experiment)).status_code == 403


@pytest.mark.django_db
@pytest.mark.engine
def test_search_filter_and_dashboard_link(users, experiment):
    page = (
        admin_client(users["analyst"])
        .get("/admin/experiments/experiment/?q=awq&status__exact=draft")
        .content.decode()
    )
    assert "ttft-opt" in page and f"/dashboards/{experiment.key}/" in page


@pytest.mark.django_db
def test_audit_log_is_read_only_in_admin(users, experiment):
    client = admin_client(users["admin"])
    entry = AuditEntry.objects.first()
    assert client.get("/admin/experiments/auditentry/").status_code == 200
    assert (
        client.post(f"/admin/experiments/auditentry/{entry.pk}/delete/", {"post": "yes"}).status_code == 403
    )


@pytest.mark.django_db
@pytest.mark.engine
def test_sre_changes_weights_through_the_admin_with_a_preview(users, experiment):
    from experiments import services

    services.transition(experiment, "start", users["product"])
    client = admin_client(users["sre"])
    url = f"/admin/experiments/experiment/{experiment.pk}/weights/"
    page = client.get(url)
    assert page.status_code == 200
    assert f'href="{url}"' in client.get(change_url(experiment)).content.decode()
    form = {
        "weight__fp16": 50,
        "weight__awq": 30,
        "weight__awq-fa2": 20,
        "reason": "ramp",
        "expected_revision": 1,
    }
    page = client.post(url, {**form, "_preview": "1"}).content.decode()
    assert "16.00% of users change variant" in page  # the preview, before anything is written
    assert experiment.weights() == {"fp16": 34, "awq": 33, "awq-fa2": 33}
    assert client.post(url, {**form, "_save": "1"}).status_code == 302
    assert experiment.weights() == {"fp16": 50, "awq": 30, "awq-fa2": 20}
    assert admin_client(users["product"]).get(url).status_code == 403
