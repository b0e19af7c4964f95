"""Samples spooled on one worker host while the store was down, and runs
that must end rather than wait forever: a run ends only when no host's spool holds
its samples, naming the host that does; a shard resumed on another host does not send again
what was spooled elsewhere; every worker flushes its own spool on its own; retries run out into
a failed run with its reason; quarantined samples are counted in the run's error."""

from __future__ import annotations

import io
import json
import os
import time

import pytest
from celery.exceptions import Retry
from django.core.management import call_command
from django.utils import timezone

from replay.runner import ShardStats
from samples import factory
from samples.backends.clickhouse import ClickHouseServerBackend
from samples.columns import COLUMN_NAMES
from samples.rows import SampleContext, row_from
from samples.spool import Spool
from samples.store import StoreError, StoreUnavailable
from streaming.result import StreamResult
from tests.workers.background import start_worker, stop_all, wait_for
from workers import tasks
from workers.models import ReplayRun, ReplayShard, SpoolRecord

TRACE = "data/traces/azure_llm_2023_code.csv"
WORKER_A = "worker-a:/var/lib/abplat/spool"


def make_run(experiment, *, status="flushing", expected=10, shard="done", **fields) -> ReplayRun:
    run = ReplayRun.objects.create(
        experiment=experiment,
        source=TRACE,
        status=status,
        total_requests=expected,
        expected_samples=expected,
        started_at=timezone.now(),
        **fields,
    )
    ReplayShard.objects.create(run=run, index=0, status=shard, planned=expected)
    return run


def rows_of(run, seqs, *, experiment: str | None = None) -> list:
    """Sample rows of ``run`` (a ReplayRun, or a bare run id with ``experiment``)."""
    run_id, key = (run, experiment) if experiment else (run.pk, run.experiment.key)
    return [
        row_from(
            StreamResult(ttft_ms=5.0, e2e_ms=9.0),
            SampleContext(
                experiment=key,
                run_id=run_id,
                seq=i,
                variant="fp16",
                mode="split",
                sent_unix_ms=time.time() * 1000,
            ),
        )
        for i in seqs
    ]


@pytest.fixture
def store_down():
    """store_down(store): its writes and lookups raise StoreUnavailable; returns the undo."""
    patches = []

    def make(store):
        def unavailable(*_a, **_k):
            raise StoreUnavailable("the store is down (test)")

        patch = pytest.MonkeyPatch()
        patches.append(patch)
        for name in ("insert_columns", "insert_samples", "existing_keys"):
            patch.setattr(store, name, unavailable)
        return patch.undo

    yield make
    for patch in patches:
        patch.undo()


@pytest.fixture
def worker_a(tmp_path):
    """Another host's spool directory (its spool.id names worker-a), as this host would reach it
    to flush it: sample_writer(spool_dir) through the same hooks the workers use."""
    path = tmp_path / "worker-a-spool"
    path.mkdir()
    (path / "spool.id").write_text(WORKER_A + "\n")
    return path


def spool_on_a(worker_a, store, store_down, rows) -> None:
    back_up = store_down(store)
    assert factory.sample_writer(str(worker_a)).write(rows) == "spooled"
    back_up()


def as_worker_task(task, *args, retries=0, **kwargs):
    """Run ``task`` as a worker would on its retries-th delivery (not eagerly: its retries go
    back through the broker, which tests replace by recording them)."""
    task.push_request(retries=retries, is_eager=False, called_directly=False, args=args, kwargs=kwargs)
    try:
        return task.run(*args, **kwargs)
    finally:
        task.pop_request()


@pytest.fixture
def no_broker(monkeypatch):
    """Messages a task sends (its retries) are recorded, not run."""
    sent = []
    monkeypatch.setattr(
        "celery.canvas.Signature.apply_async", lambda sig, *a, **k: sent.append((sig.task, sig.kwargs))
    )
    return sent


@pytest.mark.django_db
@pytest.mark.engine
def test_a_run_waits_while_another_host_spools_its_samples_and_ends_once_that_spool_is_flushed(
    experiment, sample_store, worker_a, store_down
):
    run = make_run(experiment)
    sample_store.insert_samples(rows_of(run, range(6)))
    spool_on_a(worker_a, sample_store, store_down, rows_of(run, range(6, 10)))
    assert SpoolRecord.objects.get(run=run).rows == 4

    # This host's spool is empty: before, its durability check passed and the run ended failed,
    # 4 samples short, while they waited on worker-a.
    with pytest.raises(StoreUnavailable, match=r"4 samples still spooled on host worker-a .*--spool-dir"):
        tasks.complete_run(run.pk)
    run.refresh_from_db()
    assert run.status == "flushing"

    # A retired worker's spool, reached from here, is flushed under its own id: the run ends.
    out = io.StringIO()
    call_command("flush_samples", "--spool-dir", str(worker_a), stdout=out)
    run.refresh_from_db()
    assert run.status == "done" and run.samples_recorded == 10, out.getvalue()
    assert f"spool {WORKER_A}: flushed 4 samples" in out.getvalue()
    assert SpoolRecord.objects.get(run=run).rows == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.engine
def test_a_shard_resumed_on_another_host_waits_for_the_rows_spooled_elsewhere(
    experiment, sample_store, worker_a, store_down, monkeypatch, no_broker
):
    """The resume asks the store what is recorded: rows spooled on worker-a are not there yet
    and would be sent again. It waits (bounded), then fails naming the host."""
    run = make_run(experiment, status="running", shard="running")
    ReplayShard.objects.filter(run=run).update(attempts=1, heartbeat_at=None)  # its owner died
    spool_on_a(worker_a, sample_store, store_down, rows_of(run, range(3)))
    executed = []
    monkeypatch.setattr(tasks, "execute_shard", lambda shard, **kw: executed.append(shard) or ShardStats())

    with pytest.raises(Retry):
        as_worker_task(tasks.run_shard, run.pk, 0)
    assert executed == [] and no_broker == [("workers.tasks.run_shard", {"store_retries": 1})]
    shard = run.shards.get()
    assert (shard.status, shard.heartbeat_at) == ("pending", None)  # claimable by the retry at once

    as_worker_task(tasks.run_shard, run.pk, 0, store_retries=tasks.SHARD_MAX_RETRIES)
    shard.refresh_from_db()
    assert executed == [] and shard.status == "failed"
    assert f"through {tasks.SHARD_MAX_RETRIES} retries" in shard.error
    assert "3 samples still spooled on host worker-a" in shard.error
    run.refresh_from_db()  # and the run waits for them too (eager finish: until flush_samples)
    assert run.status == "flushing" and "worker-a" in run.error


@pytest.mark.django_db(transaction=True)
@pytest.mark.engine
def test_a_resumed_shard_sends_once_no_other_host_holds_rows_of_its_run(
    experiment, sample_store, worker_a, store_down, monkeypatch
):
    run = make_run(experiment, status="running", shard="running")
    ReplayShard.objects.filter(run=run).update(attempts=1, heartbeat_at=None)
    spool_on_a(worker_a, sample_store, store_down, rows_of(run, range(3)))
    call_command("flush_samples", "--spool-dir", str(worker_a), stdout=io.StringIO())
    executed = []
    monkeypatch.setattr(tasks, "execute_shard", lambda shard, **kw: executed.append(shard) or ShardStats())
    tasks.run_shard.apply(args=(run.pk, 0))
    assert len(executed) == 1 and executed[0].attempts == 2


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.engine
def test_a_shard_whose_store_stays_down_fails_after_its_retries_and_the_run_ends_failed(
    experiment, sample_store, monkeypatch, no_broker, eager
):
    """After autoretry ran out the shard stayed `running` and the run with it."""
    run = make_run(experiment, status="running", shard="pending")
    calls = []

    def store_down(shard, **kw):
        calls.append(shard.attempts)
        raise StoreUnavailable("the store is down (test)")

    monkeypatch.setattr(tasks, "execute_shard", store_down)
    if eager:  # no broker to retry through: at once
        tasks.run_shard.apply(args=(run.pk, 0))
        retries = 0
    else:
        with pytest.raises(Retry):
            as_worker_task(tasks.run_shard, run.pk, 0, store_retries=tasks.SHARD_MAX_RETRIES - 1)
        assert run.shards.get().status == "pending"
        retries = tasks.SHARD_MAX_RETRIES
        as_worker_task(tasks.run_shard, run.pk, 0, store_retries=retries)
    shard = run.shards.get()
    assert shard.status == "failed" and f"stayed unavailable through {retries} retries" in shard.error
    run.refresh_from_db()
    assert run.status == "failed" and "shard 0: the sample store stayed unavailable" in run.error


@pytest.mark.django_db
@pytest.mark.engine
def test_a_run_whose_samples_never_become_durable_ends_failed_after_bounded_retries(
    experiment, sample_store, worker_a, store_down, no_broker
):
    """finish_replay retried forever (max_retries=None); the run stayed flushing."""
    run = make_run(experiment)
    sample_store.insert_samples(rows_of(run, range(6)))
    spool_on_a(worker_a, sample_store, store_down, rows_of(run, range(6, 10)))

    with pytest.raises(Retry):
        as_worker_task(tasks.finish_replay, run.pk, retries=tasks.FINISH_MAX_RETRIES - 1)
    assert no_broker == [("workers.tasks.finish_replay", {"errors": 0})]
    run.refresh_from_db()
    assert run.status == "flushing"

    as_worker_task(tasks.finish_replay, run.pk, retries=tasks.FINISH_MAX_RETRIES)
    run.refresh_from_db()
    assert run.status == "failed" and run.samples_recorded == 6
    assert run.error.startswith(f"its samples were not durable after {tasks.FINISH_MAX_RETRIES} tries")
    assert "4 samples still spooled on host worker-a" in run.error and "--spool-dir" in run.error
    assert {r["status"] for r in sample_store.runs(experiment.key)} == {"failed"}


@pytest.mark.django_db
@pytest.mark.engine
def test_a_deduplicate_that_keeps_failing_ends_the_run_failed_with_its_reason(
    experiment, sample_store, monkeypatch, no_broker
):
    """A StoreError from deduplicate escaped finish_replay, leaving the run flushing."""
    run = make_run(experiment)
    rows = rows_of(run, range(10))
    sample_store.insert_samples(rows)
    sample_store.insert_samples(rows)  # an insert retried after it landed: every row twice

    def busy(run_id=None):
        raise StoreError(f"deduplicate({run_id}) left duplicates in partitions {{202612: 10}}; run it again")

    monkeypatch.setattr(sample_store, "deduplicate", busy)
    for errors in range(tasks.FINISH_ERROR_RETRIES):
        with pytest.raises(Retry):
            as_worker_task(tasks.finish_replay, run.pk, errors=errors, retries=errors)
    assert [kw for _t, kw in no_broker] == [{"errors": n + 1} for n in range(tasks.FINISH_ERROR_RETRIES)]
    run.refresh_from_db()
    assert run.status == "flushing"

    as_worker_task(tasks.finish_replay, run.pk, errors=tasks.FINISH_ERROR_RETRIES, retries=3)
    run.refresh_from_db()
    assert run.status == "failed" and run.samples_recorded == 10
    assert "ending it failed after 4 tries: StoreError: deduplicate" in run.error


@pytest.mark.django_db
@pytest.mark.engine
def test_eager_celery_ends_a_run_whose_deduplicate_fails_at_once(experiment, sample_store, monkeypatch):
    run = make_run(experiment)
    rows = rows_of(run, range(10))
    sample_store.insert_samples(rows)
    sample_store.insert_samples(rows)  # twice, apart: one insert's own duplicates merge at once

    def busy(run_id=None):
        raise StoreError("left duplicates (test)")

    monkeypatch.setattr(sample_store, "deduplicate", busy)
    tasks.finish_replay.apply(args=(run.pk,))
    run.refresh_from_db()
    assert run.status == "failed" and "left duplicates (test)" in run.error


@pytest.mark.django_db
@pytest.mark.engine
def test_samples_of_another_column_schema_are_quarantined_and_the_run_says_so(
    experiment, sample_store, worker_a
):
    """A schema change made spool files unreadable; they were quarantined and the
    run ended with a count that did not say why."""
    run = make_run(experiment)
    sample_store.insert_samples(rows_of(run, range(6)))
    spool = Spool(str(worker_a))
    with open(os.path.join(spool.dir, "000000000001.jsonl"), "w", encoding="utf-8") as f:
        f.write(
            json.dumps({"spool": 2, "seq": 1, "rows": 4, "runs": [run.pk], "counts": {str(run.pk): 4}}) + "\n"
        )
        for r in rows_of(run, range(6, 10)):  # an older writer's rows: one column fewer
            f.write(json.dumps([r[c] for c in COLUMN_NAMES][:-1]) + "\n")
    SpoolRecord.sync(WORKER_A, {run.pk: 4})  # what that writer told before it spooled them
    err = io.StringIO()
    call_command("flush_samples", "--spool-dir", str(worker_a), stdout=io.StringIO(), stderr=err)
    quarantined = os.path.join(spool.quarantine, "000000000001.jsonl.torn")
    assert f"quarantined {quarantined}: 0 rows flushed, lost run {run.pk}: 4" in err.getvalue()
    run.refresh_from_db()
    assert run.status == "failed" and run.samples_recorded == 6
    assert run.error == (
        f"expected 10 samples, the store has 6; 4 spooled samples could not be read and were "
        f"quarantined (4 in {quarantined} on host worker-a)"
    )


@pytest.mark.django_db
@pytest.mark.engine
def test_a_spool_that_is_gone_for_good_can_be_given_up(experiment, sample_store):
    run = make_run(experiment)
    sample_store.insert_samples(rows_of(run, range(7)))
    SpoolRecord.sync(WORKER_A, {run.pk: 3})
    with pytest.raises(StoreUnavailable, match="worker-a"):
        tasks.complete_run(run.pk)
    out = io.StringIO()
    call_command("flush_samples", "--forget-spool", WORKER_A, stdout=out)
    run.refresh_from_db()
    assert f"spool {WORKER_A}: 3 spooled samples given up as lost" in out.getvalue()
    assert run.status == "failed" and "3 spooled samples could not be read" in run.error


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_every_worker_flushes_its_own_spool_on_its_own(demo_env, tmp_path, pool):
    """Samples a worker spooled (here: left by its previous life) reach the store without anyone
    running flush_samples: each worker process flushes its host's spool on a timer. (demo_env:
    the database and the sample store migrated; its experiment is not used.)"""
    spool = Spool(str(tmp_path / "spool"))  # the worker's ABPLAT_SPOOL_DIR (ABPLAT_VAR/spool)
    spool.append(rows_of(7, range(25), experiment="ttft-opt"))
    log = tmp_path / "worker.log"
    worker = start_worker(demo_env, log, pool)
    store = ClickHouseServerBackend(demo_env["ABPLAT_CLICKHOUSE_URL"])
    try:

        def flushed() -> bool:
            assert worker.poll() is None, log.read_text()[-3000:]
            return store.count(7) >= 25

        wait_for(flushed, 60, poll=0.2, message=lambda: log.read_text()[-3000:])
        assert spool.pending_files() == []
    finally:
        stop_all([worker])
