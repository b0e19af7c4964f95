"""The document's analysis block (how the SLA report analyses the experiment): validated with
field errors, stored, exported and applied back, changed through the API (with the fidelity
block: the switch blocks share one shape) and the admin, and handed to the report."""

import pytest
from django.test import Client

from experiments import services
from experiments.document import DocumentError, validate_document
from experiments.models import AuditEntry, Experiment
from tests.foundation.test_admin import change_url, form_data


def errors_of(doc) -> dict[str, list[str]]:
    with pytest.raises(DocumentError) as info:
        validate_document(doc)
    return info.value.as_dict()


def test_the_block_defaults_to_clustering_and_adjusting(document):
    assert validate_document(document)["analysis"] == {"cluster_by_user": True, "adjust": True}
    document["analysis"] = {"adjust": False}  # a field left out keeps its default
    assert validate_document(document)["analysis"] == {"cluster_by_user": True, "adjust": False}


@pytest.mark.parametrize(
    "analysis, path, message",
    [
        ({"cluster_by_user": "yes"}, "analysis.cluster_by_user", "must be true or false"),
        ({"cluster_by_user": 1}, "analysis.cluster_by_user", "must be true or false"),
        ({"adjust": None}, "analysis.adjust", "must be true or false"),
        ({"unit": "user"}, "analysis.unit", "unknown field; allowed: adjust, cluster_by_user"),
        ("off", "analysis", "must be a mapping: {cluster_by_user: true, adjust: true}"),
    ],
)
def test_a_bad_block_is_refused_naming_the_field(document, analysis, path, message):
    document["analysis"] = analysis
    assert errors_of(document) == {path: [message]}


@pytest.mark.django_db
@pytest.mark.engine
def test_the_block_is_stored_exported_and_applies_back_unchanged(document):
    document["analysis"] = {"cluster_by_user": False, "adjust": True}
    exp = services.apply_document(document).experiment
    assert (exp.analysis_cluster_by_user, exp.analysis_adjust) == (False, True)
    exported = services.export_document(exp)
    assert exported["analysis"] == {"cluster_by_user": False, "adjust": True}
    again = services.apply_document(exported)
    assert not again.created and again.changes == []


@pytest.mark.django_db
@pytest.mark.engine
def test_a_running_experiment_may_change_it_audited(experiment, document, users):
    Experiment.objects.filter(pk=experiment.pk).update(status="running")
    document["analysis"] = {"cluster_by_user": True, "adjust": False}
    result = services.apply_document(document, actor=users["product"])
    assert result.changes == ["analysis.adjust: True -> False"]
    entry = AuditEntry.objects.filter(action="update").get()
    assert entry.before["analysis"]["adjust"] is True and entry.after["analysis"]["adjust"] is False


@pytest.mark.django_db
@pytest.mark.engine
@pytest.mark.parametrize(
    "block, default, bad, change, stored",
    [
        (
            "analysis",
            {"cluster_by_user": True, "adjust": True},
            {"cluster_by_user": "no"},
            {"cluster_by_user": False},
            ("analysis_cluster_by_user", False),
        ),
        # the privacy switch of answers' texts (tests/foundation/test_document_fidelity.py)
        (
            "fidelity",
            {"store_answers": False, "score_share": 0.0, "score_top_k": 20, "shadow_share": 0.0},
            {"store_answers": "on"},
            {"store_answers": True},
            ("fidelity_store_answers", True),
        ),
    ],
)
def test_the_api_reads_and_changes_a_block_and_names_a_bad_field(
    client_for, experiment, document, block, default, bad, change, stored
):
    client = client_for("product")
    body = client.get(f"/api/experiments/{experiment.key}/").json()
    assert body["document"][block] == default
    refused = client.put(f"/api/experiments/{experiment.key}/", {**document, block: bad}, format="json")
    assert refused.status_code == 400
    assert refused.json() == {f"{block}.{name}": ["must be true or false"] for name in bad}
    ok = client.patch(f"/api/experiments/{experiment.key}/", {block: change}, format="json")
    [(name, value)] = change.items()
    assert ok.status_code == 200 and f"{block}.{name}: {default[name]} -> {value}" in ok.json()["changes"]
    column, now = stored
    assert getattr(Experiment.objects.get(pk=experiment.pk), column) is now
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/json").json()
    assert set(schema["components"]["schemas"][block.capitalize()]["properties"]) == set(default)


@pytest.mark.django_db
@pytest.mark.engine
def test_the_admin_form_sets_it(users, experiment, document):
    client = Client()
    client.force_login(users["product"])
    page = client.get(change_url(experiment)).content.decode()
    assert 'name="analysis_cluster_by_user"' in page and 'name="analysis_adjust"' in page
    unticked = {**document, "analysis": {"cluster_by_user": True, "adjust": False}}
    data = form_data(unticked, experiment)  # cluster_by_user ticked, adjust not posted (unticked)
    assert data["analysis_cluster_by_user"] == "on" and "analysis_adjust" not in data
    response = client.post(change_url(experiment), data)
    assert response.status_code == 302, response.content.decode()[:3000]
    experiment.refresh_from_db()
    assert (experiment.analysis_cluster_by_user, experiment.analysis_adjust) == (True, False)
    assert services.export_document(experiment)["analysis"] == {"cluster_by_user": True, "adjust": False}


@pytest.mark.django_db
def test_the_report_gets_the_switches(experiment):
    from dashboards.reports import experiment_info

    assert (experiment_info(experiment).cluster_by_user, experiment_info(experiment).adjust) == (True, True)
    Experiment.objects.filter(pk=experiment.pk).update(analysis_cluster_by_user=False, analysis_adjust=False)
    info = experiment_info(Experiment.objects.get(pk=experiment.pk))
    assert (info.cluster_by_user, info.adjust, info.unit) == (False, False, "request")
