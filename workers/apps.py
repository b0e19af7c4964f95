"""The workers app: stopping replays when their experiment stops, and the spool's bookkeeping.

Spools (samples.spool): each worker host spools samples while the sample store is down, and only
that host can flush them. So that a run never ends, and a shard resumed elsewhere never sends
again, while rows of it wait in some host's spool:

1. every spool tells SpoolRecord (per run and spool, in the database) what it holds, through the
   hooks wired here (samples.factory.set_spool_hooks): before a batch is spooled, after a flush,
   and the rows a quarantined file lost;
2. every worker process flushes its host's spool on a timer thread (start_spool_flusher: first
   a few seconds after it starts, so a restarted worker drains what it left, then every
   tasks.SPOOL_FLUSH_INTERVAL_S), started by Celery's worker_process_init (prefork children,
   solo) or worker_ready (other pools). Not Celery beat: beat sends each tick as one message that
   one worker takes, and a spool can only be flushed by its own host;
3. complete_run waits while any spool holds rows of the run, naming the host; a resumed shard
   waits for other hosts' spools of its run (workers.tasks).

A retired worker's spool must be flushed before its rows are lost: run
`manage.py flush_samples --spool-dir PATH` on a host that can read its directory (copied or
mounted, with its spool.id file); a spool whose disk is gone is given up with
`manage.py flush_samples --forget-spool ID` (its runs then end failed, naming the rows).

Metrics (telemetry/metrics.py, docs/metrics.md): every process that sets up Django (web,
workers, management commands, the gateway's workers) fixes its metrics mode at app start and
checks it is the ABPLAT_METRICS_DIR settings parsed (configure_metrics); a pool child about to
exit removes its live gauges from ABPLAT_METRICS_DIR (worker_process_shutdown), and with
ABPLAT_WORKER_METRICS_PORT the worker's main process serves the machine's metrics (worker_init,
before the pool forks).
"""

import functools
import logging
import os
import random
import threading
import time

from django.apps import AppConfig
from django.db import connections

log = logging.getLogger(__name__)

STOPPING_ACTIONS = ("pause", "conclude")


def stop_replays(sender, *, experiment, action, actor=None, **kwargs) -> None:
    """Pausing or concluding an experiment cancels its open replays (audited): their shards stop
    at their next check and the runs end cancelled. Runs inside the lifecycle move's
    transaction (experiments.signals): setting the flags never touches the sample store, so it
    cannot fail the move; ending a run whose owner died (which needs the store) waits until the
    move committed, and a failure there is logged, never raised."""
    if action not in STOPPING_ACTIONS:
        return
    from django.db import transaction

    from workers.models import ReplayRun
    from workers.runs import cancel_run, end_if_abandoned

    open_runs = list(ReplayRun.objects.filter(experiment=experiment).exclude(status__in=ReplayRun.FINAL))
    for run in open_runs:
        cancel_run(run, actor, end_abandoned=False)

        def end_later(run_id=run.pk):
            try:
                end_if_abandoned(run_id)
            except Exception as exc:  # the move has committed; the periodic check retries
                log.warning("run %s: cancelled by %s, not ended yet: %s", run_id, action, exc)

        transaction.on_commit(end_later)


def closing_thread_connections(fn):
    """``fn``, closing this thread's database connections after it when it runs in a helper
    thread (the replay's sample sink, the flush timer): they would outlive the thread."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            if threading.current_thread() is not threading.main_thread():
                for conn in connections.all(initialized_only=True):
                    if not conn.in_atomic_block:
                        conn.close()

    return call


def spool_hooks():
    from samples.spool import SpoolHooks
    from workers.models import SpoolRecord

    return SpoolHooks(
        pending=closing_thread_connections(SpoolRecord.sync),
        quarantined=closing_thread_connections(SpoolRecord.record_quarantined),
    )


_flusher_pid: int | None = None
FIRST_FLUSH_S = (1.0, 5.0)  # a worker process's first flush comes this long after it starts


def start_spool_flusher(**_kwargs) -> bool:
    """Start this process's spool flush timer (once per process). True if this call did."""
    global _flusher_pid
    if _flusher_pid == os.getpid():
        return False
    _flusher_pid = os.getpid()
    threading.Thread(target=flush_forever, name="abplat-spool-flusher", daemon=True).start()
    return True


def start_spool_flusher_unless_prefork(sender=None, **_kwargs) -> None:
    """worker_ready, in the worker's main process: with prefork its children flush (a thread in
    the parent would be running whenever it forks a new child), with other pools it does."""
    from celery.concurrency.prefork import TaskPool

    if not isinstance(getattr(sender, "pool", None), TaskPool):
        start_spool_flusher()


def flush_forever() -> None:
    from workers.tasks import SPOOL_FLUSH_INTERVAL_S, flush_spool

    delay = random.uniform(*FIRST_FLUSH_S)
    while True:
        time.sleep(delay)
        delay = SPOOL_FLUSH_INTERVAL_S
        try:
            flush_spool()
        except Exception:  # the next tick tries again; a timer thread must not die
            log.exception("flushing the spool failed; next try in %g s", SPOOL_FLUSH_INTERVAL_S)
        finally:
            connections.close_all()


def configure_metrics() -> None:
    """At app start (django.setup), before any request, task or command runs, and in a Celery
    worker's main process before its pool forks. This fixes the process's metrics mode, by
    importing telemetry.metrics, unless an app's modules imported it earlier in the same start
    (the admin's do); its import reads ABPLAT_METRICS_DIR from the process environment (why then:
    its docstring). Settings check that variable (abplat/config.py) but never import the module.
    Then the mode must be the directory settings parsed (settings.METRICS_DIR), existing and
    writable by this process: a process whose settings name another directory (its environment
    changed after that import) stops here rather than write where /metrics does not read."""
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured

    from telemetry import metrics

    try:
        metrics.configure(settings.METRICS_DIR)
    except metrics.MetricsConfigError as exc:
        raise ImproperlyConfigured(str(exc)) from None


def forget_process_metrics(**_kwargs) -> None:
    """worker_process_shutdown, in a pool child about to exit (with os._exit: no atexit): its
    live gauges leave the metrics directory (telemetry/metrics.py)."""
    from telemetry.metrics import mark_process_dead

    mark_process_dead(os.getpid())


def serve_worker_metrics(**_kwargs) -> None:
    """worker_init, in the worker's main process before its pool starts: with
    ABPLAT_WORKER_METRICS_PORT, serve this machine's metrics (every pool child's, summed through
    ABPLAT_METRICS_DIR) for a Prometheus on another machine (docs/metrics.md)."""
    from django.conf import settings

    from telemetry.metrics import serve

    if not settings.WORKER_METRICS_PORT:
        return
    where = f"http://{settings.WORKER_METRICS_ADDR}:{settings.WORKER_METRICS_PORT}/metrics"
    try:
        if serve(settings.WORKER_METRICS_PORT, settings.WORKER_METRICS_ADDR):
            log.info("serving this machine's metrics on %s", where)
    except OSError as exc:  # the worker still works; Prometheus will see the target down
        log.error("cannot serve metrics on %s (ABPLAT_WORKER_METRICS_PORT/_ADDR): %s", where, exc)


class WorkersConfig(AppConfig):
    name = "workers"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from celery.signals import worker_init, worker_process_init, worker_process_shutdown, worker_ready

        from experiments.signals import experiment_transitioned
        from samples.factory import set_spool_hooks
        from samples.signals import replay_finished
        from workers.fidelity_scores import queue_scoring

        configure_metrics()
        experiment_transitioned.connect(stop_replays, dispatch_uid="workers.stop_replays")
        # a mirror run's scoring pass (teacher-forced KL) once its samples are final
        replay_finished.connect(queue_scoring, dispatch_uid="workers.fidelity_scores")
        set_spool_hooks(spool_hooks())
        worker_process_init.connect(start_spool_flusher, dispatch_uid="workers.spool_flusher", weak=False)
        worker_ready.connect(
            start_spool_flusher_unless_prefork, dispatch_uid="workers.spool_flusher_ready", weak=False
        )
        worker_process_shutdown.connect(
            forget_process_metrics, dispatch_uid="workers.metrics_exit", weak=False
        )
        worker_init.connect(serve_worker_metrics, dispatch_uid="workers.metrics_server", weak=False)
