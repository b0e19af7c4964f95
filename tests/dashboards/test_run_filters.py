"""On the web and the command line: the run catalog's status and mode filters, the
cache key following the catalog, unknown runs, every SLO in sla_report's header."""

from __future__ import annotations

import io
import json

import pytest
from django.core.management import CommandError, call_command

from samples import synthetic

pytestmark = pytest.mark.django_db


def load(store, run_id: int, mode: str, n: int, start_ms: float) -> None:
    spec = synthetic.SyntheticSpec(
        mode=mode,
        n=n,
        seed=run_id,
        run_id=run_id,
        duration_s=60.0,
        variants=synthetic.demo_variants(),
        start_unix_ms=start_ms,
    )
    store.insert_columns(synthetic.generate(spec).columns)


T0 = synthetic.DEFAULT_START_MS


@pytest.fixture
def two_runs(sample_store, experiment):
    load(sample_store, 1, "split", 300, T0)
    load(sample_store, 2, "split", 200, T0 + 120_000)
    sample_store.record_run(1, "ttft-opt", "split", "done")
    sample_store.record_run(2, "ttft-opt", "split", "running")
    return sample_store


def total(doc) -> int:
    return sum(v["n"] for v in doc["variants"])


def test_a_run_going_from_running_to_done_changes_the_cached_report(client_for, two_runs):
    api = client_for("analyst")
    first = api.get("/api/experiments/ttft-opt/report").json()
    assert total(first) == 300 and first["runs"]["not_read"][0]["status"] == "running"
    assert api.get("/api/experiments/ttft-opt/report").json()["timing"]["cache"] == "hit"
    two_runs.record_run(2, "ttft-opt", "split", "done")
    second = api.get("/api/experiments/ttft-opt/report").json()
    assert second["timing"]["cache"] == "miss" and total(second) == 500


def test_status_and_mode_filters_on_every_surface(client_for, client, users, two_runs):
    api = client_for("analyst")
    for query in ("?status=running&status=done", "?status=running,done", "?status=all"):
        doc = api.get("/api/experiments/ttft-opt/report" + query).json()
        assert total(doc) == 500 and "includes running run 2: partial" in doc["banners"], query
    assert total(api.get("/api/experiments/ttft-opt/report?mode=mirror").json()) == 0
    bad = api.get("/api/experiments/ttft-opt/report?status=finished")
    assert bad.status_code == 400 and "status=" in bad.json()["filters"]
    assert api.get("/api/experiments/ttft-opt/report?mode=shadow").status_code == 400
    client.force_login(users["analyst"])
    page = client.get("/dashboards/ttft-opt/?status=running&status=done").content.decode()
    assert "includes running run 2: partial" in page and "2 (running: partial)" in page
    page = client.get("/dashboards/ttft-opt/").content.decode()
    assert "not read (not completed): running run 2" in page
    out = io.StringIO()
    call_command("sla_report", "ttft-opt", "--status", "running", "--status", "done", "--json", stdout=out)
    assert total(json.loads(out.getvalue())) == 500
    out = io.StringIO()
    call_command("sla_report", "ttft-opt", "--mode", "split", stdout=out)
    assert "runs read: 1 (done); mode split (filter)" in out.getvalue()
    with pytest.raises(CommandError, match="status="):
        call_command("sla_report", "ttft-opt", "--status", "finished")


def test_an_unknown_run_is_an_error_not_an_empty_report(client_for, client, users, two_runs, document):
    from experiments.services import apply_document

    other = dict(document, key="other-exp")
    apply_document(other, actor=users["product"])
    spec = synthetic.SyntheticSpec(
        experiment="other-exp", n=10, seed=77, run_id=77, variants=synthetic.demo_variants()
    )
    two_runs.insert_columns(synthetic.generate(spec).columns)
    two_runs.record_run(88, "ttft-opt", "split", "failed")  # a catalog row without samples is known
    api = client_for("analyst")
    for run in (999, 77):  # no such run; another experiment's run
        resp = api.get(f"/api/experiments/ttft-opt/report?run={run}")
        assert (
            resp.status_code == 400
            and f"run={run}: unknown run of experiment 'ttft-opt'" in resp.json()["filters"]
        )
        assert "its runs: 1, 2, 88" in resp.json()["filters"]
        client.force_login(users["analyst"])
        assert client.get(f"/dashboards/ttft-opt/?run={run}").status_code == 400
        assert client.get(f"/dashboards/ttft-opt/export/variants.csv?run={run}").status_code == 400
        with pytest.raises(CommandError, match=f"run={run}: unknown run"):
            call_command("sla_report", "ttft-opt", "--run", str(run))
    assert api.get("/api/experiments/ttft-opt/report?run=88").status_code == 200


def test_sla_report_header_names_every_slo(client_for, two_runs, experiment):
    experiment.sla_tpot_ms, experiment.sla_e2e_ms = 50, 2500
    experiment.save()
    out = io.StringIO()
    call_command("sla_report", "ttft-opt", stdout=out)
    head = out.getvalue().splitlines()[0]
    assert "TTFT < 200 ms, TPOT < 50 ms, end-to-end < 2500 ms for 99.20% of requests" in head


def test_empty_csv_exports_have_their_header(client, users, sample_store, experiment, tmp_path):
    client.force_login(users["analyst"])
    from dashboards import tables

    for table in tables.TABLES:
        resp = client.get(f"/dashboards/ttft-opt/export/{table}.csv")
        lines = resp.content.decode().splitlines()
        assert resp.status_code == 200 and lines[0] == ",".join(tables.COLUMNS[table]), table
        if table not in ("variants", "percentiles"):  # those list every variant, with n = 0
            assert len(lines) == 1, table
    call_command("sla_report", "ttft-opt", "--csv", str(tmp_path), stdout=io.StringIO())
    for table in tables.TABLES:
        assert (tmp_path / f"{table}.csv").read_text().splitlines()[0] == ",".join(tables.COLUMNS[table])
