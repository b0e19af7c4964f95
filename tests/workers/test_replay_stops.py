"""Replays on eager Celery: request shapes decided before sending, concluding mid-run, runs
whose owner died, the run catalog, the preflight and contradictory options."""

import datetime as dt
import io
import json
import time

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from experiments import services
from tests.workers.background import replay_in_thread, wait_for
from workers.models import ReplayRun, ReplayShard
from workers.runs import cancel_run
from workers.tasks import lease_s

pytestmark = pytest.mark.engine

TRACE = "data/traces/azure_llm_2023_code.csv"


def replay(*args, trace=TRACE) -> str:
    out = io.StringIO()
    call_command("replay", "ttft-opt", "--trace", str(trace), *args, stdout=out)
    return out.getvalue()


def chat_log(tmp_path, n=12):
    path = tmp_path / "chat.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": i * 0.01,
                    "messages": [{"role": "user", "content": f"question {i}"}],
                    "max_tokens": 4,
                }
            )
            + "\n"
            for i in range(n)
        )
    )
    return path


@pytest.mark.django_db(transaction=True)
def test_chat_log_to_a_completions_variant_is_refused_before_anything_is_sent(
    running, sample_store, tmp_path
):
    """41/55 requests were recorded `malformed` and the report declared a
    regression; now the run is refused, naming the lines and the variant."""
    running.variants.filter(key="awq-fa2").update(api="completions")
    log = chat_log(tmp_path)
    with pytest.raises(CommandError) as info:
        replay("--format", "jsonl", "--mode", "mirror", trace=log)
    message = str(info.value)
    assert "12 line(s) (1, 2, 3, 4, 5 and 7 more) give chat `messages`" in message
    assert "variant(s) awq-fa2 take completions" in message and "--render-chat plain" in message
    assert not ReplayRun.objects.exists() and sample_store.count(0) == 0
    # The documented rendering, asked for: every request ok, none counted against a server.
    replay("--format", "jsonl", "--mode", "mirror", "--render-chat", "plain", trace=log)
    run = ReplayRun.objects.get()
    assert run.status == "done" and run.render_chat == "plain" and run.outcomes == {"ok": 36}


@pytest.mark.django_db(transaction=True)
def test_prompt_lines_go_to_chat_variants_only_when_asked(running, sample_store, tmp_path):
    log = tmp_path / "prompts.jsonl"
    log.write_text(
        "".join(
            json.dumps({"timestamp": i * 0.01, "prompt": f"p {i}", "max_tokens": 4}) + "\n" for i in range(5)
        )
    )
    with pytest.raises(CommandError, match=r"5 line\(s\) .* give a completions `prompt`.*--wrap-prompt"):
        replay("--format", "jsonl", trace=log)
    assert not ReplayRun.objects.exists()
    replay("--format", "jsonl", "--wrap-prompt", trace=log)
    assert ReplayRun.objects.get().outcomes == {"ok": 5}


@pytest.mark.django_db(transaction=True)
def test_concluding_during_a_split_replay_cancels_it_cleanly(running, sample_store, users, capfd, caplog):
    """The replay kept sending, printed 89 "Task exception was never retrieved
    ... UnknownExperiment" and ended failed."""
    # ~38 s of schedule: the conclude lands about when the sends of 6-8 s do, long before the
    # last 37 requests (37-38 s)
    thread, out, errors = replay_in_thread("--limit", "100", "--speed", "5")
    wait_for(lambda: ReplayRun.objects.filter(shards__recorded__gt=20).exists())
    services.transition(running, "conclude", users["product"])
    thread.join(60)
    assert not thread.is_alive()
    run = ReplayRun.objects.get()
    assert run.status == "cancelled", (run.error, out.getvalue())
    assert errors and "ended cancelled" in str(errors[0])
    assert run.samples_recorded == sample_store.count(run.pk) < 100
    assert sum(run.shards.values_list("recorded", flat=True)) == run.samples_recorded
    captured = capfd.readouterr()
    assert "never retrieved" not in captured.err + captured.out + caplog.text
    assert "UnknownExperiment" not in captured.err + caplog.text
    assert "replay_cancelled" in set(running.audit.values_list("action", flat=True))
    assert {r["status"] for r in sample_store.runs("ttft-opt")} == {"cancelled"}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("action", ["pause", "conclude"])
def test_pausing_or_concluding_stops_a_mirror_replay(running, sample_store, users, action):
    """A mirror run asks no router (every request goes to every variant),
    so retired weights cannot stop it; the transition cancels it and its shard stops at its
    next check instead of writing on into a paused or concluded experiment."""
    # The first 63 requests go out over 8 s: a shard that did not stop at its next check would
    # still be sending 3 s after the transition (the last 37 come at 37-38 s).
    thread, out, errors = replay_in_thread("--limit", "100", "--speed", "5", "--mode", "mirror")
    wait_for(lambda: ReplayRun.objects.filter(shards__recorded__gt=20).exists())
    services.transition(running, action, users["product"])
    stopped_at = time.time()
    thread.join(60)
    assert not thread.is_alive()
    run = ReplayRun.objects.get()
    assert run.mode == "mirror" and run.status == "cancelled", (run.error, out.getvalue())
    assert errors and "ended cancelled" in str(errors[0])
    # Nothing sent after the shard's next check (about a second; requests in flight finish).
    last_sent_ms = sample_store.query(
        "SELECT max(sent_unix_ms) FROM samples WHERE run_id = %(r)s", {"r": run.pk}
    )[0][0]
    assert last_sent_ms / 1000 < stopped_at + 3.0
    assert run.samples_recorded == sample_store.count(run.pk) < 3 * 100
    assert "replay_cancelled" in set(running.audit.values_list("action", flat=True))


def abandoned_run(experiment, store, *, samples=7, age_s=None):
    """A run as a killed `manage.py replay` leaves it: running, its shard's last heartbeat old
    (``age_s``, the lease and 5 s by default), some samples in the store, counters behind them."""
    from samples.rows import SampleContext, row_from
    from streaming.result import StreamResult

    run = ReplayRun.objects.create(
        experiment=experiment,
        source=TRACE,
        status="running",
        total_requests=50,
        expected_samples=50,
        started_at=timezone.now() - dt.timedelta(seconds=60),
    )
    old = timezone.now() - dt.timedelta(seconds=lease_s() + 5 if age_s is None else age_s)
    ReplayShard.objects.create(
        run=run, index=0, status="running", planned=50, sent=3, recorded=3, heartbeat_at=old
    )
    rows = [
        row_from(
            StreamResult(ttft_ms=5.0, e2e_ms=9.0),
            SampleContext(
                experiment=experiment.key,
                run_id=run.pk,
                seq=i,
                variant="fp16",
                mode="split",
                sent_unix_ms=time.time() * 1000,
            ),
        )
        for i in range(samples)
    ]
    store.insert_samples(rows)
    return run


@pytest.mark.django_db(transaction=True)
def test_the_cancel_api_ends_a_run_whose_owner_died_with_exact_counts(running, sample_store, client_for):
    """A SIGTERMed replay stayed `running` forever; neither the cancel API nor
    flush_samples could end it."""
    run = abandoned_run(running, sample_store)
    response = client_for("sre").post(f"/api/replays/{run.pk}/cancel/")
    assert response.status_code == 200 and response.json()["status"] == "cancelled"
    run.refresh_from_db()
    shard = run.shards.get()
    assert run.samples_recorded == 7 == shard.recorded == shard.sent and run.outcomes == {"ok": 7}
    assert shard.status == "failed" and "abandoned" in shard.error
    assert {r["status"] for r in sample_store.runs("ttft-opt")} == {"cancelled"}
    assert client_for("sre").post(f"/api/replays/{run.pk}/cancel/").status_code == 409


@pytest.mark.django_db(transaction=True)
def test_flush_samples_ends_runs_whose_owner_died_and_leaves_live_ones(running, sample_store):
    dead = abandoned_run(running, sample_store, samples=4)
    alive = abandoned_run(running, sample_store, samples=2, age_s=1)
    out = io.StringIO()
    call_command("flush_samples", stdout=out)
    dead.refresh_from_db(), alive.refresh_from_db()
    assert dead.status == "failed" and dead.samples_recorded == 4 and "abandoned" in dead.error
    assert f"run {dead.pk}: owner lost, failed, 4 samples" in out.getvalue()
    assert alive.status == "running"
    # cancelling a live run only asks; its shard (alive) stops at its next check
    assert cancel_run(alive) and alive.status == "running" and alive.cancel_requested


@pytest.mark.django_db(transaction=True)
def test_a_finished_run_is_in_the_run_catalog(running, sample_store):
    replay("--limit", "10", "--speed", "200", "--mode", "mirror")
    run = ReplayRun.objects.get()
    (entry,) = sample_store.runs("ttft-opt")
    assert (entry["run_id"], entry["status"], entry["mode"], entry["source"]) == (
        run.pk,
        "done",
        "mirror",
        "replay",
    )
    assert 0 < entry["started_ms"] <= entry["finished_ms"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("sample_store", ["chdb"], indirect=True)
def test_preflight_names_a_dead_variant_and_a_wrong_model(running, sample_store):
    running.variants.filter(key="awq").update(endpoint="http://127.0.0.1:9/v1")
    running.variants.filter(key="fp16").update(model="no-such-model")
    with pytest.raises(CommandError) as info:
        replay("--limit", "5")
    message = str(info.value)
    assert message.startswith("preflight failed, nothing was sent")
    assert "variant 'awq': http://127.0.0.1:9/v1/models does not answer" in message
    assert "variant 'fp16': model 'no-such-model' is not served" in message and "tiny-llama" in message
    assert not ReplayRun.objects.exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("sample_store", ["chdb"], indirect=True)
def test_a_plan_longer_than_the_cap_is_refused_unless_confirmed(running, sample_store, tmp_path):
    log = tmp_path / "ms.jsonl"  # epoch milliseconds where seconds were meant: days of schedule
    log.write_text(
        "".join(
            json.dumps({"timestamp": 1_700_000_000_000 + i * 1000, "prompt": "p", "max_tokens": 2}) + "\n"
            for i in range(20)
        )
    )
    with pytest.raises(CommandError) as info:
        replay("--format", "jsonl", "--wrap-prompt", trace=log)
    message = str(info.value)
    assert "plan: 20 requests over 5 h 16 min" in message and "exceeds the cap of 2 h 0 min" in message
    assert "--yes" in message and not ReplayRun.objects.exists()
    with pytest.raises(CommandError, match=r"over 36.6 s .*exceeds the cap of 10 s"):
        replay("--limit", "50", "--max-duration", "10")  # 36.6 s of the trace at speed 1
    out = replay("--limit", "5", "--speed", "200")
    assert "plan: 5 requests over" in out and "5 samples expected" in out


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("sample_store", ["chdb"], indirect=True)
@pytest.mark.parametrize(
    "args, says",
    [
        (["--rate", "10"], "rate applies to poisson or gamma arrivals, not recorded"),
        (
            ["--arrival", "poisson", "--rate", "10", "--cv", "3"],
            "--cv applies to --arrival gamma, not poisson",
        ),
        (["--arrival", "poisson", "--rate", "10", "--speed", "5"], "speed applies to recorded arrivals"),
    ],
)
def test_contradictory_options_are_rejected(running, sample_store, args, says):
    with pytest.raises(CommandError, match=says):
        replay("--limit", "5", *args)
    assert not ReplayRun.objects.exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("sample_store", ["chdb"], indirect=True)
def test_a_missing_trace_names_the_file(running, sample_store, tmp_path):
    with pytest.raises(CommandError) as info:
        replay(trace=tmp_path / "missing.csv")
    assert (
        str(info.value)
        == f"{tmp_path / 'missing.csv'}: cannot read: no such file (the path as this process sees it)"
    )
