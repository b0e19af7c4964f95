"""Starting a capacity search from the admin: sre only, validated like the API, recorded and
handed to the background (replaced here by a recorder: the search itself is tested end to end
in test_capacity_command.py)."""

from __future__ import annotations

import pytest

from capacity.models import CapacitySearch
from experiments import services

TRACE = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:01.5,11,5\n2023-11-16 18:17:03.5,10,5\n"


@pytest.fixture
def live(document, users, settings, tmp_path, monkeypatch):
    from traces import storage

    settings.TRACE_DIR = tmp_path / "traces"
    trace, _ = storage.store([TRACE.encode()], name="tiny.csv")
    exp = services.apply_document(document, actor=users["product"]).experiment
    services.transition(exp, "start", users["product"])
    started: list[int] = []
    monkeypatch.setattr("capacity.tasks.start_in_background", started.append)
    return exp, trace, started


@pytest.mark.django_db
@pytest.mark.parametrize("weights_backend", ["local"], indirect=True)
@pytest.mark.engine
def test_sre_starts_a_search_from_the_admin_and_others_cannot(weights_backend, live, users, client):
    exp, trace, started = live
    client.force_login(users["sre"])
    listing = client.get("/admin/capacity/capacitysearch/")
    assert listing.status_code == 200 and b"Start a capacity search" in listing.content
    assert client.get("/admin/capacity/capacitysearch/start/").status_code == 200
    form = {
        "experiment": exp.pk,
        "trace": trace.pk,
        "variants": "awq-fa2",
        "arrival": "poisson",
        "cv": 1.0,
        "max_rate": 20,
        "min_rate": 0.5,
        "tolerance": 0.05,
        "max_steps": 6,
        "step_requests": 300,
        "warmup": 2,
        "seed": 0,
        "alpha": 0.05,
        "lag_limit": 5,
    }
    bad = client.post("/admin/capacity/capacitysearch/start/", {**form, "cv": 3.0})
    assert bad.status_code == 200 and b"cv applies to gamma arrivals" in bad.content
    bad = client.post("/admin/capacity/capacitysearch/start/", {**form, "variants": "zzz"})
    assert bad.status_code == 200 and b"no variant [&#x27;zzz&#x27;]" in bad.content
    assert not CapacitySearch.objects.exists() and started == []
    ok = client.post("/admin/capacity/capacitysearch/start/", form)
    record = CapacitySearch.objects.get()
    assert ok.status_code == 302 and ok["Location"].endswith(
        f"/admin/capacity/capacitysearch/{record.pk}/change/"
    )
    assert started == [record.pk] and record.params["variants"] == ["awq-fa2"]
    assert record.params["trace"] == trace.sha256 and record.params["local_paths"] is False
    assert record.started_by == users["sre"]
    client.force_login(users["analyst"])
    assert client.get("/admin/capacity/capacitysearch/start/").status_code == 403
    assert b"Start a capacity search" not in client.get("/admin/capacity/capacitysearch/").content
