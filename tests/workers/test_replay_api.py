"""Replays over the API: who may start, read and cancel them, what bad input gets, and which
files they may read (traces in the trace directory only)."""

import os
import threading
import time
from pathlib import Path

import pytest

from experiments import services
from experiments.models import Experiment
from tests.workers.background import wait_for
from traces.storage import store_file
from workers.models import ReplayRun

ROLES = ["product", "sre", "analyst", "nobody", "admin", None]
SHIPPED = Path(__file__).resolve().parents[2] / "data" / "traces" / "azure_llm_2023_code.csv"
TRACE = SHIPPED.name


def body(**kw):
    """A replay request; a None value leaves its key out."""
    data = {"experiment": "ttft-opt", "trace": TRACE, "limit": 20, **kw}
    return {k: v for k, v in data.items() if v is not None}


@pytest.fixture(autouse=True)
def trace_dir(settings, tmp_path):
    """A fresh trace directory holding the shipped trace, uploaded."""
    settings.TRACE_DIR = tmp_path / "traces"
    return settings.TRACE_DIR


@pytest.fixture
def shipped(db, trace_dir):
    trace, _ = store_file(SHIPPED)
    return trace


@pytest.fixture
def running(experiment, sims, shipped):
    """Running, with its variants on live simulators (the preflight probes GET /v1/models)."""
    Experiment.objects.filter(pk=experiment.pk).update(status="running")
    for v in experiment.variants.all():
        v.endpoint = sims[v.key].url + "/v1"
        v.save(update_fields=["endpoint"])
    experiment.refresh_from_db()
    return experiment


@pytest.fixture
def started(db, document, sims, users, shipped):
    """Started through its lifecycle (its weights published: split replays route by them)."""
    for v in document["variants"]:
        v["endpoint"] = sims[v["key"]].url + "/v1"
        v["api"] = "chat"
    experiment = services.apply_document(document, actor=users["product"]).experiment
    services.transition(experiment, "start", users["product"])
    return experiment


@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.engine
def test_role_matrix(role, client_for, running):
    client = client_for(role)
    created = client.post("/api/replays/", body(), format="json")
    can_operate = role in ("sre", "admin")
    assert created.status_code == (401 if role is None else 202 if can_operate else 403)
    run = ReplayRun.objects.first() or ReplayRun.objects.create(experiment=running, source="x")
    can_read = role in ("sre", "admin", "product", "analyst")
    read = 401 if role is None else 200 if can_read else 403
    assert client.get("/api/replays/").status_code == read
    assert client.get(f"/api/replays/{run.pk}/").status_code == read
    cancel = client.post(f"/api/replays/{run.pk}/cancel/")
    assert cancel.status_code == (401 if role is None else 200 if can_operate else 403)


@pytest.mark.django_db
@pytest.mark.engine
def test_created_run_counts_requests_and_expected_samples(client_for, running, shipped):
    response = client_for("sre").post("/api/replays/", body(mode="mirror"), format="json")
    data = response.json()
    assert response.status_code == 202 and response["Location"] == data["url"]
    assert data["url"] == f"http://testserver/api/replays/{data['id']}/"
    assert data["total_requests"] == 20 and data["expected_samples"] == 60
    assert data["status"] == "queued" and data["started_by"] == "sam"
    assert data["progress"]["shards"] == 1 and data["source_format"] == "azure"
    assert data["source"] == str(shipped.path.resolve())
    by_hash = client_for("sre").post("/api/replays/", body(trace=shipped.sha256, limit=5), format="json")
    assert by_hash.status_code == 202 and by_hash.json()["source"] == data["source"]


@pytest.mark.django_db
@pytest.mark.parametrize(
    "payload, field, says",
    [
        (body(experiment="nope"), "experiment", "no experiment"),
        (body(trace="nope.csv"), "trace", "no trace 'nope.csv'"),
        (body(trace=None), "trace", "give trace"),
        (body(source="x.csv"), "trace", "give trace"),
        (body(arrival={"mode": "poisson"}), "arrival", "rate must be 1e-06 to"),
        (body(limit=0), "limit", "greater than or equal to 1"),
        (body(format="parquet"), "format", "not a valid choice"),
        (body(format="jsonl"), "format", f"does not match trace {TRACE}, which is azure"),
        # caps on what one request may make the workers do
        (
            body(arrival={"speed": 5000}),
            "speed",
            "speed must be at most 1000 (setting REPLAY_MAX_SPEED), got 5000",
        ),
        (
            body(concurrency=5000),
            "concurrency",
            "concurrency must be at most 4096 (setting REPLAY_MAX_CONCURRENCY)",
        ),
        (
            body(arrival={"mode": "closed", "concurrency": 10_000}),
            "arrival.concurrency",
            "arrival.concurrency must be at most 4096",
        ),
        (body(limit=6_000_000), "limit", "limit must be at most 5000000 (setting REPLAY_MAX_REQUESTS)"),
    ],
)
def test_bad_requests_name_the_problem_and_create_nothing(client_for, running, payload, field, says):
    response = client_for("sre").post("/api/replays/", payload, format="json")
    assert response.status_code == 400 and says in str(response.json()[field]), response.json()
    assert not ReplayRun.objects.exists()


@pytest.mark.django_db
def test_requests_over_the_cap_need_a_limit(client_for, running, settings):
    settings.REPLAY_MAX_REQUESTS = 100
    response = client_for("sre").post("/api/replays/", body(limit=None), format="json")
    assert response.status_code == 400 and response.json()["limit"] == [
        f"trace {TRACE} has 8819 requests, over the cap of 100 (setting REPLAY_MAX_REQUESTS); give a limit"
    ]
    assert client_for("sre").post("/api/replays/", body(limit=100), format="json").status_code == 202


def file_content_leaks(response, environ: bool = True, given: str = "") -> list[str]:
    """Any line of /etc/passwd (or value of this process's environment) in the response, but
    for what the request itself said (``given``)."""
    text = response.content.decode()
    secrets = [line for line in Path("/etc/passwd").read_text().splitlines() if line]
    secrets += [v for v in os.environ.values() if len(v) >= 8] if environ else []
    return [s for s in secrets if s in text and s not in given]


@pytest.mark.django_db
@pytest.mark.parametrize(
    "source, says",
    [
        ("/proc/self/environ", "'/proc/self/environ' is an absolute path"),
        ("/etc/passwd", "'/etc/passwd' is an absolute path"),
        ("/dev/zero", "'/dev/zero' is an absolute path"),
        (str(SHIPPED), "is an absolute path; only traces in the trace directory can be replayed here"),
        ("../../../../../../etc/passwd", "'..' is not allowed"),
        ("data/traces/azure_llm_2023_code.csv", "no trace 'data/traces/azure_llm_2023_code.csv'"),
    ],
)
@pytest.mark.parametrize("field", ["source", "trace"])
def test_a_path_outside_the_trace_directory_is_refused_without_reading_it(
    client_for, running, source, says, field
):
    """`source=/proc/self/environ` returned the process environment,
    `/etc/passwd` its first line, and `/dev/zero` would have exhausted memory."""
    payload = body(**{"trace": None, field: source})
    response = client_for("sre").post("/api/replays/", payload, format="json")
    assert response.status_code == 400 and says in response.json()[field][0], response.json()
    assert file_content_leaks(response, given=source) == []
    assert not ReplayRun.objects.exists()


@pytest.mark.django_db
def test_a_symlink_out_of_the_trace_directory_is_refused(client_for, running, trace_dir, tmp_path):
    outside = tmp_path / "outside.csv"
    outside.write_text(SHIPPED.read_text())
    (trace_dir / "innocent.csv").symlink_to(outside)
    (trace_dir / "passwd.csv").symlink_to("/etc/passwd")
    (trace_dir / "zero.csv").symlink_to("/dev/zero")
    for name in ("innocent.csv", "passwd.csv", "zero.csv"):
        response = client_for("sre").post("/api/replays/", body(trace=None, source=name), format="json")
        assert (
            response.status_code == 400 and "leads out of the trace directory" in response.json()["source"][0]
        )
        assert file_content_leaks(response) == []
    assert not ReplayRun.objects.exists()


@pytest.mark.django_db
def test_a_file_in_the_trace_directory_can_be_named_as_source(client_for, running, trace_dir):
    (trace_dir / "copied").mkdir()
    (trace_dir / "copied" / "code.csv").write_text(SHIPPED.read_text())
    response = client_for("sre").post(
        "/api/replays/", body(trace=None, source="copied/code.csv"), format="json"
    )
    assert response.status_code == 202 and response.json()["total_requests"] == 20


@pytest.mark.django_db
def test_only_running_experiments_replay(client_for, experiment, shipped):
    response = client_for("sre").post("/api/replays/", body(), format="json")
    assert response.status_code == 400 and "only running experiments" in response.json()["detail"]


@pytest.mark.django_db
def test_malformed_trace_rejected_before_anything_is_sent(client_for, running, trace_dir):
    (trace_dir / "t.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.1,10,5\nbad,line\n"
    )
    payload = body(trace=None, source="t.csv", limit=None)
    response = client_for("sre").post("/api/replays/", payload, format="json")
    assert response.status_code == 400
    assert response.json()["detail"] == (
        "t.csv: 1 malformed line(s): line 3: expected 3 comma-separated fields "
        "(TIMESTAMP,ContextTokens,GeneratedTokens), got 2"
    )
    ok = client_for("sre").post("/api/replays/", {**payload, "on_malformed": "skip"}, format="json")
    assert ok.status_code == 202 and ok.json()["skipped_lines"] == 1 and ok.json()["total_requests"] == 1


@pytest.mark.django_db
def test_cancel_of_an_ended_run_is_409(client_for, running):
    run = ReplayRun.objects.create(experiment=running, source="x", status="done")
    response = client_for("sre").post(f"/api/replays/{run.pk}/cancel/")
    assert response.status_code == 409 and "already ended" in response.json()["detail"]


@pytest.mark.django_db
@pytest.mark.engine
def test_cancel_of_a_queued_run_ends_it(client_for, running):
    run = ReplayRun.objects.create(experiment=running, source="x")
    assert client_for("sre").post(f"/api/replays/{run.pk}/cancel/").json()["status"] == "cancelled"


def start_form(experiment, **kw) -> dict:
    return {
        "experiment": experiment.pk,
        "source_format": "",
        "mode": "split",
        "arrival": "recorded",
        "speed": 1,
        "rate": 0,
        "cv": 1,
        "concurrency": 8,
        "sample_fraction": 1,
        **kw,
    }


@pytest.mark.django_db
@pytest.mark.engine
def test_sre_starts_a_replay_from_the_admin_and_others_cannot(users, running, shipped):
    from django.test import Client

    sre = Client()
    sre.force_login(users["sre"])
    assert "Start a replay" in sre.get("/admin/workers/replayrun/").content.decode()
    for source, says in [
        ("/etc/passwd", "is an absolute path"),
        ("../x.csv", "&#x27;..&#x27; is not allowed"),
    ]:
        bad = sre.post("/admin/workers/replayrun/start/", start_form(running, source=source))
        assert bad.status_code == 200 and says in bad.content.decode()
        assert file_content_leaks(bad, environ=False) == []
    over = sre.post(
        "/admin/workers/replayrun/start/", start_form(running, trace=shipped.pk, concurrency=5000)
    )
    assert "concurrency must be at most 4096" in over.content.decode()
    assert not ReplayRun.objects.exists()
    ok = sre.post(
        "/admin/workers/replayrun/start/", start_form(running, trace=shipped.pk, mode="mirror", limit=10)
    )
    run = ReplayRun.objects.get()
    assert ok.status_code == 302 and run.started_by == users["sre"] and run.expected_samples == 30
    assert run.source == str(shipped.path.resolve())
    analyst = Client()
    analyst.force_login(users["analyst"])
    assert analyst.get("/admin/workers/replayrun/start/").status_code == 403
    assert "Start a replay" not in analyst.get("/admin/workers/replayrun/").content.decode()


@pytest.mark.django_db
def test_a_plan_over_the_cap_is_a_400_naming_the_cap_unless_confirmed(client_for, running):
    """Preflight: a schedule of days was started without a word."""
    over = client_for("sre").post("/api/replays/", body(limit=50, max_duration=10), format="json")
    assert over.status_code == 400 and "exceeds the cap of 10 s (max_duration 10 s)" in over.json()["detail"]
    assert "API: confirm" in over.json()["detail"] and not ReplayRun.objects.exists()
    ok = client_for("sre").post("/api/replays/", body(limit=50, max_duration=10, confirm=True), format="json")
    assert ok.status_code == 202


@pytest.mark.django_db
def test_the_api_preflight_names_a_dead_variant(client_for, running):
    running.variants.filter(key="awq").update(endpoint="http://127.0.0.1:9/v1")
    response = client_for("sre").post("/api/replays/", body(), format="json")
    assert response.status_code == 400 and "variant 'awq'" in response.json()["detail"]
    assert "does not answer" in response.json()["detail"] and not ReplayRun.objects.exists()
    skipped = client_for("sre").post("/api/replays/", body(preflight=False), format="json")
    assert skipped.status_code == 202


@pytest.mark.django_db(transaction=True)
@pytest.mark.engine
def test_a_replay_started_over_http_answers_at_once_and_runs_in_the_background(
    client_for, started, sample_store
):
    """With eager Celery the replay ran inside the request (minutes for a big one).
    Now the request answers 202 with the run's URL at once, and the run goes on in a thread."""
    client = client_for("sre")
    started = time.monotonic()
    response = client.post("/api/replays/", body(limit=60, arrival={"speed": 10}), format="json")
    answered_s = time.monotonic() - started
    assert response.status_code == 202, response.json()
    url = response["Location"]
    assert url == response.json()["url"] and response.json()["status"] in ("queued", "running")
    # The schedule alone lasts several seconds at 10x: the answer came before the run ended.
    run = ReplayRun.objects.get()
    assert run.status not in ReplayRun.FINAL, f"the request waited for the run ({answered_s:.1f} s)"
    polled = {}

    def final() -> bool:
        polled.update(client.get(url).json())
        return polled["status"] in ReplayRun.FINAL

    wait_for(final, timeout=120, poll=0.2)
    assert polled["status"] == "done", polled["error"]
    assert polled["samples_recorded"] == polled["expected_samples"] == 60 == sample_store.count(run.pk)
    assert polled["outcomes"] == {"ok": 60}
    for thread in threading.enumerate():
        if thread.name == f"abplat-replay-{run.pk}":
            thread.join(timeout=30)  # its database connections closed before the test's teardown
