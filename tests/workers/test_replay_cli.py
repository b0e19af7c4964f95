"""The replay's command line for scripts and SREs (eager Celery, simulated variants, chDB and
the ClickHouse server): replay, build_rollups, sla_report and flush_samples with --json print
one document of real values; progress with rate and ETA goes to stderr, never into it."""

import io
import json

import pytest
from django.core.management import call_command

from samples.spool import Spool
from tests.cli import as_json, command_line, failing, own_env
from tests.samples.conftest import sample_row
from tests.workers.background import TRACE, manage
from workers.models import ReplayRun


@pytest.mark.django_db(transaction=True)
@pytest.mark.engine
def test_replay_json_counts_every_planned_request_and_progress_stays_on_stderr(running, sample_store):
    err = io.StringIO()
    doc = as_json(
        "replay", "ttft-opt", "--trace", TRACE, "--limit", "60", "--speed", "200", "--progress", stderr=err
    )
    run = ReplayRun.objects.get()
    assert set(doc) == {"run", "plan"}
    assert doc["plan"]["requests"] == doc["plan"]["samples"] == 60 and doc["plan"]["duration_s"] > 0
    assert doc["plan"]["rate"] == pytest.approx(60 / doc["plan"]["duration_s"])
    assert doc["run"]["run"] == run.pk and doc["run"]["url"] == f"/api/replays/{run.pk}/"
    assert (doc["run"]["status"], doc["run"]["mode"], doc["run"]["experiment"]) == (
        "done",
        "split",
        "ttft-opt",
    )
    assert doc["run"]["total_requests"] == doc["run"]["expected_samples"] == 60
    assert doc["run"]["samples_recorded"] == run.samples_recorded == sample_store.count(run.pk) == 60
    assert doc["run"]["outcomes"] == {"ok": 60} and doc["run"]["skipped_lines"] == 0
    assert doc["run"]["lag_p99_ms"] == max(run.shards.values_list("lag_p99_ms", flat=True))
    # --progress without a terminal: plain lines on stderr with rate and ETA, the last one complete;
    # the plan and summary for a person are on stderr too
    lines = err.getvalue().splitlines()
    drawn = [line for line in lines if " samples/s " in line]
    assert drawn and all("ETA" in line and "elapsed" in line for line in drawn)
    assert drawn[-1].startswith("60/60 samples 100%") and drawn[-1].endswith("60 sent, done")
    assert any(line.startswith("plan: 60 requests") for line in lines)
    assert f"run {run.pk} done: 60/60 samples, outcomes {{'ok': 60}}" in lines


@pytest.mark.django_db(transaction=True)
@pytest.mark.engine
def test_replay_progress_is_off_without_a_terminal_and_the_plain_output_is_unchanged(running, sample_store):
    out, err = io.StringIO(), io.StringIO()
    call_command(
        "replay", "ttft-opt", "--trace", TRACE, "--limit", "20", "--speed", "200", stdout=out, stderr=err
    )
    assert err.getvalue() == ""
    assert out.getvalue().startswith("plan: 20 requests") and "done: 20/20 samples" in out.getvalue()
    assert "samples/s" not in out.getvalue()


@pytest.mark.django_db(transaction=True)
@pytest.mark.engine
def test_replay_json_refusals_name_the_option(running, sample_store, settings):
    _, doc = failing("replay", "nope", "--trace", TRACE)
    assert doc["error"] == {
        "message": "no experiment 'nope'; `manage.py experiment list` lists them",
        "field": "key",
        "errors": [],
    }
    settings.REPLAY_MAX_REQUESTS = 10
    _, doc = failing("replay", "ttft-opt", "--trace", TRACE, "--limit", "11")
    assert doc["error"]["field"] == "--limit" and "REPLAY_MAX_REQUESTS" in doc["error"]["message"]
    _, doc = failing("replay", "ttft-opt", "--trace", TRACE, "--limit", "5", "--cv", "2")
    assert doc["error"]["field"] is None and "--cv applies to --arrival gamma" in doc["error"]["message"]
    assert not ReplayRun.objects.exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.engine
def test_a_replay_that_does_not_end_done_exits_non_zero_with_its_run(running, sample_store, monkeypatch):
    """Cancelled before its first send (as by the API's cancel): the error document still
    carries the run and its plan."""
    from workers import service

    def cancelled_at_once(request):
        run = create_run(request)
        ReplayRun.objects.filter(pk=run.pk).update(cancel_requested=True)
        return run

    create_run = service.create_run
    monkeypatch.setattr(service, "create_run", cancelled_at_once)
    _, doc = failing("replay", "ttft-opt", "--trace", TRACE, "--limit", "30", "--speed", "1")
    run = ReplayRun.objects.get()
    assert run.status == "cancelled"
    assert doc["error"] == {"message": f"run {run.pk} ended cancelled", "field": None, "errors": []}
    assert doc["run"]["status"] == "cancelled" and doc["run"]["samples_recorded"] == run.samples_recorded
    assert doc["plan"]["requests"] == 30


@pytest.mark.django_db(transaction=True)
@pytest.mark.engine
def test_build_rollups_and_sla_report_json(running, sample_store):
    replayed = as_json("replay", "ttft-opt", "--trace", TRACE, "--limit", "40", "--speed", "200")
    run_id = replayed["run"]["run"]
    err = io.StringIO()
    doc = as_json("build_rollups", "ttft-opt", "--progress", stderr=err)
    assert doc["experiment"] == "ttft-opt" and doc["built"] == 1
    assert [(r["run_id"], r["result"], r["samples"]) for r in doc["runs"]] == [(run_id, "built", 40)]
    assert (
        doc["runs"][0]["seconds"] >= 0
        and doc["rollup_rows"]
        and all(isinstance(n, int) for n in doc["rollup_rows"].values())
    )
    assert "1/1 runs 100%" in err.getvalue() and "1 built" in err.getvalue()
    doc = as_json("build_rollups", "ttft-opt", "--run", "999999")
    assert doc["runs"] == [{"run_id": 999999, "result": "no_samples", "samples": 0, "seconds": None}]
    assert doc["built"] == 0

    report = as_json("sla_report", "ttft-opt", "--run", str(run_id))
    assert sum(v["n"] for v in report["variants"]) == 40
    _, doc = failing("sla_report", "ttft-opt", "--run", "999999")
    assert doc["error"]["field"] == "--run" and "unknown run" in doc["error"]["message"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.engine
def test_flush_samples_json_counts_the_rows_it_wrote(db, sample_store, tmp_path):
    spool = Spool(str(tmp_path / "retired-worker"))
    spool.append([sample_row(i) for i in range(25)])
    spool.append([sample_row(i) for i in range(25, 40)])
    sample_store.insert_samples([sample_row(i) for i in range(5)])  # some were stored already
    err = io.StringIO()
    doc = as_json("flush_samples", "--spool-dir", spool.dir, "--progress", stderr=err)
    assert doc == {
        "spool": spool.id,
        "forgotten": None,
        "files": 2,
        "flushed": 35,
        "already_stored": 5,
        "quarantined": [],
        "runs": [],
    }
    assert sample_store.count(7) == 40 and spool.pending_files() == []
    assert "2/2 files 100%" in err.getvalue()
    _, doc = failing("flush_samples", "--spool-dir", str(tmp_path))
    assert doc["error"]["field"] == "--spool-dir" and "not a spool directory" in doc["error"]["message"]


@pytest.mark.process
def test_demo_json_prints_its_replay_report_and_capacity(tmp_path):
    """The demo as a script would run it: one document, the replay counted whole (every request
    to every variant), its report, and a capacity search of the control (a tiny one here)."""
    env = own_env(tmp_path)
    code, doc, _ = command_line(env, "demo", "--json")  # it would serve forever after the document
    assert code == 1 and doc["error"]["field"] == "--json"
    code, doc, err = command_line(
        env,
        "demo",
        "--json",
        "--no-serve",
        "--limit",
        "20",
        "--speed",
        "50",
        "--replicas",
        "1",
        "--progress",
        "--capacity-steps",
        "2",
        "--capacity-requests",
        "50",
    )
    assert code == 0, err[-3000:]
    assert doc["experiment"] == "ttft-optimizations"
    assert doc["trace"]["prompt_budget"] == 384 and doc["trace"]["answer_budget"] == 32
    assert 0 < doc["trace"]["rows"] < doc["trace"]["of"] == 8819
    assert [s["variant"] for s in doc["simulators"]] == ["fp16", "awq", "awq-fa2"]
    assert doc["replay"]["run"]["status"] == "done" and doc["replay"]["run"]["mode"] == "mirror"
    assert doc["replay"]["run"]["samples_recorded"] == doc["replay"]["plan"]["samples"] == 60
    assert doc["report"]["runs"]["read"][0]["run_id"] == doc["replay"]["run"]["run"]
    assert [v["n"] for v in doc["report"]["variants"]] == [20, 20, 20]
    assert "60/60 samples 100%" in err and "ETA" in err
    # the control is searched, and the variants that met the target; on 20 requests none can
    # meet 99.2% with confidence, so the one closest to it (the highest attainment; of equals,
    # the first in the document) is searched with it, from the top if its estimate is above
    # the target
    variants = [v for v in doc["report"]["variants"] if not v["control"]]
    assert not any(v["verdict"]["verdict"] == "meets" for v in variants)
    best = max(variants, key=lambda v: v["attainment"]["estimate"])
    capacity = doc["capacity"]
    assert set(capacity["variants"]) == {"fp16", best["key"]} and set(capacity["ranking"]) == {
        "fp16",
        best["key"],
    }
    first = 128.0 if best["attainment"]["estimate"] >= 0.992 else 64.0
    assert capacity["variants"][best["key"]]["steps"][0]["rate_rps"] == first
    steps = capacity["variants"]["fp16"]["steps"]
    assert [s["rate_rps"] for s in steps] == [64.0, 32.0] and all(s["run_id"] for s in steps)
    assert capacity["variants"]["fp16"]["cost"]["per_hour"] == 4.0  # 16 USD/h for 4 engines, here 1
    assert capacity["summary"].endswith(".") and capacity["seconds"] > 0
    assert "fp16: step at 64 req/s ..." in err
    assert isinstance(doc["warnings"], list)  # a sentence when the replay lagged as on a busy machine


@pytest.mark.services
def test_replay_json_without_wait_on_a_broker_prints_the_queued_run(demo_env):
    """Real workers, no --wait: the document is the run as queued, at once (no worker needed)."""
    doc = json.loads(
        manage(
            demo_env,
            "replay",
            "ttft-optimizations",
            "--trace",
            TRACE,
            "--limit",
            "25",
            "--shards",
            "2",
            "--json",
        )
    )
    assert doc["run"]["status"] == "queued" and doc["run"]["shards"] == 2
    assert doc["run"]["total_requests"] == doc["run"]["expected_samples"] == doc["plan"]["samples"] == 25
    assert doc["run"]["samples_recorded"] == 0 and doc["run"]["url"] == f"/api/replays/{doc['run']['run']}/"
