"""The sample store's run catalog of live runs: what the report reads of them (samples.store's
record_run, mode and source ``live``).

A live run is 'running' in the catalog for each experiment it recorded once its LiveRun row names
that experiment (so a later start can finish what a killed process catalogued); 'done' once it
is closed and every sample of it is in the store (spooled samples first); 'failed' for a run
whose process died (gateway.models.LiveRun.catalog_status), told by the next start on its spool
once the samples it spooled are stored. The catalog is told only while the store is up (the
writer not paused); a failure waits for the next heartbeat or start.
"""

from __future__ import annotations

import logging
import time

from gateway.live_books import MODE, LiveBooks
from samples.spool import SpoolingWriter

log = logging.getLogger(__name__)


class LiveCatalog:
    """Tells the run catalog of ``writer``'s store the status of the runs in ``books``."""

    def __init__(self, books: LiveBooks, writer: SpoolingWriter) -> None:
        self.books, self.writer = books, writer

    def tell(self) -> None:
        """Each run's status per experiment (module docstring); on the flush thread."""
        from gateway.models import LiveRun

        if self.writer.paused():
            return
        store = self.writer.store
        try:
            for books in list(self.books.runs.values()):
                for experiment in sorted(books.saved_experiments - books.catalogued):
                    store.record_run(
                        books.run_id,
                        experiment,
                        MODE,
                        "running",
                        source=MODE,
                        started_ms=int(books.started_ms),
                    )
                    books.catalogued.add(experiment)
                if books.open or books.catalog_final or not books.saved or books.in_memory:
                    continue
                if self.books.waiting_in_spool(books.run_id):
                    continue  # spooled samples first: a run is done when its samples are stored
                for experiment in sorted(books.saved_experiments):
                    store.record_run(
                        books.run_id,
                        experiment,
                        MODE,
                        "done",
                        source=MODE,
                        started_ms=int(books.started_ms),
                        finished_ms=int(time.time() * 1000),
                    )
                LiveRun.objects.filter(pk=books.pk).update(catalog_final=True)
                books.catalog_final = True
        except Exception as exc:
            log.info("live recorder: the run catalog did not take a status yet (%s); next heartbeat", exc)

    def finish_ended(self) -> None:
        """Runs of this spool that ended before their process could tell the catalog (killed:
        'failed'; closed while the store was down: 'done'), once their spooled samples are stored."""
        from gateway.models import LiveRun

        if self.writer.paused():
            return
        mine = {b.pk for b in self.books.runs.values()}
        try:
            ended = LiveRun.objects.filter(spool=self.writer.spool.id, catalog_final=False).exclude(
                status=LiveRun.Status.RUNNING
            )
            for run in ended.exclude(pk__in=mine):
                if self.books.waiting_in_spool(run.run_id):
                    continue
                for experiment in sorted(run.experiments):
                    self.writer.store.record_run(
                        run.run_id,
                        experiment,
                        MODE,
                        run.catalog_status,
                        source=MODE,
                        started_ms=int(run.started_at.timestamp() * 1000),
                        finished_ms=int(run.heartbeat_at.timestamp() * 1000),
                    )
                LiveRun.objects.filter(pk=run.pk).update(catalog_final=True)
        except Exception as exc:
            log.info("live recorder: finishing the catalog of ended live runs failed (%s); next start", exc)
