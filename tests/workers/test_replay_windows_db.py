"""Windowed shards in the database (no broker needed): how a run is cut, who queues a window,
which shards count as abandoned, and what a cancel does to windows that have not opened."""

import datetime as dt
import time

import pytest
from django.utils import timezone

from replay.arrivals import Arrival
from workers import tasks
from workers.models import ReplayRun, ReplayShard
from workers.runs import ReplayRequest, cancel_run, create_run, stale_shards

pytestmark = pytest.mark.engine

TRACE = "data/traces/azure_llm_2023_code.csv"


@pytest.fixture
def windowed_run(running, settings):
    """400 trace requests at 20x (about 8 s of schedule) cut into 2 s windows and 2 slots, as a
    run with a broker would be (not queued)."""
    settings.CELERY_TASK_ALWAYS_EAGER = False
    settings.REPLAY_WINDOW_S = 2
    run = create_run(
        ReplayRequest(
            running, source=TRACE, limit=400, arrival=Arrival(speed=20), shards=2, check_variants=False
        )
    )
    settings.CELERY_TASK_ALWAYS_EAGER = True
    return run


@pytest.mark.django_db(transaction=True)
def test_a_run_is_cut_into_window_slot_shards_covering_every_request_once(windowed_run):
    run = windowed_run
    shards = list(run.shards.order_by("index"))
    assert run.window_s == 2.0 and run.shard_count == 2
    # The trace is bursty: at 20x its first 400 requests fall in windows 0, 4 and 5 (2 s each);
    # windows without a request have no shard.
    assert sorted({s.window for s in shards}) == [0, 4, 5]
    assert [s.index for s in shards] == list(range(len(shards)))
    assert [(s.window, s.slot) for s in shards] == sorted((s.window, s.slot) for s in shards)
    assert sum(s.planned for s in shards) == 400
    assert all(s.start_s == s.window * 2.0 for s in shards)


@pytest.mark.django_db(transaction=True)
def test_each_shard_of_a_window_is_queued_by_exactly_one_caller(windowed_run, monkeypatch):
    queued = []
    monkeypatch.setattr(
        tasks,
        "group",
        lambda sigs: type(
            "G",
            (),
            {"apply_async": lambda self, countdown=0: queued.append(([s.args for s in sigs], countdown))},
        )(),
    )
    run = windowed_run
    run.start_at_unix = time.time()
    assert tasks.enqueue_window(run, 4) == 2
    assert tasks.enqueue_window(run, 4) == 0  # a second caller (another shard of window 0)
    assert len(queued) == 1 and sorted(a[1] for a in queued[0][0]) == sorted(
        run.shards.filter(window=4).values_list("index", flat=True)
    )
    # queued its lead before the window opens (window 4 opens 8 s after time zero)
    assert queued[0][1] == pytest.approx(8.0 - tasks.window_lead_s(run), abs=0.2)
    assert not run.shards.filter(window=5).exclude(enqueued_at=None).exists()


@pytest.mark.django_db(transaction=True)
def test_windows_not_yet_open_are_neither_alive_nor_abandoned(windowed_run):
    run = windowed_run
    now = timezone.now()
    ReplayRun.objects.filter(pk=run.pk).update(
        status="running", started_at=now - dt.timedelta(seconds=15), start_at_unix=now.timestamp() - 15
    )
    run.refresh_from_db()
    # Before windows, every open shard was judged by the run's start: a run 15 s old whose later
    # windows had not opened was "abandoned". Now only windows that opened a lease ago count.
    ReplayShard.objects.filter(run=run).update(start_s=100.0)  # none has opened
    assert stale_shards(run, now) is None
    ReplayShard.objects.filter(run=run, window=0).update(start_s=0.0)  # opened 15 s ago, silent
    assert len(stale_shards(run, now)) == run.shards.count()  # dead: the whole run is abandoned
    ReplayShard.objects.filter(run=run, window=0, slot=0).update(status="running", heartbeat_at=now)
    assert stale_shards(run, now) is None  # one is alive


@pytest.mark.django_db(transaction=True)
def test_cancel_ends_every_shard_that_has_not_started_and_the_run(windowed_run, sample_store):
    run = windowed_run
    ReplayRun.objects.filter(pk=run.pk).update(
        status="running", started_at=timezone.now(), start_at_unix=time.time()
    )
    first = run.shards.order_by("index").first()
    ReplayShard.objects.filter(pk=first.pk).update(status="done")
    run.refresh_from_db()
    assert cancel_run(run, end_abandoned=False)
    run.refresh_from_db()
    assert run.status == "cancelled"
    assert set(run.shards.values_list("status", flat=True)) == {"done"}
    assert run.samples_recorded == 0
