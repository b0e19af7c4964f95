"""The live gateway's books: one LiveRun per gateway process start (gateway.recording).

Why a run per process start, for every experiment it serves: a sample's identity is (experiment,
variant, run_id, request_id) (samples.columns.row_key) and seq is a per-run counter, so a
process that was killed and started again must never reuse its predecessor's run_id: the
database row gives each start a new one, and its seq starts again at 1 without meeting an old
sample. Experiment-independent because one process serves every experiment it routes; what it
recorded per experiment is in ``experiments``.

run_id: LIVE_RUN_ID_BASE + the row's pk, so live runs never share a run_id with a replay run
(workers.models.ReplayRun's pk): samples of both sit in one table and one spool, the report,
the rollups and the run catalog key runs by (experiment, run_id), and the replay's spool books
(workers.models.SpoolRecord) would otherwise count live rows as a replay's.

Read by the dashboards: ``live_runs(experiment)`` lists the live runs that recorded samples of an
experiment (newest first); a run's counts are on the row (``LiveRun.summary()``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Collection

from django.db import models, transaction
from django.utils import timezone

# 10**12: far above any replay run's pk, well below 2**53 (a run_id stays exact in JSON and JS).
LIVE_RUN_ID_BASE = 10**12


def is_live_run_id(run_id: int) -> bool:
    return int(run_id) > LIVE_RUN_ID_BASE


class LiveRun(models.Model):
    """One gateway process's recording of live traffic, from its start to its close (or death).

    Counters (rows are samples), kept by the host's recorder process (gateway.recorder_process)
    every few seconds and once the run's queue file is drained, so while the recorder is down
    they are as of its last heartbeat (the samples wait in the queue file meanwhile):
      recorded   built into a row by the recorder, each with the run's next seq
      stored     written to the sample store by the recorder
      spooled    written to the spool instead (the store was down or slow); stored later by a
                 flush (the recorder's own retry, another start's, or ``manage.py flush_samples``)
      dropped    lost without reaching either: the gateway could not write them to its queue
                 file (the disk full or failing), or record() was called after close(); 0 in
                 normal operation
      rejected   could not become a valid row (samples.rows.row_from refused the measurement)
    spool_rows: rows of this run waiting in its spool now: told by the spool's hooks when a
    recorder spools or flushes, and re-read from the spool at every heartbeat of a recorder on
    it (a flush by `manage.py flush_samples` or a replay worker goes through hooks that skip live
    runs). With no gateway running on the spool it stays as last seen.
    """

    class Status(models.TextChoices):
        RUNNING = "running", "Running"
        CLOSED = "closed", "Closed (drained)"
        # a process that died before its queue file existed, or a run of a gateway before the
        # queue files (its memory died with it); a killed gateway's queue file is drained: closed
        ABANDONED = "abandoned", "Abandoned (the process died without closing)"

    worker = models.CharField(max_length=200, help_text="host:pid of the gateway process")
    host = models.CharField(max_length=200)
    pid = models.PositiveIntegerField()
    spool = models.CharField(max_length=500, help_text="the spool's id, host:directory (its spool.id file)")
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.RUNNING)
    started_at = models.DateTimeField(default=timezone.now)
    heartbeat_at = models.DateTimeField(default=timezone.now, help_text="last time its counters were saved")
    closed_at = models.DateTimeField(null=True, blank=True)
    recorded = models.PositiveBigIntegerField(default=0)
    stored = models.PositiveBigIntegerField(default=0)
    spooled = models.PositiveBigIntegerField(default=0)
    dropped = models.PositiveBigIntegerField(default=0)
    rejected = models.PositiveBigIntegerField(default=0)
    spool_rows = models.PositiveBigIntegerField(default=0, help_text="rows waiting in the spool now")
    experiments = models.JSONField(
        default=dict, blank=True, help_text="experiment -> samples written (stored or spooled)"
    )
    quarantined = models.JSONField(
        default=dict, blank=True, help_text="quarantined spool file -> rows of the run it lost"
    )
    catalog_final = models.BooleanField(
        default=False,
        help_text="the sample store's run catalog has this run's final status for each of its experiments",
    )

    class Meta:
        ordering = ["-started_at"]
        indexes = [
            # Serves "which live runs are open on this spool" (a start marking dead ones).
            models.Index(fields=["spool", "status"], name="live_run_by_spool"),
        ]

    def __str__(self) -> str:
        return f"live run {self.run_id} on {self.worker} ({self.status})"

    @property
    def run_id(self) -> int:
        """The samples' run_id."""
        return LIVE_RUN_ID_BASE + int(self.pk)

    @classmethod
    def for_run_id(cls, run_id: int) -> LiveRun:
        """The run of a samples run_id (DoesNotExist if it is not a live run's)."""
        if not is_live_run_id(run_id):
            raise cls.DoesNotExist(f"run {run_id} is not a live run")
        return cls.objects.get(pk=int(run_id) - LIVE_RUN_ID_BASE)

    @property
    def catalog_status(self) -> str:
        """The run's status in the sample store's run catalog (samples.schema.RUN_STATUSES), what
        the report reads: running while open; done once closed (every sample written, a killed
        gateway's too once its queue file is drained); failed when abandoned."""
        return {self.Status.RUNNING: "running", self.Status.CLOSED: "done"}.get(self.status, "failed")

    @property
    def lost(self) -> int:
        return self.dropped + sum(int(n) for n in self.quarantined.values())

    def summary(self) -> dict:
        """What a dashboard lists for the run (JSON-safe)."""
        return {
            "run_id": self.run_id,
            "mode": "live",
            "source": "live",
            "worker": self.worker,
            "status": self.status,
            "started_at": self.started_at.isoformat(),
            "heartbeat_at": self.heartbeat_at.isoformat(),
            "closed_at": self.closed_at.isoformat() if self.closed_at else None,
            "recorded": self.recorded,
            "stored": self.stored,
            "spooled": self.spooled,
            "dropped": self.dropped,
            "rejected": self.rejected,
            "spool_rows": self.spool_rows,
            "lost": self.lost,
            "experiments": dict(self.experiments),
            "catalog_status": self.catalog_status,
        }

    @classmethod
    def register(
        cls, spool: str, worker: str | None = None, *, pid: int | None = None, host: str | None = None
    ) -> LiveRun:
        """A new run: for this process (a gateway's start), or for the writer ``pid`` on ``host``
        (the recorder going on with a run that used every seq)."""
        host = host or socket.gethostname()
        pid = pid or os.getpid()
        return cls.objects.create(worker=worker or f"{host}:{pid}", host=host, pid=pid, spool=spool)

    @classmethod
    def abandon_dead(cls, spool: str, keep: Collection[int] = ()) -> int:
        """Runs still 'running' on ``spool`` (this host's) whose process no longer exists and
        whose queue file is gone (``keep``: run_ids with a queue file, which the recorder drains
        and closes): abandoned, as of their last heartbeat. Returns how many."""
        here = socket.gethostname()
        dead = [
            pk
            for pk, host, pid in cls.objects.filter(spool=spool, status=cls.Status.RUNNING).values_list(
                "pk", "host", "pid"
            )
            if host == here and pid != os.getpid() and not _alive(pid) and LIVE_RUN_ID_BASE + pk not in keep
        ]
        # a conditional claim: a run closed meanwhile by its recorder stays closed
        return cls.objects.filter(pk__in=dead, status=cls.Status.RUNNING).update(status=cls.Status.ABANDONED)

    # ---- the spool's books (samples.spool.SpoolHooks, wired by gateway.recording) ----------------

    @classmethod
    def sync_spool(cls, spool: str, rows_by_run: dict[int, int]) -> None:
        """Spool ``spool`` holds these rows per run now (absolute; runs it does not name hold
        none). Replay runs' ids (below LIVE_RUN_ID_BASE) are not ours: skipped."""
        holding = {
            int(r) - LIVE_RUN_ID_BASE: n for r, n in rows_by_run.items() if is_live_run_id(r) and n > 0
        }
        with transaction.atomic():
            cls.objects.filter(spool=spool, spool_rows__gt=0).exclude(pk__in=holding).update(spool_rows=0)
            for pk, n in holding.items():
                cls.objects.filter(pk=pk).update(spool_rows=n)

    @classmethod
    def record_quarantined(cls, spool: str, path: str, lost_by_run: dict[int, int]) -> None:
        """A spool file, now at ``path``, lost these rows per run. Idempotent per path."""
        for run_id, n in lost_by_run.items():
            if not is_live_run_id(run_id):
                continue
            with transaction.atomic():
                run = cls.objects.select_for_update().filter(pk=int(run_id) - LIVE_RUN_ID_BASE).first()
                if run is None:
                    continue
                run.quarantined[path] = int(n)
                run.save(update_fields=["quarantined"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def live_runs(experiment: str | None = None) -> models.QuerySet[LiveRun]:
    """The live runs (newest first), or those that wrote samples of ``experiment``: what the
    dashboards list as the ``live`` source beside replays. A run's samples carry run.run_id
    and mode 'live'."""
    runs = LiveRun.objects.all()
    if experiment is not None:
        runs = runs.filter(experiments__has_key=experiment)
    return runs
