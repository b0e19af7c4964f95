"""The main job end to end on eager Celery: a trace replayed through simulated variants into
the sample store (chDB and the ClickHouse server), exactly one sample per request."""

import io
from collections import Counter
from unittest.mock import ANY

import pytest
from django.core.management import CommandError, call_command

from analysis.definitions import Filters
from analysis.readers.merged import Scope, report_scope
from dashboards import reports as report
from dashboards.management.commands import build_rollups
from experiments import services
from samples.signals import replay_finished
from workers.models import ReplayRun

pytestmark = pytest.mark.engine

TRACE = "data/traces/azure_llm_2023_code.csv"


class StillReplaying:
    """The sample store as a replay still writing leaves it: one more sample of the run lands
    right after the first statement of whatever runs against it."""

    def __init__(self, store, run_id: int):
        self._store, self._run_id, self._landed = store, run_id, False

    def __getattr__(self, name):
        return getattr(self._store, name)

    def execute(self, sql, params=None):
        self._store.execute(sql, params)
        if not self._landed:
            self._landed = True
            names = self._store.query_columns("SELECT * FROM samples LIMIT 0")
            copy = {"seq": "seq + 10000", "request_id": "concat(request_id, '-late')"}
            exprs = ", ".join(copy.get(n, n) for n in names)
            self._store.execute(
                f"INSERT INTO samples SELECT {exprs} FROM samples WHERE run_id = %(r)s ORDER BY seq LIMIT 1",
                {"r": self._run_id},
            )


def replay(*args) -> str:
    out = io.StringIO()
    call_command("replay", "ttft-opt", "--trace", TRACE, *args, stdout=out)
    return out.getvalue()


@pytest.mark.django_db(transaction=True)
def test_split_replay_records_exactly_one_sample_per_request(running, sample_store):
    out = replay("--limit", "120", "--speed", "200")
    run = ReplayRun.objects.get()
    assert run.status == "done", (run.error, out)
    assert run.samples_recorded == 120 == sample_store.count(run.pk)
    rows = sample_store.query(
        "SELECT seq, variant, user_id, config_revision, outcome FROM samples FINAL WHERE run_id = %(r)s",
        {"r": run.pk},
    )
    assert sorted(r[0] for r in rows) == list(range(120))
    # the router's assignment: every user always lands on the same variant
    by_user = {}
    for _seq, variant, user, revision, _outcome in rows:
        assert by_user.setdefault(user, variant) == variant and revision > 0
    assert Counter(r[4] for r in rows) == {"ok": 120}
    assert "done: 120/120 samples" in out
    # the finished run's report rollup was built, and the report reads it: same numbers as raw
    exp = report.experiment_info(running)
    f = Filters("ttft-opt")
    assert report_scope(sample_store, f, exp.slo) == Scope({run.pk: ANY})
    fast, raw = (
        report.build_report(sample_store, exp, f),
        report.build_report(sample_store, exp, f, use_rollup=False),
    )
    assert (fast["timing"]["source"], raw["timing"]["source"]) == ("rollup", "samples")
    assert [(v["key"], v["n"], v["hits"]) for v in fast["variants"]] == [
        (v["key"], v["n"], v["hits"]) for v in raw["variants"]
    ]
    assert sum(v["n"] for v in fast["variants"]) == 120
    assert fast["variants"][0]["percentiles"] == raw["variants"][0]["percentiles"]


@pytest.mark.django_db(transaction=True)
def test_the_end_of_a_run_is_announced_and_a_failing_receiver_never_fails_it(running, sample_store, caplog):
    heard = []

    def listener(sender, **kwargs):
        heard.append((kwargs["run_id"], kwargs["experiment"], kwargs["store"] is not None))
        raise RuntimeError("this receiver broke")

    replay_finished.connect(listener, dispatch_uid="test-listener")
    try:
        replay("--limit", "10", "--speed", "200")
    finally:
        replay_finished.disconnect(dispatch_uid="test-listener")
    run = ReplayRun.objects.get()
    assert run.status == "done" and heard == [(run.pk, "ttft-opt", True)]
    assert "this receiver broke" in caplog.text
    # the report's own receiver (dashboards.receivers) still built the rollup
    exp = report.experiment_info(running)
    assert report_scope(sample_store, Filters("ttft-opt"), exp.slo) == Scope({run.pk: ANY})


@pytest.mark.django_db(transaction=True)
def test_mirror_replay_sends_every_request_to_every_variant(running, sample_store):
    replay("--limit", "30", "--speed", "200", "--mode", "mirror")
    run = ReplayRun.objects.get()
    assert run.status == "done" and run.samples_recorded == 90
    assert sample_store.counts_by_variant(run.pk) == {"awq": 30, "awq-fa2": 30, "fp16": 30}


@pytest.mark.django_db(transaction=True)
def test_a_failing_variant_still_gets_one_sample_per_request(running, sample_store):
    running.variants.filter(key="awq").update(endpoint="http://127.0.0.1:9/v1")  # nothing listens
    # A fault drill: the preflight would refuse the dead variant, so it is skipped on purpose.
    replay("--limit", "40", "--speed", "200", "--mode", "mirror", "--no-preflight")
    run = ReplayRun.objects.get()
    assert run.status == "done" and run.samples_recorded == 120
    assert run.outcomes == {"ok": 80, "connect_error": 40}


@pytest.mark.django_db(transaction=True)
def test_replay_refuses_a_draft_experiment(document, sample_store):
    services.apply_document(document)
    with pytest.raises(CommandError, match="only running experiments replay"):
        replay("--limit", "5")
    assert not ReplayRun.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_build_rollups_rebuilds_a_finished_run_and_skips_one_still_replaying(
    running, sample_store, monkeypatch
):
    replay("--limit", "30", "--speed", "200")
    run = ReplayRun.objects.get()
    slo = report.slo_of(running)
    sample_store.execute("TRUNCATE TABLE rollup_builds")  # as if built before rollups existed
    assert report_scope(sample_store, Filters("ttft-opt"), slo) is None
    out = io.StringIO()
    call_command("build_rollups", "ttft-opt", stdout=out)
    assert f"run {run.pk}: 30 samples rolled up" in out.getvalue() and "1 run(s) built" in out.getvalue()
    assert report_scope(sample_store, Filters("ttft-opt"), slo) == Scope({run.pk: ANY})
    # A run still replaying: one of its samples lands while the command builds it. The command
    # reads only the sample store (nothing outside workers asks the replay's database), sees the
    # samples move, publishes nothing of the run and goes on.
    monkeypatch.setattr(build_rollups, "sample_store", lambda: StillReplaying(sample_store, run.pk))
    out = io.StringIO()
    call_command("build_rollups", "ttft-opt", "--run", str(run.pk), stdout=out)
    assert f"run {run.pk}: still replaying (its samples changed during the build), skipped" in out.getvalue()
    assert "0 run(s) built" in out.getvalue() and sample_store.count(run.pk) == 31
    assert report_scope(sample_store, Filters("ttft-opt"), slo) is None  # the report reads raw
    call_command("build_rollups", "ttft-opt", "--run", "999999", stdout=(out := io.StringIO()))
    assert "run 999999: no samples of 'ttft-opt', nothing to build" in out.getvalue()
    with pytest.raises(CommandError, match="no experiment with key 'nope'"):
        call_command("build_rollups", "nope")


@pytest.mark.django_db(transaction=True)
def test_prompts_are_planned_on_each_variants_tokenizer_before_time_zero(db, document, users, sample_store):
    """Variants whose tokenizer is not one word a token (the simulator's small-vocab rule): the
    run's prompt plan is made before its schedule starts and stored with it, and every sample
    was sent at the trace's length on that tokenizer (the server's usage count says so)."""
    from replay.sources import load_requests
    from simulator.serve import start_in_thread

    sims = {
        v["key"]: start_in_thread("fast", model="tiny-llama", tokenizer="small-vocab")
        for v in document["variants"]
    }
    try:
        for v in document["variants"]:
            v["endpoint"], v["api"] = sims[v["key"]].url + "/v1", "chat"
        experiment = services.apply_document(document, actor=users["product"]).experiment
        services.transition(experiment, "start", users["product"])
        out = replay("--limit", "30", "--speed", "200", "--mode", "mirror")
    finally:
        for h in sims.values():
            h.stop()
    run = ReplayRun.objects.get()
    assert run.status == "done", (run.error, out)
    assert set(run.prompt_plan) == {"fp16", "awq", "awq-fa2"}
    assert all(len(book) == 30 for book in run.prompt_plan.values())
    wanted = {r.seq: r.prompt_tokens for r in load_requests(TRACE, "azure", limit=30).requests}
    sent = sample_store.query(
        "SELECT seq, prompt_tokens, prompt_tokens_estimated FROM samples FINAL WHERE run_id = %(r)s",
        {"r": run.pk},
    )
    assert len(sent) == 90
    assert all(tokens == wanted[seq] and not estimated for seq, tokens, estimated in sent)
