"""The REST API: documents, errors by field path, lifecycle, audit, and the role matrix."""

import pytest

from experiments.models import AuditEntry, Experiment

ROLES = ["product", "sre", "analyst", "nobody", "admin", None]


def expect(allowed: set, ok: int, role) -> int:
    if role is None:
        return 401
    return ok if role in allowed or role == "admin" else 403


READERS = {"product", "sre", "analyst"}
WRITERS = {"product"}


@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.engine
def test_role_matrix_over_every_endpoint(role, client_for, experiment, document):
    client = client_for(role)
    key = experiment.key
    assert client.get("/api/experiments/").status_code == expect(READERS, 200, role)
    assert client.get(f"/api/experiments/{key}/").status_code == expect(READERS, 200, role)
    assert client.get(f"/api/experiments/{key}/audit/").status_code == expect(READERS, 200, role)
    assert client.get("/api/audit/").status_code == expect(READERS, 200, role)
    assert client.get("/api/schema/").status_code == (401 if role is None else 200)

    new = {**document, "key": f"new-{role or 'anon'}"}
    assert client.post("/api/experiments/", new, format="json").status_code == expect(WRITERS, 201, role)
    changed = {**document, "name": f"by {role}"}
    assert client.put(f"/api/experiments/{key}/", changed, format="json").status_code == expect(
        WRITERS, 200, role
    )
    assert client.patch(f"/api/experiments/{key}/", {"hypothesis": "h"}, format="json").status_code == expect(
        WRITERS, 200, role
    )
    Experiment.objects.filter(pk=experiment.pk).update(status="running")
    assert client.post(f"/api/experiments/{key}/pause/").status_code == expect(WRITERS, 200, role)
    Experiment.objects.filter(pk=experiment.pk).update(status="draft")
    assert client.delete(f"/api/experiments/{key}/").status_code == expect(WRITERS, 204, role)


@pytest.mark.django_db
@pytest.mark.engine
def test_create_returns_document_and_bookkeeping(client_for, document):
    response = client_for("product").post("/api/experiments/", document, format="json")
    assert response.status_code == 201
    body = response.json()
    assert body["document"]["key"] == "ttft-opt" and body["status"] == "draft"
    assert body["owner"] == "pat" and body["allowed_actions"] == ["start"]
    assert len(body["salt"]) == 32 and body["hash_version"] == 1


@pytest.mark.django_db
def test_bad_body_gets_400_keyed_by_field_path_and_writes_nothing(client_for, document):
    document["variants"][2]["weight"] = 40
    document["variants"][1]["api"] = "grpc"
    response = client_for("product").post("/api/experiments/", document, format="json")
    assert response.status_code == 400
    body = response.json()
    assert "variants[1].api" in body and "sum to 100" in body["variants"][0]
    assert not Experiment.objects.exists() and not AuditEntry.objects.exists()


@pytest.mark.django_db
@pytest.mark.engine
def test_create_existing_key_is_rejected(client_for, experiment, document):
    response = client_for("product").post("/api/experiments/", document, format="json")
    assert response.status_code == 400 and "already exists" in response.json()["key"][0]


@pytest.mark.django_db
def test_key_is_immutable_on_update(client_for, experiment, document):
    response = client_for("product").put(
        f"/api/experiments/{experiment.key}/", {**document, "key": "x"}, format="json"
    )
    assert response.status_code == 400 and "immutable" in response.json()["key"][0]


@pytest.mark.django_db
@pytest.mark.engine
def test_patch_merges_and_reports_changes(client_for, experiment):
    response = client_for("product").patch(
        f"/api/experiments/{experiment.key}/", {"sla": {"ttft_ms": 150, "target": 0.99}}, format="json"
    )
    assert response.status_code == 200
    assert "sla.ttft_ms: 200.0 -> 150.0" in response.json()["changes"]


@pytest.mark.django_db
def test_delete_outside_draft_is_409(client_for, experiment):
    Experiment.objects.filter(pk=experiment.pk).update(status="running")
    response = client_for("product").delete(f"/api/experiments/{experiment.key}/")
    assert response.status_code == 409 and "only draft" in response.json()["detail"]


@pytest.mark.django_db
def test_invalid_transition_is_409_and_changes_nothing(client_for, experiment):
    response = client_for("product").post(f"/api/experiments/{experiment.key}/resume/")
    assert response.status_code == 409 and "cannot resume" in response.json()["detail"]
    experiment.refresh_from_db()
    assert experiment.status == "draft"


@pytest.mark.django_db
@pytest.mark.engine
def test_pause_resume_conclude_audited(client_for, experiment):
    Experiment.objects.filter(pk=experiment.pk).update(status="running")
    client = client_for("product")
    for action, status in [("pause", "paused"), ("resume", "running"), ("conclude", "concluded")]:
        response = client.post(f"/api/experiments/{experiment.key}/{action}/", {"reason": "r"}, format="json")
        assert response.status_code == 200 and response.json()["status"] == status
    actions = list(AuditEntry.objects.filter(experiment_key=experiment.key).values_list("action", flat=True))
    assert actions[:3] == ["conclude", "resume", "pause"]
    experiment.refresh_from_db()
    assert experiment.concluded_at is not None


@pytest.mark.django_db
def test_unknown_experiment_is_404(client_for):
    assert client_for("analyst").get("/api/experiments/nope/").status_code == 404
    assert client_for("product").post("/api/experiments/nope/pause/").status_code == 404


@pytest.mark.django_db
def test_token_authentication(users):
    from rest_framework.authtoken.models import Token
    from rest_framework.test import APIClient

    token = Token.objects.create(user=users["analyst"])
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    assert client.get("/api/experiments/").status_code == 200
    client.credentials(HTTP_AUTHORIZATION="Token wrong")
    assert client.get("/api/experiments/").status_code == 401


@pytest.mark.django_db
def test_docs_page_served(client_for):
    assert client_for("analyst").get("/api/docs/").status_code == 200
