"""Celery tasks of a replay. Thin: they claim rows, call replay, and record results.

Each task takes primitive ids, re-reads its rows and returns quietly when there is nothing to
do, so a redelivered message never does anything twice:

- start_replay(run):   queued -> running; queues the first window's shards.
- run_shard(run, i):   claims the shard (pending/running -> running, attempts + 1), queues the
                       next window's shards to start WINDOW_LEAD_S before that window opens,
                       asks the sample store what this run already recorded, sends only the
                       rest. A shard is one (window, slot) of the schedule (replay.plan), so a
                       task lasts about one window (settings.REPLAY_WINDOW_S), well inside the
                       Celery time limits however long the trace; a closed-loop shard works
                       for one window's time, then queues itself again for the rest.
- finish_replay(run):  once every shard has ended; waits until the run's samples are
                       durable (this host's spool flushed, and no other host's spool holding
                       any: SpoolRecord), counts them, ends the run and sends
                       samples.signals.replay_finished (the report's rollup is built by its
                       receiver, in dashboards; the replay does not know the report).
- flush_spool():       drains this host's spool into the store. Every worker process runs it
                       every SPOOL_FLUSH_INTERVAL_S on a timer thread (workers.apps), because
                       only the host that spooled samples can flush them.

Bounded waiting: a shard retries a store that is down SHARD_MAX_RETRIES times, then fails; a
run waits FINISH_MAX_RETRIES tries (about an hour) for its samples and FINISH_ERROR_RETRIES for
any other trouble ending it (a deduplicate that fails), then ends failed, saying why. Nothing
stays running or flushing forever because the store did not come back.

The run catalog in the sample store (``record_run``: what the report reads by default) hears
"running" when a run starts sending (best effort) and the final status when it ends.
"""

from __future__ import annotations

import datetime as dt
import logging
import time

from celery import group, shared_task
from celery.exceptions import SoftTimeLimitExceeded
from celery.utils.time import get_exponential_backoff_interval
from django.conf import settings
from django.db import close_old_connections
from django.db.models import F, Q
from django.utils import timezone

from replay.arrivals import Arrival
from samples.factory import sample_store, sample_writer
from samples.schema import SAMPLES_TABLE
from samples.signals import replay_finished
from samples.store import StoreError, StoreUnavailable
from telemetry.logs import bind as bind_log_fields
from telemetry.logs import context_from_args
from telemetry.metrics import REPLAY_SHARDS_FINISHED, REPLAY_SHARDS_REQUEUED
from workers.models import ReplayRun, ReplayShard, SpoolRecord
from workers.server_metrics import scrape_now
from workers.shard import execute_shard, plan_run_prompts

log = logging.getLogger(__name__)

START_LEAD_S = 1.0  # every shard gets this long to be picked up before time zero
# A later window's shards are queued this long before it opens: a task that has been picked up
# loads the trace and its plan (about a second for an hour of trace) before its first send.
WINDOW_LEAD_S = 5.0
# A shard whose store calls fail (its resume asks the store what is recorded) is retried this
# often, 2 s to 60 s apart with jitter (a few minutes in all), then fails, naming the error.
SHARD_MAX_RETRIES = 10
# A run waits this many tries for its samples to be durable (60 s apart at most: about an hour
# for a store that is down or another host's spool), then ends failed; and tries this often
# more when ending it fails otherwise (a deduplicate that leaves duplicates).
FINISH_MAX_RETRIES = 60
FINISH_ERROR_RETRIES = 3
# How often every worker process flushes its host's spool (workers.apps starts the timer).
SPOOL_FLUSH_INTERVAL_S = 30.0


def lease_s() -> float:
    """How long a running shard whose worker has not written a heartbeat is presumed alive
    (settings.REPLAY_LEASE_S, 10 s by default); after that it is presumed dead and may be
    claimed by a redelivered message. Heartbeats come every second; a broker that redelivers
    a message whose worker is alive (Redis' visibility timeout) finds a fresh heartbeat and
    leaves the shard alone."""
    return float(settings.REPLAY_LEASE_S)


def lease_countdown(heartbeat: dt.datetime | None, now: dt.datetime) -> float:
    """Seconds from ``now`` until a lease renewed at ``heartbeat`` has expired (half a second
    past it, at least one, at most a whole lease; a whole lease without a heartbeat)."""
    if heartbeat is None:
        return lease_s()
    left = (heartbeat - now).total_seconds() + lease_s() + 0.5
    return min(lease_s(), max(1.0, left))


class SpooledElsewhere(StoreUnavailable):
    """Samples of the run wait in another host's spool: only that host can flush them."""


@shared_task(
    acks_late=True,
    reject_on_worker_lost=True,
    ignore_result=True,
    soft_time_limit=settings.REPLAY_PLAN_TIME_LIMIT_S,
    time_limit=settings.REPLAY_PLAN_TIME_LIMIT_S + 60,
)
@context_from_args(run="run_id")  # log fields of the call (telemetry/logs.py)
def start_replay(run_id: int) -> None:
    run = (
        ReplayRun.objects.select_related("experiment")
        .filter(pk=run_id, status=ReplayRun.Status.QUEUED)
        .first()
    )
    if run is None:
        return
    bind_log_fields(experiment=run.experiment.key)  # until the call ends
    # 1. Prompts planned before time zero, so calibration never makes a send late. A redelivered
    # message plans again (the same plan: it is deterministic) and only one claim wins.
    plan = plan_run_prompts(run)
    scrape_now(run_id, "baseline")  # the variants' /metrics before any request is sent
    # 2. The claim fixes time zero after the plan; a run cancelled meanwhile is not claimed.
    claimed = ReplayRun.objects.filter(pk=run_id, status=ReplayRun.Status.QUEUED).update(
        status=ReplayRun.Status.RUNNING,
        started_at=timezone.now(),
        start_at_unix=time.time() + START_LEAD_S,
        prompt_plan=plan,
    )
    if not claimed:
        return
    run = ReplayRun.objects.select_related("experiment").get(pk=run_id)
    record_catalog(run, "running")
    first = (
        ReplayShard.objects.filter(run_id=run_id).order_by("window").values_list("window", flat=True).first()
    )
    if first is not None:
        enqueue_window(run, first)


def window_lead_s(run: ReplayRun) -> float:
    """How long before its window a shard task is queued: WINDOW_LEAD_S, or half a short window
    (a task lasts lead + window + its last requests: inside the time limit, settings)."""
    return min(WINDOW_LEAD_S, run.window_s / 2) if run.window_s else WINDOW_LEAD_S


def enqueue_window(run: ReplayRun, window: int) -> int:
    """Queue the shards of one window, to start WINDOW_LEAD_S before it opens. Several callers
    may race (every shard of the window before asks for the next): each shard is claimed by
    exactly one (enqueued_at), and only its claimer queues it. Returns how many it queued."""
    opens_at = (run.start_at_unix or time.time()) + run.shards.filter(window=window).values_list(
        "start_s", flat=True
    ).first()
    countdown = max(0.0, opens_at - window_lead_s(run) - time.time())
    queued = []
    for index in run.shards.filter(window=window, enqueued_at__isnull=True).values_list("index", flat=True):
        if ReplayShard.objects.filter(run_id=run.pk, index=index, enqueued_at__isnull=True).update(
            enqueued_at=timezone.now()
        ):
            queued.append(index)
    if queued:
        group(run_shard.si(run.pk, index) for index in queued).apply_async(countdown=countdown)
    return len(queued)


def next_window(run: ReplayRun, window: int) -> int | None:
    return run.shards.filter(window__gt=window).order_by("window").values_list("window", flat=True).first()


def enqueue_next_window(run: ReplayRun, window: int) -> None:
    """Queue the window after ``window`` unless the run is being cancelled (maybe_finish then
    closes the windows that never started)."""
    nxt = next_window(run, window)
    if nxt is not None and not ReplayRun.objects.filter(pk=run.pk, cancel_requested=True).exists():
        enqueue_window(run, nxt)


def handoff_plan(shard: ReplayShard) -> float | None:
    """When the running shard should queue the next window: its lead before that window opens,
    if that falls within this shard's own window (the shard is still running then); None when
    there is no next window or it opens after a gap (queued with a countdown when this ends)."""
    run = shard.run
    nxt = next_window(run, shard.window)
    if nxt is None or run.window_s is None or run.start_at_unix is None:
        return None
    at = run.start_at_unix + nxt * run.window_s - window_lead_s(run)
    return at if at <= run.start_at_unix + (shard.window + 1) * run.window_s else None


@shared_task(bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True, max_retries=None)
@context_from_args(run="run_id", shard="index")
def run_shard(self, run_id: int, index: int, store_retries: int = 0) -> None:
    """``store_retries``: how often this shard was retried because the store (or another
    host's spool) was not there; waits for a live lease do not count."""
    now = timezone.now()
    stale = now - dt.timedelta(seconds=lease_s())
    claimable = Q(status=ReplayShard.Status.PENDING) | Q(status=ReplayShard.Status.RUNNING) & (
        Q(heartbeat_at__isnull=True) | Q(heartbeat_at__lt=stale)
    )
    claimed = ReplayShard.objects.filter(claimable, run_id=run_id, index=index).update(
        status=ReplayShard.Status.RUNNING, attempts=F("attempts") + 1, started_at=now, heartbeat_at=now
    )
    if not claimed:
        alive = ReplayShard.objects.filter(run_id=run_id, index=index, status=ReplayShard.Status.RUNNING)
        beats = list(alive.values_list("heartbeat_at", flat=True))
        if beats:
            # Another worker holds a fresh lease (or died moments ago): look again once the
            # lease could have expired, so a dead worker's shard is always picked up, and
            # picked up as soon as its last heartbeat is a lease old.
            raise self.retry(countdown=lease_countdown(beats[0], now), max_retries=None)
        return  # done already: a redelivered message
    shard = ReplayShard.objects.select_related("run__experiment").get(run_id=run_id, index=index)
    bind_log_fields(experiment=shard.run.experiment.key)  # until the call ends
    # The next window is queued when it is due (not with a countdown: a message with an ETA is
    # held by the one worker that fetched it, busy or not): by this shard while it runs, or,
    # after a gap in the schedule, when it ends. Every slot tries; each shard is queued once.
    handoff_at = handoff_plan(shard)
    if shard.run.cancel_requested:
        ReplayShard.objects.filter(pk=shard.pk).update(
            status=ReplayShard.Status.DONE, finished_at=timezone.now()
        )
        REPLAY_SHARDS_FINISHED.labels("done").inc()
        close_old_connections()
        maybe_finish(run_id)
        return
    try:
        if shard.attempts > 1:
            # A resume skips what the store has recorded: rows an earlier delivery spooled on
            # another host are not there yet and would be sent again. Wait for that host's flush.
            check_spooled_elsewhere(run_id, sample_writer().spool.id)
        stats = execute_shard(
            shard,
            budget_s=shard_budget_s(shard.run),
            handoff_at_unix=handoff_at or 0.0,
            handoff=None if handoff_at is None else lambda: enqueue_next_window(shard.run, shard.window),
        )
    except SoftTimeLimitExceeded:
        # A backstop (the budget stops a shard well before): what it recorded stays, the rest
        # resumes in a new task.
        log.warning("run %s shard %s: soft time limit reached; the rest resumes", run_id, index)
        requeue(shard, None)
        return
    except StoreUnavailable as exc:
        if store_retries < SHARD_MAX_RETRIES and not self.request.is_eager:
            # Retried: the shard is claimable at once and resumes where it stopped. (Eager
            # Celery has no broker to retry through: the shard fails at once.)
            ReplayShard.objects.filter(pk=shard.pk, status=ReplayShard.Status.RUNNING).update(
                status=ReplayShard.Status.PENDING, heartbeat_at=None
            )
            countdown = get_exponential_backoff_interval(2, store_retries, 60, True)
            REPLAY_SHARDS_REQUEUED.labels("store_unavailable").inc()
            raise self.retry(
                exc=exc, countdown=countdown, kwargs={"store_retries": store_retries + 1}
            ) from exc
        log.error("run %s shard %s: gave up after %d store retries: %s", run_id, index, store_retries, exc)
        REPLAY_SHARDS_FINISHED.labels("failed").inc()
        reason = f"the sample store stayed unavailable through {store_retries} retries: {exc}"
        ReplayShard.objects.filter(pk=shard.pk).update(
            status=ReplayShard.Status.FAILED, error=reason[:4000], finished_at=timezone.now()
        )
        ReplayRun.objects.filter(pk=run_id).update(error=f"shard {index}: {reason}"[:4000])
    except Exception as exc:
        log.exception("run %s shard %s failed", run_id, index)
        REPLAY_SHARDS_FINISHED.labels("failed").inc()
        ReplayShard.objects.filter(pk=shard.pk).update(
            status=ReplayShard.Status.FAILED,
            error=f"{type(exc).__name__}: {exc}"[:4000],
            finished_at=timezone.now(),
        )
        ReplayRun.objects.filter(pk=run_id).update(error=f"shard {index}: {type(exc).__name__}: {exc}"[:4000])
    else:
        if stats.deferred and not stats.stop_reason and not stats.cancelled:
            requeue(shard, stats)  # budget spent: the next task resumes, skipping what is recorded
            return
        if stats.stop_reason:
            # The shard stopped on its own (e.g. the experiment was concluded and its weights
            # retired): the run is cancelled, for that reason, not failed.
            ReplayRun.objects.filter(pk=run_id).update(cancel_requested=True, error=stats.stop_reason[:4000])
        REPLAY_SHARDS_FINISHED.labels("done").inc()
        ReplayShard.objects.filter(pk=shard.pk).update(
            status=ReplayShard.Status.DONE,
            finished_at=timezone.now(),
            sent=stats.sent + stats.skipped_recorded,
            recorded=stats.recorded + stats.skipped_recorded,
            skipped_recorded=stats.skipped_recorded,
            lag_p50_ms=stats.lag_quantile(0.5),
            lag_p99_ms=stats.lag_quantile(0.99),
            lag_max_ms=max(stats.lags_ms, default=0.0),
        )
    finally:
        close_old_connections()
    enqueue_next_window(shard.run, shard.window)  # after a gap; a no-op once queued
    maybe_finish(run_id)


def shard_budget_s(run: ReplayRun) -> float | None:
    """How long one task of the run's shards may start requests (None: no bound, eager Celery).
    A closed loop has no windows: it works one window's time per task. An open-loop shard
    ends with its window; the budget only stops one that runs late (a slow start, an
    overloaded worker) well inside the soft time limit."""
    if run.window_s is None:
        return None
    if Arrival(**run.arrival).open_loop:
        return 0.6 * settings.TASK_SOFT_TIME_LIMIT_S
    return float(run.window_s)


def requeue(shard: ReplayShard, stats) -> None:
    """Queue the rest of a shard as a new task (budget spent): it resumes like a redelivered
    shard, asking the store what is recorded and sending only the rest."""
    fields = {"status": ReplayShard.Status.PENDING, "heartbeat_at": None}
    if stats is not None:
        fields.update(
            sent=stats.sent + stats.skipped_recorded, recorded=stats.recorded + stats.skipped_recorded
        )
    ReplayShard.objects.filter(pk=shard.pk, status=ReplayShard.Status.RUNNING).update(**fields)
    close_old_connections()
    REPLAY_SHARDS_REQUEUED.labels("soft_time_limit" if stats is None else "budget").inc()
    run_shard.apply_async((shard.run_id, shard.index))


def maybe_finish(run_id: int) -> None:
    """The shard that sees every shard ended moves the run on; only one can claim it. In a
    cancelled run, the shards that have not started end here without sending (a message that
    still comes for one finds nothing to claim)."""
    if ReplayRun.objects.filter(pk=run_id, cancel_requested=True).exists():
        ReplayShard.objects.filter(run_id=run_id, status=ReplayShard.Status.PENDING).update(
            status=ReplayShard.Status.DONE, finished_at=timezone.now()
        )
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


@shared_task(
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    ignore_result=True,
    max_retries=FINISH_MAX_RETRIES + FINISH_ERROR_RETRIES,
)
@context_from_args(run="run_id")
def finish_replay(self, run_id: int, errors: int = 0) -> None:
    """``errors``: how many tries failed other than for a store that is down (the bound on
    those is FINISH_ERROR_RETRIES; on all tries FINISH_MAX_RETRIES + FINISH_ERROR_RETRIES)."""
    bind_log_fields(  # until the call ends; no shard (an eager call may come from one)
        experiment=ReplayRun.objects.filter(pk=run_id).values_list("experiment__key", flat=True).first(),
        shard=None,
    )
    countdown = min(60, 2 ** min(self.request.retries, 6))
    if not self.request.retries and not errors:
        scrape_now(run_id, "final")  # the variants' /metrics once more, every shard ended
    try:
        complete_run(run_id)
    except StoreUnavailable as exc:
        if self.request.is_eager:
            # No broker to retry through: the run waits in "flushing" until
            # `manage.py flush_samples` (or the next replay) finds the store back.
            log.warning("run %s: sample store unavailable, samples stay spooled: %s", run_id, exc)
            ReplayRun.objects.filter(pk=run_id).update(error=f"waiting for the sample store: {exc}"[:4000])
            return
        if self.request.retries >= FINISH_MAX_RETRIES:
            fail_run(run_id, f"its samples were not durable after {self.request.retries} tries: {exc}")
            return
        raise self.retry(exc=exc, countdown=countdown, kwargs={"errors": errors}) from exc
    except Exception as exc:
        log.exception("run %s: ending it failed (try %d)", run_id, errors + 1)
        if self.request.is_eager or errors >= FINISH_ERROR_RETRIES:
            fail_run(run_id, f"ending it failed after {errors + 1} tries: {type(exc).__name__}: {exc}")
            return
        raise self.retry(exc=exc, countdown=countdown, kwargs={"errors": errors + 1}) from exc


def check_spooled_elsewhere(run_id: int, own_spool: str) -> None:
    """Raise SpooledElsewhere while a spool other than ``own_spool`` holds rows of the run."""
    held = list(SpoolRecord.objects.filter(run_id=run_id, rows__gt=0).exclude(spool=own_spool))
    if held:
        raise SpooledElsewhere(
            f"run {run_id}: " + "; ".join(r.describe_spooled() for r in held) + ". That worker flushes "
            f"them when the store answers (every {SPOOL_FLUSH_INTERVAL_S:g} s); if it is gone for good, "
            "flush its spool directory from a host that can read it: "
            "`manage.py flush_samples --spool-dir PATH`"
        )


def quarantine_note(run_id: int) -> str:
    """What spool files lost of the run to quarantine (samples.spool), or ""."""
    lost = [
        (r, path, n) for r in SpoolRecord.objects.filter(run_id=run_id) for path, n in r.quarantined.items()
    ]
    if not lost:
        return ""
    total = sum(n for _r, _p, n in lost)
    where = ", ".join(f"{n} in {path} on host {r.host}" for r, path, n in lost)
    return f"{total} spooled samples could not be read and were quarantined ({where})"


def fail_run(run_id: int, reason: str) -> bool:
    """End a flushing run failed because ending it gave up (``reason``). Its samples are counted
    if the store answers, the catalog hears it if it can; replay_finished is not sent (the
    samples may be incomplete or hold duplicates: no rollup from them). True if this ended it."""
    run = (
        ReplayRun.objects.select_related("experiment")
        .filter(pk=run_id, status=ReplayRun.Status.FLUSHING)
        .first()
    )
    if run is None:
        return False
    fields = {}
    try:
        fields["samples_recorded"] = sample_store().count(run_id)
    except StoreError:
        pass
    error = f"{reason} (before: {run.error})" if run.error else reason
    log.error("run %s: ended failed: %s", run_id, error)
    ended = ReplayRun.objects.filter(pk=run_id, status=ReplayRun.Status.FLUSHING).update(
        status=ReplayRun.Status.FAILED, finished_at=timezone.now(), error=error[:4000], **fields
    )
    if ended:
        try:
            record_catalog(run, str(ReplayRun.Status.FAILED), finished_ms=int(time.time() * 1000))
        except StoreError as exc:  # ended regardless: the catalog may lag, logged
            log.warning("run %s: run catalog not updated (failed): %s", run_id, exc)
    return bool(ended)


@shared_task(ignore_result=True)
def flush_spool() -> int:
    """Drain this host's spool into the store (the rows of every run in it); the spool then
    tells SpoolRecord what it still holds. Quiet while the store is down. Returns rows inserted."""
    try:
        report = sample_writer().flush()
    except StoreUnavailable as exc:
        log.info("spool not flushed, the sample store is unavailable: %s", exc)
        return 0
    if report.files:
        log.info(
            "flushed the spool: %d samples inserted, %d already stored, %d quarantined file(s)",
            report.inserted,
            report.skipped_stored,
            len(report.quarantined),
        )
    return report.inserted


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
    # 1. Durable: this host's spool flushed, and no other host's spool holding rows of it.
    writer = sample_writer()
    writer.flush()
    if not writer.durable(run_id):
        raise StoreUnavailable(
            f"run {run_id}: {writer.pending(run_id)} samples still spooled on this host ({writer.spool.id})"
        )
    check_spooled_elsewhere(run_id, writer.spool.id)
    # 2. Counted, each sample once on disk too.
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
    # 3. Its status, and why when it is not done.
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
    # Rows a spool file lost to quarantine are named whatever the status: a run that misses
    # them cannot be done (the count says so), and the count alone would not say why.
    lost = quarantine_note(run_id)
    if lost and status != ReplayRun.Status.DONE:
        run.error = f"{run.error}; {lost}" if run.error else lost
    elif lost:
        log.warning("run %s: %s; the store has every expected sample regardless", run_id, lost)
    if exact_shards and run.shard_count == 1:
        ReplayShard.objects.filter(run_id=run_id).update(sent=recorded, recorded=recorded)
    # The catalog first: if the store fails here the run stays flushing and is retried.
    record_catalog(run, str(status), strict=True, finished_ms=int(time.time() * 1000))
    ended = ReplayRun.objects.filter(pk=run_id, status=ReplayRun.Status.FLUSHING).update(
        status=status,
        samples_recorded=recorded,
        outcomes={k: int(v) for k, v in outcomes.items()},
        finished_at=timezone.now(),
        error="" if status == ReplayRun.Status.DONE else run.error,
    )
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
