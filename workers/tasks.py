"""Celery tasks of a replay. Thin: they claim rows, call replay, and record results.

Each task takes primitive ids, re-reads its rows and returns quietly when there is nothing to
do, so a redelivered message never does anything twice:

- start_replay(run):   queued -> running; fans the shards out (a group, no result backend).
- run_shard(run, i):   claims the shard (pending/running -> running, attempts + 1), asks the
                       sample store what this run already recorded, sends only the rest.
- finish_replay(run):  once every shard has ended; waits until the run's samples are
                       durable (spool flushed), counts them, ends the run and sends
                       samples.signals.replay_finished (the report's rollup is built by its
                       receiver, in dashboards; the replay does not know the report).

The run catalog in the sample store (``record_run``: what the report reads by default) hears
"running" when a run starts sending (best effort) and the final status when it ends.
"""

from __future__ import annotations

import datetime as dt
import logging
import time

from celery import group, shared_task
from django.db import close_old_connections
from django.db.models import F, Q
from django.utils import timezone

from samples.factory import sample_store, sample_writer
from samples.schema import SAMPLES_TABLE
from samples.signals import replay_finished
from samples.store import StoreUnavailable
from workers.models import ReplayRun, ReplayShard
from workers.shard import execute_shard, plan_run_prompts

log = logging.getLogger(__name__)

START_LEAD_S = 1.0  # every shard gets this long to be picked up before time zero
# A running shard whose worker has not written a heartbeat for this long is presumed dead and
# may be claimed by a redelivered message. Heartbeats come every second; a broker that
# redelivers a message whose worker is alive (Redis' visibility timeout) finds a fresh
# heartbeat and leaves the shard alone.
LEASE_S = 10.0


@shared_task(acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def start_replay(run_id: int) -> None:
    run = (
        ReplayRun.objects.select_related("experiment")
        .filter(pk=run_id, status=ReplayRun.Status.QUEUED)
        .first()
    )
    if run is None:
        return
    # 1. Prompts planned before time zero, so calibration never makes a send late. A redelivered
    # message plans again (the same plan: it is deterministic) and only one claim wins.
    plan = plan_run_prompts(run)
    # 2. The claim fixes time zero after the plan; a run cancelled meanwhile is not claimed.
    claimed = ReplayRun.objects.filter(pk=run_id, status=ReplayRun.Status.QUEUED).update(
        status=ReplayRun.Status.RUNNING, started_at=timezone.now(), start_at_unix=time.time() + START_LEAD_S,
        prompt_plan=plan,
    )  # fmt: skip
    if not claimed:
        return
    run = ReplayRun.objects.select_related("experiment").get(pk=run_id)
    record_catalog(run, "running")
    shard_ids = list(ReplayShard.objects.filter(run_id=run_id).values_list("index", flat=True))
    group(run_shard.si(run_id, index) for index in shard_ids).apply_async()


@shared_task(
    bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True,
    autoretry_for=(StoreUnavailable,), retry_backoff=2, retry_backoff_max=60, retry_jitter=True, max_retries=10,
)  # fmt: skip
def run_shard(self, run_id: int, index: int) -> None:
    now = timezone.now()
    stale = now - dt.timedelta(seconds=LEASE_S)
    claimable = Q(status=ReplayShard.Status.PENDING) | Q(status=ReplayShard.Status.RUNNING) & (
        Q(heartbeat_at__isnull=True) | Q(heartbeat_at__lt=stale)
    )
    claimed = ReplayShard.objects.filter(claimable, run_id=run_id, index=index).update(
        status=ReplayShard.Status.RUNNING, attempts=F("attempts") + 1, started_at=now, heartbeat_at=now
    )
    if not claimed:
        alive = ReplayShard.objects.filter(run_id=run_id, index=index, status=ReplayShard.Status.RUNNING)
        if alive.exists():
            # Another worker holds a fresh lease (or died moments ago): look again once the
            # lease could have expired, so a dead worker's shard is always picked up.
            raise self.retry(countdown=LEASE_S, max_retries=None)
        return  # done already: a redelivered message
    shard = ReplayShard.objects.select_related("run__experiment").get(run_id=run_id, index=index)
    try:
        stats = execute_shard(shard)
    except StoreUnavailable:
        raise  # retried: the shard stays claimable and resumes where it stopped
    except Exception as exc:
        log.exception("run %s shard %s failed", run_id, index)
        ReplayShard.objects.filter(pk=shard.pk).update(
            status=ReplayShard.Status.FAILED,
            error=f"{type(exc).__name__}: {exc}"[:4000],
            finished_at=timezone.now(),
        )
        ReplayRun.objects.filter(pk=run_id).update(error=f"shard {index}: {type(exc).__name__}: {exc}"[:4000])
    else:
        if stats.stop_reason:
            # The shard stopped on its own (e.g. the experiment was concluded and its weights
            # retired): the run is cancelled, for that reason, not failed.
            ReplayRun.objects.filter(pk=run_id).update(cancel_requested=True, error=stats.stop_reason[:4000])
        ReplayShard.objects.filter(pk=shard.pk).update(
            status=ReplayShard.Status.DONE, finished_at=timezone.now(),
            sent=stats.sent + stats.skipped_recorded, recorded=stats.recorded + stats.skipped_recorded,
            skipped_recorded=stats.skipped_recorded,
            lag_p50_ms=stats.lag_quantile(0.5), lag_p99_ms=stats.lag_quantile(0.99),
            lag_max_ms=max(stats.lags_ms, default=0.0),
        )  # fmt: skip
    finally:
        close_old_connections()
    maybe_finish(run_id)


def maybe_finish(run_id: int) -> None:
    """The shard that sees every shard ended moves the run on; only one can claim it."""
    open_shards = ReplayShard.objects.filter(run_id=run_id).exclude(
        status__in=[ReplayShard.Status.DONE, ReplayShard.Status.FAILED]
    )
    if open_shards.exists():
        return
    claimed = ReplayRun.objects.filter(pk=run_id, status=ReplayRun.Status.RUNNING).update(
        status=ReplayRun.Status.FLUSHING
    )
    if claimed:
        finish_replay.delay(run_id)


@shared_task(bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True, max_retries=None)
def finish_replay(self, run_id: int) -> None:
    try:
        complete_run(run_id)
    except StoreUnavailable as exc:
        if self.request.is_eager:
            # No broker to retry through: the run waits in "flushing" until
            # `manage.py flush_samples` (or the next replay) finds the store back.
            log.warning("run %s: sample store unavailable, samples stay spooled: %s", run_id, exc)
            ReplayRun.objects.filter(pk=run_id).update(error=f"waiting for the sample store: {exc}"[:4000])
            return
        raise self.retry(exc=exc, countdown=min(60, 2 ** min(self.request.retries, 6))) from exc


def record_catalog(run: ReplayRun, status: str, *, strict: bool = False, **times) -> None:
    """Tell the sample store's run catalog (samples.store record_run) the run's status. Best
    effort unless ``strict``: a store that is down must not stop a run from starting (the
    final status is written again when it ends, where a failure keeps it flushing)."""
    started = run.started_at or run.created_at
    times.setdefault("started_ms", int(started.timestamp() * 1000) if started else 0)
    try:
        sample_store().record_run(run.pk, run.experiment.key, run.mode, status, source="replay", **times)
    except StoreUnavailable as exc:
        if strict:
            raise
        log.warning(
            "run %s: run catalog not updated (%s), retried when the run ends: %s", run.pk, status, exc
        )


def complete_run(run_id: int, *, exact_shards: bool = False) -> bool:
    """Flush the spool, check the run's samples are durable, count them and end the run.
    Raises StoreUnavailable while the store is down; True when this call ended the run.

    ``exact_shards``: set a single shard's counters to the store's count (a run whose owner
    died: its last heartbeat may lag what was recorded)."""
    run = ReplayRun.objects.filter(pk=run_id, status=ReplayRun.Status.FLUSHING).first()
    if run is None:
        return False
    writer = sample_writer()
    writer.flush()
    if not writer.durable(run_id):
        raise StoreUnavailable(f"run {run_id}: samples still spooled")
    store = sample_store()
    recorded = store.count(run_id)
    # Reads skip FINAL (the report's speed depends on it): a finished run must hold one row
    # per sample physically. Duplicates only come from an insert retried after it landed.
    raw = int(
        store.query(f"SELECT count() FROM {SAMPLES_TABLE} WHERE run_id = %(run)s", {"run": run_id})[0][0]
    )
    if raw != recorded:
        removed = store.deduplicate(run_id)
        log.warning("run %s: removed %d duplicate sample rows", run_id, removed)
    outcomes = dict(
        store.query(
            f"SELECT outcome, uniqExact(variant, request_id) FROM {SAMPLES_TABLE} WHERE run_id = %(run)s GROUP BY outcome",
            {"run": run_id},
        )
    )
    failed = run.shards.filter(status=ReplayShard.Status.FAILED).exists()
    # Asked to cancel wins over a failed shard: the run is partial either way, and a shard of a
    # cancelled run may fail because of the cancel (its owner was interrupted); the error stays.
    if run.cancel_requested:
        status = ReplayRun.Status.CANCELLED
    elif failed:
        status = ReplayRun.Status.FAILED
    elif recorded != run.expected_samples:
        status = ReplayRun.Status.FAILED
        run.error = f"expected {run.expected_samples} samples, the store has {recorded}"
    else:
        status = ReplayRun.Status.DONE
    if exact_shards and run.shard_count == 1:
        ReplayShard.objects.filter(run_id=run_id).update(sent=recorded, recorded=recorded)
    # The catalog first: if the store fails here the run stays flushing and is retried.
    record_catalog(run, str(status), strict=True, finished_ms=int(time.time() * 1000))
    ended = ReplayRun.objects.filter(pk=run_id, status=ReplayRun.Status.FLUSHING).update(
        status=status, samples_recorded=recorded, outcomes={k: int(v) for k, v in outcomes.items()},
        finished_at=timezone.now(), error="" if status == ReplayRun.Status.DONE else run.error,
    )  # fmt: skip
    if ended:
        announce_finished(store, run)
    return bool(ended)


def announce_finished(store, run: ReplayRun) -> None:
    """The run's samples are final: tell whoever keeps derived data (the report's rollup,
    built by dashboards.receivers). The run has ended either way, so a failing receiver is
    logged, never raised."""
    responses = replay_finished.send_robust(
        sender=ReplayRun, run_id=run.pk, experiment=run.experiment.key, store=store
    )
    for receiver, response in responses:
        if isinstance(response, Exception):
            log.warning("run %s: replay_finished receiver %r failed: %s", run.pk, receiver, response)
