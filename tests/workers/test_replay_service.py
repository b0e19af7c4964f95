"""The replay service (workers/service.py): a typed request refused with the words and fields the
callers show, a run started once its transaction commits, and a handle whose wait wakes the
moment the run ends in this process, whose cancel ends a queued run, and which keeps what a run
that failed to start raised."""

from __future__ import annotations

import threading
import time
import types

import pytest

from replay.arrivals import Arrival
from workers import service
from workers.models import ReplayRun
from workers.runs import ReplayError, ReplayInputError, ReplayRequest
from workers.service import submit
from workers.shard import run_requests

TRACE = "data/traces/azure_llm_2023_code.csv"
RUNNING = types.SimpleNamespace(key="ttft-opt", status="running")


def refusal(**fields) -> ReplayError:
    with pytest.raises(ReplayError) as e:
        ReplayRequest(RUNNING, source=TRACE, **fields).check()
    return e.value


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"mode": "fanout"}, "mode must be split or mirror, got 'fanout'"),
        ({"render_chat": "html"}, "render_chat must be one of reject, plain, got 'html'"),
        ({"on_malformed": "ignore"}, "on_malformed must be reject or skip, got 'ignore'"),
        ({"concurrency": 0}, "concurrency must be at least 1, got 0"),
        ({"limit": 0}, "limit must be at least 1, got 0"),
        ({"shards": 0}, "shard count must be in [1, 256], got 0"),
        ({"shards": 2}, "with Celery eager (no ABPLAT_BROKER_URL) a replay runs as one shard"),
    ],
)
def test_a_request_out_of_range_is_refused_as_create_run_refused_it(fields, says, settings):
    settings.CELERY_TASK_ALWAYS_EAGER = True
    exc = refusal(**fields)
    assert str(exc) == says and not isinstance(exc, ReplayInputError)


@pytest.mark.parametrize(
    "fields, field, says",
    [
        ({"limit": 11}, "limit", "limit must be at most 10 (setting REPLAY_MAX_REQUESTS), got 11"),
        (
            {"concurrency": 9},
            "concurrency",
            "concurrency must be at most 8 (setting REPLAY_MAX_CONCURRENCY), got 9",
        ),
        (
            {"arrival": Arrival(mode="closed", concurrency=9)},
            "arrival.concurrency",
            "arrival.concurrency must be at most 8 (setting REPLAY_MAX_CONCURRENCY), got 9",
        ),
        (
            {"arrival": Arrival(speed=1000.5)},
            "speed",
            "speed must be at most 1000 (setting REPLAY_MAX_SPEED), got 1000.5",
        ),
    ],
)
def test_a_request_over_a_cap_names_the_field_and_the_setting(fields, field, says, settings):
    settings.REPLAY_MAX_REQUESTS, settings.REPLAY_MAX_CONCURRENCY, settings.REPLAY_MAX_SPEED = 10, 8, 1000
    exc = refusal(**{"concurrency": 1, **fields})
    assert isinstance(exc, ReplayInputError) and (exc.field, str(exc)) == (field, says)


def test_only_a_running_experiment_replays_and_the_shard_count_defaults_by_mode(settings):
    paused = types.SimpleNamespace(key="ttft-opt", status="paused")
    with pytest.raises(ReplayError, match="experiment 'ttft-opt' is paused: only running experiments replay"):
        ReplayRequest(paused, source=TRACE, mode="fanout").check()  # the experiment is named first
    settings.CELERY_TASK_ALWAYS_EAGER, settings.REPLAY_SHARDS = False, 6
    assert ReplayRequest(RUNNING).shard_count() == 6 and ReplayRequest(RUNNING, shards=3).shard_count() == 3
    settings.CELERY_TASK_ALWAYS_EAGER = True
    assert ReplayRequest(RUNNING).shard_count() == 1
    ReplayRequest(RUNNING, source=TRACE).check()  # the defaults pass


@pytest.fixture
def held(monkeypatch):
    """The run's task, replaced: it waits for ``go`` and then returns, or raises ``boom``."""
    go, boom, started = threading.Event(), [], []

    def start_replay(run_id: int) -> None:
        started.append(run_id)
        go.wait(30)
        if boom:
            raise boom[0]

    monkeypatch.setattr(service, "start_replay", start_replay)
    return types.SimpleNamespace(go=go, boom=boom, started=started)


def request_for(experiment, **kw) -> ReplayRequest:
    return ReplayRequest(experiment, **{"source": TRACE, "limit": 5, "check_variants": False, **kw})


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("sample_store", ["chdb"], indirect=True)
def test_the_wait_ends_when_the_run_ends_in_this_process_not_at_its_timeout(running, sample_store, held):
    handle = submit(request_for(running))
    assert handle.run.plan.requests == 5 and handle.in_process
    assert not handle.wait(0.05) and not handle.ended()  # the thread is still at work
    assert held.started == [handle.run_id]
    threading.Timer(0.3, held.go.set).start()
    t0 = time.monotonic()
    assert handle.wait(60)
    assert time.monotonic() - t0 < 10  # woken by the run's end, not by the timeout
    assert handle.ended() and handle.failure is None


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("sample_store", ["chdb"], indirect=True)
def test_a_run_that_fails_in_its_thread_ends_failed_and_the_handle_keeps_why(running, sample_store, held):
    held.boom.append(RuntimeError("boom"))
    held.go.set()
    handle = submit(request_for(running))
    assert handle.wait(30)
    assert isinstance(handle.failure, RuntimeError) and str(handle.failure) == "boom"
    assert (handle.run.status, handle.run.error) == ("failed", "failed to start: boom")


@pytest.mark.django_db
@pytest.mark.parametrize("sample_store", ["chdb"], indirect=True)
def test_the_run_starts_once_its_transaction_commits_and_cancel_ends_it_queued(running, sample_store, held):
    # This test's transaction never commits: the run stays queued, never started.
    handle = submit(request_for(running))
    assert held.started == [] and handle.run.status == "queued"
    assert handle.cancel() and handle.run.status == "cancelled" and handle.run.cancel_requested
    assert handle.ended()
    assert not handle.cancel()  # it had ended


@pytest.mark.django_db
@pytest.mark.parametrize("sample_store", ["chdb"], indirect=True)
def test_with_a_broker_the_wait_reads_the_runs_row(running, sample_store, settings, monkeypatch):
    settings.CELERY_TASK_ALWAYS_EAGER = False
    queued = []
    monkeypatch.setattr(service.start_replay, "delay", queued.append)
    handle = submit(request_for(running, shards=1))
    assert not handle.in_process and queued == []  # queued when the transaction commits
    monkeypatch.setattr(service, "BROKER_LOOK_S", 0.05)
    t0 = time.monotonic()
    assert not handle.wait(0.2) and time.monotonic() - t0 >= 0.2
    ReplayRun.objects.filter(pk=handle.run_id).update(status=ReplayRun.Status.DONE)  # a worker ended it
    assert handle.wait() and handle.run.status == "done"


@pytest.mark.django_db
@pytest.mark.parametrize("sample_store", ["chdb"], indirect=True)
def test_the_send_order_is_the_planned_schedule_after_a_warm_up(running, sample_store):
    recorded = submit(request_for(running, arrival=Arrival(speed=2.0), limit=40))
    everything = recorded.send_order()
    assert len(everything) == recorded.run.total_requests == 40
    offsets = {r.seq: r.offset_s / 2.0 for r in run_requests(recorded.run).requests}
    assert everything == sorted(offsets, key=lambda seq: (offsets[seq], seq))
    cut = sorted(offsets.values())[10]
    assert recorded.send_order(after_s=cut) == [s for s in everything if offsets[s] >= cut]
    closed = submit(request_for(running, arrival=Arrival(mode="closed", concurrency=2), limit=40))
    assert closed.send_order(after_s=1e9) == [r.seq for r in run_requests(closed.run).requests]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("sample_store", ["chdb"], indirect=True)
@pytest.mark.engine
def test_a_real_replay_submitted_ends_done_and_its_wait_returns_then(running, sample_store):
    handle = submit(request_for(running, limit=20, arrival=Arrival(speed=200), check_variants=True))
    assert handle.wait(120), "the run did not end"
    assert handle.failure is None and handle.run.status == "done"
    assert handle.run.samples_recorded == handle.run.expected_samples == sample_store.count(handle.run_id)
    assert handle.lag_p99_ms() is not None and not handle.cancel()  # ended: nothing to cancel
