"""The weights API (assign, GET/PUT weights) and the SRE admin weights form."""

from __future__ import annotations

import pytest
from django.contrib import admin
from django.contrib.messages.storage.fallback import FallbackStorage
from django.contrib.sessions.backends.signed_cookies import SessionStore
from django.test import RequestFactory

from experiments import services
from experiments.admin import ExperimentAdmin
from experiments.assignment import assign
from experiments.models import AuditEntry, Experiment
from experiments.weights import process

RAMP = {"fp16": 50, "awq": 30, "awq-fa2": 20}
START = {"fp16": 34, "awq": 33, "awq-fa2": 33}


@pytest.fixture(autouse=True)
def local_weights(settings, tmp_path):
    settings.ETCD_ENDPOINTS = []
    settings.WEIGHTS_DIR = tmp_path / "weights"
    process.reset_for_tests()
    yield
    process.reset_for_tests()


@pytest.fixture
def running(experiment, users):
    services.transition(experiment, "start", users["product"], reason="go")
    experiment.refresh_from_db()
    return experiment


def stored():
    return process.weights_store().get("ttft-opt")


# Assign -------------------------------------------------------------------------------------


def test_assign_returns_the_variant_and_the_revision_used(running, client_for):
    doc, revision = stored()
    response = client_for("analyst").get("/api/experiments/ttft-opt/assign", {"user_id": "user-42"})
    assert response.status_code == 200, response.content
    assert response.json() == {
        "experiment": "ttft-opt",
        "user_id": "user-42",
        "variant": assign(doc.salt, "user-42", doc.allocation),
        "revision": revision,
        "hash_version": 1,
    }
    # the trailing-slash form works too
    assert client_for("sre").get("/api/experiments/ttft-opt/assign/?user_id=u").status_code == 200


@pytest.mark.process
def test_assign_rejects_a_missing_user_id_and_unknown_experiments(running, client_for):
    client = client_for("analyst")
    response = client.get("/api/experiments/ttft-opt/assign")
    assert response.status_code == 400 and "user_id" in response.json()
    response = client.get("/api/experiments/ttft-opt/assign", {"user_id": "x" * 513})
    assert response.status_code == 400 and "at most 512" in response.json()["user_id"][0]
    response = client.get("/api/experiments/nope/assign", {"user_id": "u"})
    assert response.status_code == 404 and "no weights for experiment 'nope'" in response.json()["detail"]


def test_assign_needs_authentication(running, client_for):
    assert client_for(None).get("/api/experiments/ttft-opt/assign", {"user_id": "u"}).status_code == 401


def test_assign_follows_a_weights_change(running, client_for, wait_until):
    client = client_for("sre")
    client.get("/api/experiments/ttft-opt/assign", {"user_id": "u"})  # starts the router
    _, r1 = stored()
    put = client.put(
        "/api/experiments/ttft-opt/weights",
        {"weights": RAMP, "reason": "ramp", "expected_revision": r1},
        format="json",
    )
    assert put.status_code == 200, put.content
    r2 = put.json()["revision"]
    wait_until(
        lambda: client.get("/api/experiments/ttft-opt/assign", {"user_id": "u"}).json()["revision"] == r2,
        "the router to pick up the new weights",
    )


# GET / PUT weights ---------------------------------------------------------------------------


def test_get_weights_of_a_running_and_of_a_draft_experiment(experiment, users, client_for):
    client = client_for("analyst")
    draft = client.get("/api/experiments/ttft-opt/weights").json()
    assert draft == {
        "experiment": "ttft-opt",
        "status": "draft",
        "published": False,
        "revision": 0,
        "weights": START,
    }
    services.transition(experiment, "start", users["product"])
    body = client.get("/api/experiments/ttft-opt/weights").json()
    assert body["published"] is True and body["revision"] > 0 and body["weights"] == START
    assert body["actor"] == "pat" and body["reason"] == "experiment started"
    assert client.get("/api/experiments/nope/weights").status_code == 404


@pytest.mark.engine
def test_sre_changes_weights_and_sees_how_many_users_moved(running, client_for):
    _, r1 = stored()
    response = client_for("sre").put(
        "/api/experiments/ttft-opt/weights",
        {"weights": RAMP, "reason": "ramp fp16", "expected_revision": r1},
        format="json",
    )
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["weights"] == RAMP and body["revision"] > r1
    assert body["moved_share"] == pytest.approx(0.16) and body["minimum_share"] == pytest.approx(0.16)
    assert dict(stored()[0].weights) == RAMP
    assert Experiment.objects.get(key="ttft-opt").weights() == RAMP
    assert AuditEntry.objects.filter(action="set_weights", reason="ramp fp16", actor_name="sam").exists()


def test_superuser_may_change_weights(running, client_for):
    _, r1 = stored()
    body = {"weights": RAMP, "reason": "admin", "expected_revision": r1}
    assert (
        client_for("admin").put("/api/experiments/ttft-opt/weights", body, format="json").status_code == 200
    )


@pytest.mark.parametrize(("role", "code"), [("product", 403), ("analyst", 403), ("nobody", 403), (None, 401)])
def test_other_roles_cannot_change_weights(running, client_for, role, code):
    before = stored()
    body = {"weights": RAMP, "reason": "nope", "expected_revision": before[1]}
    assert client_for(role).put("/api/experiments/ttft-opt/weights", body, format="json").status_code == code
    assert stored() == before


@pytest.mark.engine
def test_stale_revision_is_409_and_nothing_is_written(running, client_for):
    client = client_for("sre")
    _, r1 = stored()
    first = client.put(
        "/api/experiments/ttft-opt/weights",
        {"weights": RAMP, "reason": "sre one", "expected_revision": r1},
        format="json",
    )
    assert first.status_code == 200
    after_first = stored()
    second = client_for("admin").put(
        "/api/experiments/ttft-opt/weights",
        {"weights": {"fp16": 10, "awq": 45, "awq-fa2": 45}, "reason": "sre two", "expected_revision": r1},
        format="json",
    )
    assert second.status_code == 409
    assert second.json()["current_revision"] == after_first[1]
    assert "reload the current weights and retry" in second.json()["detail"]
    assert stored() == after_first


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"weights": {"fp16": 50, "awq": 30, "gptq": 20}}, "weights.gptq", "unknown variant"),
        ({"weights": {"fp16": 60, "awq": 60, "awq-fa2": -20}}, "weights.awq-fa2", "must be >= 0, got -20"),
        ({"weights": {"fp16": 50, "awq": 30, "awq-fa2": 30}}, "weights", "must sum to 100, got 110"),
        ({"weights": {"fp16": "50", "awq": 30, "awq-fa2": 20}}, "weights.fp16", "must be an integer percent"),
        ({"weights": RAMP, "expected_revision": None}, "expected_revision", "null"),
        ({"weights": RAMP, "reason": ""}, "reason", "blank"),
        ({"weights": [50, 50]}, "weights", "dictionary"),
    ],
)
def test_bad_weights_are_400_naming_the_field_and_nothing_is_written(
    running, client_for, body, field, message
):
    before = stored()
    payload = {"reason": "bad", "expected_revision": before[1], **body}
    response = client_for("sre").put("/api/experiments/ttft-opt/weights", payload, format="json")
    assert response.status_code == 400, response.content
    errors = response.json()
    assert field in errors and any(message in m for m in errors[field]), errors
    assert stored() == before


def test_weights_of_a_concluded_experiment_are_400(running, users, client_for):
    _, revision = stored()
    services.transition(running, "conclude", users["product"])
    assert stored() is None  # concluding retired the weights
    response = client_for("sre").put(
        "/api/experiments/ttft-opt/weights",
        {"weights": RAMP, "reason": "late", "expected_revision": revision},
        format="json",
    )
    assert response.status_code == 400
    assert "is concluded" in response.json()["experiment"][0]
    assert stored() is None


def test_dry_run_previews_without_writing(running, client_for):
    before = stored()
    response = client_for("sre").put(
        "/api/experiments/ttft-opt/weights",
        {"weights": RAMP, "reason": "what if", "expected_revision": before[1], "dry_run": True},
        format="json",
    )
    assert response.status_code == 200
    assert response.json()["dry_run"] is True and response.json()["moved_share"] == pytest.approx(0.16)
    assert stored() == before


def test_put_on_unknown_experiment_is_404(db, client_for):
    body = {"weights": RAMP, "reason": "x", "expected_revision": 0}
    assert client_for("sre").put("/api/experiments/nope/weights", body, format="json").status_code == 404


# Admin weights form ---------------------------------------------------------------------------


def admin_request(user, method="get", data=None):
    factory = RequestFactory()
    request = getattr(factory, method)("/admin/experiments/experiment/1/weights/", data or {})
    request.user = user
    request.session = SessionStore()
    request._messages = FallbackStorage(request)
    request._dont_enforce_csrf_checks = True
    return request


@pytest.fixture
def weights_admin():
    return ExperimentAdmin(Experiment, admin.site)  # the registered admin carries WeightsAdminMixin


@pytest.fixture
def sre(users):
    users["sre"].is_staff = True
    users["sre"].save()
    return users["sre"]


@pytest.mark.engine
def test_admin_form_shows_current_weights_then_previews_then_saves(running, sre, weights_admin):
    _, revision = stored()
    page = weights_admin.weights_view(admin_request(sre), str(running.pk)).render()
    html = page.content.decode()
    assert page.status_code == 200 and f"revision <strong>{revision}</strong>" in html
    assert 'name="weight__fp16"' in html and 'value="34"' in html

    form = {
        "weight__fp16": 50,
        "weight__awq": 30,
        "weight__awq-fa2": 20,
        "reason": "ramp",
        "expected_revision": revision,
    }
    preview = weights_admin.weights_view(
        admin_request(sre, "post", {**form, "_preview": "1"}), str(running.pk)
    )
    html = preview.render().content.decode()
    assert "16.00% of users change variant" in html and 'name="_save"' in html
    assert stored()[1] == revision  # preview wrote nothing

    saved = weights_admin.weights_view(admin_request(sre, "post", {**form, "_save": "1"}), str(running.pk))
    assert saved.status_code == 302
    assert dict(stored()[0].weights) == RAMP and stored()[0].actor == "sam"


def test_admin_form_rejects_bad_weights_on_the_field_and_writes_nothing(running, sre, weights_admin):
    before = stored()
    form = {
        "weight__fp16": 50,
        "weight__awq": 30,
        "weight__awq-fa2": 30,
        "reason": "x",
        "expected_revision": before[1],
        "_save": "1",
    }
    page = weights_admin.weights_view(admin_request(sre, "post", form), str(running.pk)).render()
    assert "must sum to 100, got 110" in page.content.decode()
    assert stored() == before


@pytest.mark.engine
def test_admin_form_stale_revision_is_a_conflict(running, sre, weights_admin):
    before = stored()
    form = {
        "weight__fp16": 50,
        "weight__awq": 30,
        "weight__awq-fa2": 20,
        "reason": "x",
        "expected_revision": before[1] - 1,
        "_save": "1",
    }
    page = weights_admin.weights_view(admin_request(sre, "post", form), str(running.pk)).render()
    assert "changed concurrently" in page.content.decode()
    assert stored() == before


def test_admin_form_needs_the_change_weights_permission(running, users, weights_admin):
    from django.core.exceptions import PermissionDenied

    with pytest.raises(PermissionDenied, match="experiments.change_weights"):
        weights_admin.weights_view(admin_request(users["product"]), str(running.pk))


def test_assign_on_a_draft_or_concluded_experiment_names_its_status(
    experiment, users, client_for, wait_until
):
    client = client_for("analyst")
    response = client.get("/api/experiments/ttft-opt/assign", {"user_id": "u"})
    assert response.status_code == 409
    assert (
        response.json()["detail"]
        == "experiment 'ttft-opt' is a draft: its weights are published when it starts"
    )
    services.transition(experiment, "start", users["product"], reason="go")
    services.transition(experiment, "conclude", users["product"], reason="done")
    # The router hears of the retired weights through its watch, a moment after the commit.
    wait_until(
        lambda: client.get("/api/experiments/ttft-opt/assign", {"user_id": "u"}).status_code != 200,
        "the router to drop the concluded experiment's weights",
    )
    response = client.get("/api/experiments/ttft-opt/assign", {"user_id": "u"})
    assert response.status_code == 409 and "is concluded" in response.json()["detail"]
    assert client.get("/api/experiments/nope/assign", {"user_id": "u"}).status_code == 404


def test_putting_the_weights_already_stored_says_nothing_changed(running, client_for):
    _, revision = stored()
    body = {
        "weights": {"fp16": 34, "awq": 33, "awq-fa2": 33},
        "reason": "same",
        "expected_revision": revision,
    }
    response = client_for("sre").put("/api/experiments/ttft-opt/weights", body, format="json")
    assert response.status_code == 200 and response.json()["changed"] is False
    assert response.json()["revision"] == revision == stored()[1]
