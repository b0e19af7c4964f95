"""The live runs' books: what each live run recorded, and where it went.

A gateway process records as one live run (gateway.models.LiveRun: a new run_id at every process
start), and as a further one each time a run used every seq. The host's recorder process
(gateway.recorder_process) keeps each run's counters in a LiveBooks on its flush thread and saves
them to the run's LiveRun row at every heartbeat and once the run's queue file is drained, so
while the recorder is down they are as of its last heartbeat:

- recorded (rows built, each with a seq) = stored + spooled + rows the recorder holds in memory
  (RunBooks.in_memory: 0 once the run is closed); rejected and dropped samples never got a seq.
  Rows still in the queue file are counted by neither (gateway.recording's counts() adds them).
- dropped: samples the gateway could not write to its queue file (the disk full or failing),
  told by its closing record.

It also keeps the spool's books of live runs for the dashboards (LiveRun.spool_rows): told by the
spool's hooks when a batch is spooled or flushed (live_spool_hooks), and re-read from the spool
at each heartbeat (another process may have flushed it).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

from samples.spool import Spool, SpoolHooks
from telemetry import metrics

log = logging.getLogger(__name__)

MODE = "live"  # the samples' mode, and the run catalog's mode and source, of live runs


def live_spool_hooks() -> SpoolHooks:
    """The live runs' books of what a spool holds (gateway.models.LiveRun). They never refuse:
    a live sample must not wait in memory because the database is down; the books are for the
    dashboards, and the next flush tells them again (absolute counts)."""
    from gateway.models import LiveRun

    def pending(spool: str, counts: dict[int, int]) -> None:
        try:
            LiveRun.sync_spool(spool, counts)
        except Exception:
            log.warning(
                "spool %s: recording what it holds of live runs failed; the next flush tells again",
                spool,
                exc_info=True,
            )

    def quarantined(spool: str, path: str, lost: dict[int, int]) -> None:
        try:
            LiveRun.record_quarantined(spool, path, lost)
        except Exception:
            log.error(
                "spool %s: could not record that %s lost %s (run: rows)", spool, path, lost, exc_info=True
            )

    return SpoolHooks(pending=pending, quarantined=quarantined)


@dataclasses.dataclass
class RunBooks:
    """One run's counters, kept by the flush thread, saved to its LiveRun row."""

    pk: int
    run_id: int
    started_ms: float
    recorded: int = 0
    stored: int = 0
    spooled: int = 0
    dropped: int = 0
    rejected: int = 0
    experiments: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    open: bool = True  # still taking seqs (False: rotated out at the last seq, or closed)
    saved: bool = False  # saved since it last changed
    saved_experiments: frozenset[str] = frozenset()  # on its LiveRun row (so a later start knows them)
    catalogued: set[str] = dataclasses.field(default_factory=set)  # told the run catalog 'running'
    catalog_final: bool = False

    @property
    def in_memory(self) -> int:
        """Rows of the run built and not written yet (stored or spooled)."""
        return self.recorded - self.stored - self.spooled


class LiveBooks:
    """The live runs the host's recorder is writing (``runs``, by run_id), on ``spool`` (its
    spooling writer's). Every method that touches the database runs on the recorder's flush
    thread."""

    def __init__(self, spool: Spool) -> None:
        self.spool = spool
        self.runs: dict[int, RunBooks] = {}
        self.last_heartbeat = 0.0  # monotonic

    def adopt(self, run_id: int, counts: dict[str, Any] | None = None) -> RunBooks:
        """The books of a registered run (its LiveRun row), from ``counts`` (what the recorder
        had made durable of it: a queue file's state) or from nothing. Raises if the database
        does not answer, or the run is not there."""
        from gateway.models import LiveRun

        books = self.runs.get(run_id)
        if books is not None:
            return books
        run = LiveRun.for_run_id(run_id)
        books = RunBooks(pk=run.pk, run_id=run_id, started_ms=run.started_at.timestamp() * 1000.0)
        for field in ("recorded", "stored", "spooled", "rejected", "dropped"):
            setattr(books, field, int((counts or {}).get(field, 0)))
        books.experiments.update((counts or {}).get("experiments", {}))
        books.saved_experiments = frozenset(run.experiments)
        books.catalog_final = run.catalog_final
        self.runs[run_id] = books
        return books

    def register(self, worker: str, pid: int, host: str) -> RunBooks:
        """A further run for a writer whose run used every seq (its rows go on under it)."""
        from gateway.models import LiveRun

        run = LiveRun.register(self.spool.id, worker, pid=pid, host=host)
        log.info("live recorder: %s goes on as live run %s", worker, run.run_id)
        return self.adopt(run.run_id)

    def forget(self, run_id: int) -> None:
        self.runs.pop(run_id, None)

    # ---- counting (the flush thread) -----------------------------------------------------------

    def rejected(self, books: RunBooks, n: int = 1) -> None:
        """Measurements that could not become a row (they never got a seq)."""
        books.rejected += n
        books.saved = False
        metrics.LIVE_SAMPLES_DROPPED.labels("invalid").inc(n)

    def dropped(self, books: RunBooks, n: int) -> None:
        """Samples the gateway could not write to its queue file (its closing record says)."""
        books.dropped += n
        books.saved = False
        if n:
            metrics.LIVE_SAMPLES_DROPPED.labels("queue_write").inc(n)

    def written(self, rows: Sequence[Any], where: str) -> None:
        """Rows written: ``where`` is "store" or "spool"."""
        per: collections.Counter[tuple[int, str]] = collections.Counter(
            (int(r["run_id"]), r["experiment"]) for r in rows
        )
        for (run_id, experiment), n in per.items():
            books = self.runs[run_id]
            if where == "store":
                books.stored += n
            else:
                books.spooled += n
            books.experiments[experiment] += n
            books.saved = False
            metrics.LIVE_SAMPLES_WRITTEN.labels(experiment, where).inc(n)

    def invalid(self, rows: Sequence[Any]) -> None:
        """Built rows the writer refused as invalid: rejected, no longer recorded."""
        for row in rows:
            books = self.runs[int(row["run_id"])]
            books.rejected += 1
            books.recorded -= 1
            books.saved = False
            metrics.LIVE_SAMPLES_DROPPED.labels("invalid").inc()

    # ---- reading ---------------------------------------------------------------------------------

    def totals(self) -> dict[str, int]:
        """The counters over the runs in these books (a snapshot; the flush thread updates them)."""
        out = dict.fromkeys(("recorded", "stored", "spooled", "dropped", "rejected"), 0)
        for books in list(self.runs.values()):
            for k in out:
                out[k] += getattr(books, k)
        return out

    def waiting_in_spool(self, run_id: int) -> int:
        """Rows of the run in the spool now (its files' headers say; a torn file counts in full)."""
        return self.spool.rows_by_run().get(run_id, 0)

    # ---- saving ----------------------------------------------------------------------------------

    def heartbeat_due(self, every_s: float) -> bool:
        return time.monotonic() - self.last_heartbeat >= every_s

    def heartbeat(self, closing: bool = False) -> bool:
        """Save every changed run's counters to its LiveRun row (an open run's heartbeat_at moves
        on even when it is idle), a run no longer open with nothing in memory as closed, and
        what the spool holds. True when every run's row took them."""
        from django.utils import timezone

        from gateway.models import LiveRun

        self.last_heartbeat = time.monotonic()
        now = timezone.now()
        all_saved = True
        for books in list(self.runs.values()):
            if books.saved and not closing and not books.open:
                continue
            fields: dict[str, Any] = {
                "recorded": books.recorded,
                "stored": books.stored,
                "spooled": books.spooled,
                "dropped": books.dropped,
                "rejected": books.rejected,
                "experiments": dict(books.experiments),
                "heartbeat_at": now,
            }
            if not books.open and not books.in_memory:
                fields.update(status=LiveRun.Status.CLOSED, closed_at=now)
            try:
                LiveRun.objects.filter(pk=books.pk).update(**fields)
                books.saved = True
                books.saved_experiments = frozenset(books.experiments)
            except Exception:
                all_saved = False
                log.warning(
                    "live recorder: saving the counters of live run %s failed; next heartbeat tries again",
                    books.run_id,
                    exc_info=True,
                )
        # What the spool holds, again: another process may have flushed it (`manage.py
        # flush_samples`, a replay worker sharing the directory) through hooks that skip live
        # runs. Read without the spool's lock (a flush may hold it for long): a batch being
        # spooled right now shows at the next heartbeat.
        try:
            LiveRun.sync_spool(self.spool.id, self.spool.rows_by_run())
        except Exception:
            log.warning("live recorder: updating the spool's books failed; next heartbeat", exc_info=True)
        return all_saved
