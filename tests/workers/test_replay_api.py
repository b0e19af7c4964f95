"""Replays over the API: who may start, read and cancel them, and what bad input gets."""

import pytest

from experiments.models import Experiment
from workers.models import ReplayRun

ROLES = ["product", "sre", "analyst", "nobody", "admin", None]


def body(**kw):
    return {"experiment": "ttft-opt", "source": "data/traces/azure_llm_2023_code.csv", "limit": 20, **kw}


@pytest.fixture
def running(experiment, sims):
    """Running, with its variants on live simulators (the preflight probes GET /v1/models)."""
    Experiment.objects.filter(pk=experiment.pk).update(status="running")
    for v in experiment.variants.all():
        v.endpoint = sims[v.key].url + "/v1"
        v.save(update_fields=["endpoint"])
    experiment.refresh_from_db()
    return experiment


@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLES)
def test_role_matrix(role, client_for, running):
    client = client_for(role)
    created = client.post("/api/replays/", body(), format="json")
    can_operate = role in ("sre", "admin")
    assert created.status_code == (401 if role is None else 201 if can_operate else 403)
    run = ReplayRun.objects.first() or ReplayRun.objects.create(experiment=running, source="x")
    can_read = role in ("sre", "admin", "product", "analyst")
    read = 401 if role is None else 200 if can_read else 403
    assert client.get("/api/replays/").status_code == read
    assert client.get(f"/api/replays/{run.pk}/").status_code == read
    cancel = client.post(f"/api/replays/{run.pk}/cancel/")
    assert cancel.status_code == (401 if role is None else 200 if can_operate else 403)


@pytest.mark.django_db
def test_created_run_counts_requests_and_expected_samples(client_for, running):
    response = client_for("sre").post("/api/replays/", body(mode="mirror"), format="json")
    data = response.json()
    assert data["total_requests"] == 20 and data["expected_samples"] == 60
    assert data["status"] == "queued" and data["started_by"] == "sam"
    assert data["progress"]["shards"] == 1


@pytest.mark.django_db
@pytest.mark.parametrize(
    "payload, says",
    [
        (body(experiment="nope"), "no experiment"),
        (body(source="/nonexistent.csv"), "cannot read"),
        (body(arrival={"mode": "poisson"}), "rate must be > 0"),
        (body(limit=0), "greater than or equal to 1"),
        (body(format="parquet"), "not a valid choice"),
    ],
)
def test_bad_requests_name_the_problem_and_create_nothing(client_for, running, payload, says):
    response = client_for("sre").post("/api/replays/", payload, format="json")
    assert response.status_code == 400 and says in str(response.json())
    assert not ReplayRun.objects.exists()


@pytest.mark.django_db
def test_only_running_experiments_replay(client_for, experiment):
    response = client_for("sre").post("/api/replays/", body(), format="json")
    assert response.status_code == 400 and "only running experiments" in response.json()["detail"]


@pytest.mark.django_db
def test_malformed_trace_rejected_before_anything_is_sent(client_for, running, tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.1,10,5\nbad,line\n")
    response = client_for("sre").post("/api/replays/", body(source=str(trace), limit=None), format="json")
    assert response.status_code == 400 and "line 3" in response.json()["detail"]
    ok = client_for("sre").post(
        "/api/replays/", body(source=str(trace), limit=None, on_malformed="skip"), format="json"
    )
    assert ok.status_code == 201 and ok.json()["skipped_lines"] == 1 and ok.json()["total_requests"] == 1


@pytest.mark.django_db
def test_cancel_of_an_ended_run_is_409(client_for, running):
    run = ReplayRun.objects.create(experiment=running, source="x", status="done")
    response = client_for("sre").post(f"/api/replays/{run.pk}/cancel/")
    assert response.status_code == 409 and "already ended" in response.json()["detail"]


@pytest.mark.django_db
def test_cancel_of_a_queued_run_ends_it(client_for, running):
    run = ReplayRun.objects.create(experiment=running, source="x")
    assert client_for("sre").post(f"/api/replays/{run.pk}/cancel/").json()["status"] == "cancelled"


@pytest.mark.django_db
def test_sre_starts_a_replay_from_the_admin_and_others_cannot(users, running):
    from django.test import Client

    sre = Client()
    sre.force_login(users["sre"])
    assert "Start a replay" in sre.get("/admin/workers/replayrun/").content.decode()
    bad = sre.post("/admin/workers/replayrun/start/", {
        "experiment": running.pk, "source": "/nonexistent.csv", "source_format": "azure", "mode": "split",
        "arrival": "recorded", "speed": 1, "rate": 0, "cv": 1, "concurrency": 8, "sample_fraction": 1,
    })  # fmt: skip
    assert bad.status_code == 200 and "cannot read" in bad.content.decode()
    assert not ReplayRun.objects.exists()
    ok = sre.post("/admin/workers/replayrun/start/", {
        "experiment": running.pk, "source": "data/traces/azure_llm_2023_code.csv", "source_format": "azure",
        "mode": "mirror", "arrival": "recorded", "speed": 1, "rate": 0, "cv": 1, "concurrency": 8,
        "limit": 10, "sample_fraction": 1,
    })  # fmt: skip
    run = ReplayRun.objects.get()
    assert ok.status_code == 302 and run.started_by == users["sre"] and run.expected_samples == 30
    analyst = Client()
    analyst.force_login(users["analyst"])
    assert analyst.get("/admin/workers/replayrun/start/").status_code == 403
    assert "Start a replay" not in analyst.get("/admin/workers/replayrun/").content.decode()


@pytest.mark.django_db
def test_a_plan_over_the_cap_is_a_400_naming_the_cap_unless_confirmed(client_for, running):
    """issue 16, preflight: a schedule of days was started without a word."""
    over = client_for("sre").post("/api/replays/", body(limit=50, max_duration=10), format="json")
    assert over.status_code == 400 and "exceeds the cap of 10 s (max_duration 10 s)" in over.json()["detail"]
    assert "API: confirm" in over.json()["detail"] and not ReplayRun.objects.exists()
    ok = client_for("sre").post("/api/replays/", body(limit=50, max_duration=10, confirm=True), format="json")
    assert ok.status_code == 201


@pytest.mark.django_db
def test_the_api_preflight_names_a_dead_variant(client_for, running):
    running.variants.filter(key="awq").update(endpoint="http://127.0.0.1:9/v1")
    response = client_for("sre").post("/api/replays/", body(), format="json")
    assert response.status_code == 400 and "variant 'awq'" in response.json()["detail"]
    assert "does not answer" in response.json()["detail"] and not ReplayRun.objects.exists()
    skipped = client_for("sre").post("/api/replays/", body(preflight=False), format="json")
    assert skipped.status_code == 201
