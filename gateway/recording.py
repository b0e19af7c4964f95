"""Recording live traffic: each gateway request's sample, batched off the request path.

The same sample row a replay records (samples.rows.row_from), mode ``live``, in the same table:
the rollout controller reads samples by config_revision (rollouts/readings.py), so live
traffic feeds it as a replay's does. One LiveRecorder per gateway process:

1. ``start()`` starts the flusher thread, which registers this process's run (gateway.models:
   a new LiveRun, so a new run_id, at every process start) and first flushes what an earlier
   process left in the spool. It waits for the registration (the database gives the run_id).
2. ``record()`` is called on the request path (the event loop): it appends the measurement and
   its context to a bounded in-memory queue (samples.batching.BatchQueue, the replay's sink's
   too) and returns. It never blocks, never raises, and touches neither the database nor the
   store nor the disk.
3. The flusher thread takes batches (every ``batch_rows`` rows or ``flush_ms``), gives each row
   its seq (a per-run counter, in queue order), builds rows with row_from and writes them
   through samples.spool.SpoolingWriter: to the store, or to the durable spool when the store
   is down. The writer's retry policy is the replay's too (SpoolingWriter): after a failed
   store write it spools straight away for ``retry_s``, then a ping and at most
   ``flush_budget_s`` of flushing at a time, spooling behind the spool until it is empty; the
   recorder adds one rule of its own: while its queue is above its high-water mark (the store
   is slow) it spills too (SpoolingWriter.spill, no store call) and stops a flush early, so the
   queue drains at the local disk's speed whatever the store does. A full queue (the disk
   cannot keep up, or the spool's lock is held by a long flush in another process) drops and
   counts the row: ``dropped`` on the run and ``abplat_live_dropped_samples_total``.
4. ``close()`` drains the queue (store or spool) and closes the run; the run catalog
   (SampleStore.record_run, mode and source ``live``) says running while it is open, done once
   closed with every sample stored, failed for a process that died (catalogued by the next
   start on the spool).

Every database call happens on the flusher thread (Django refuses the ORM inside an event loop).

Guarantees (tests/gateway/test_recording*.py):
- No duplicates: a sample's key is (experiment, variant, run_id, request_id) (samples.columns.
  row_key); run_id is new at every process start and request_id is the client-visible
  X-Request-Id, so ``request_id`` must be unique per (run, variant): the gateway makes one per
  request (a client-chosen id reused within a run would collapse two samples into one). A batch
  whose insert failed ambiguously is spooled and the flush skips keys already stored.
- Nothing lost once written: a sample is durable when the flusher has written its batch (stored,
  or spooled: fsync'ed and renamed). Samples become durable in seq order, so a run's durable
  samples are always seq 1..K. What a SIGKILL takes is the rest, 1..K's tail still in memory: at
  most the queue plus one batch; the run's counters (as of its last heartbeat) bound it, and its
  status becomes ``abandoned`` at the next start on the host. close() loses nothing.
- Exact counts: on a run, recorded (rows built, each with a seq) = stored + spooled + rows still
  in memory (0 after close); rejected and dropped samples never got a seq. Every spooled row
  reaches the store exactly once when it is back.

What a live row holds beyond the measurement: sent_unix_ms is when the gateway wrote the upstream
request (the StreamResult clock's zero, as in a replay); the gateway's own time before it (client
request received -> upstream request written: auth, limits, routing, body rewrite) is
``gateway_ms``, a column of live samples alone (0 in a replay's), and the client's arrival is
``scheduled_offset_ms`` (ms after the run's start). ``schedule_lag_ms``, a replay's lateness
against its plan, is 0: live traffic has no plan. So the client's TTFT is gateway_ms + ttft_ms,
and the report's TTFT split of missed requests shows the gateway's time as its own phase
(analysis.definitions.PHASES: "gateway", beside a replay's "schedule lag"). Live rows recorded
before gateway_ms existed (sample store migration 7) held it in schedule_lag_ms; the report reads
a live row's schedule_lag_ms as the gateway's too, so they split the same. in_flight is 0 (not
measured by the gateway); prompt_tokens is the usage event's when the upstream reported it, else
the gateway's count, flagged prompt_tokens_estimated.

Rows are built by samples.rows.row_from from a SampleContext, as the replay builds its own: the
gateway imports nothing of the replay (an import contract, .importlinter).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from samples.batching import BatchQueue
from samples.columns import SampleError, SampleRow
from samples.rows import SampleContext, row_from
from samples.spool import FLUSH_BUDGET_S, SpoolHooks, SpoolingWriter
from samples.store import SampleStore
from streaming.result import StreamResult
from telemetry import metrics

log = logging.getLogger(__name__)

MODE = "live"
MAX_SEQ = 2**32 - 1  # samples.seq is UInt32: a run that reaches it continues as a new run

BATCH_ROWS = 500
# A batch leaves at BATCH_ROWS or after FLUSH_MS: at most one insert a second per gateway process
# at low rates, as ClickHouse asks (each insert is a part to merge), and on the embedded store an
# insert of a few rows costs ~25 ms of the flusher's time, part of it holding the GIL the event
# loop needs (bench/RESULTS.md, "The live path on one HTTP/1.1 core"). Samples reach the store
# within a second, far inside a rollout look's interval.
FLUSH_MS = 1000.0
QUEUE_ROWS = 200_000
RETRY_S = 5.0
HEARTBEAT_S = 5.0
START_TIMEOUT_S = 30.0
# Rows built between two explicit GIL releases on the flusher thread (~20 us each): without them a
# CPU-bound batch holds the GIL up to sys.getswitchinterval() (5 ms) while a request waits.
YIELD_EVERY = 32


def live_spool_hooks() -> SpoolHooks:
    """The live runs' books of what a spool holds (gateway.models.LiveRun). They never refuse:
    a live sample must not wait in memory because the database is down; the books are for the
    dashboards, and the next flush tells them again (absolute counts)."""
    from gateway.models import LiveRun

    def pending(spool: str, counts: dict[int, int]) -> None:
        try:
            LiveRun.sync_spool(spool, counts)
        except Exception:
            log.warning("spool %s: recording what it holds of live runs failed; the next flush tells again",
                        spool, exc_info=True)  # fmt: skip

    def quarantined(spool: str, path: str, lost: dict[int, int]) -> None:
        try:
            LiveRun.record_quarantined(spool, path, lost)
        except Exception:
            log.error(
                "spool %s: could not record that %s lost %s (run: rows)", spool, path, lost, exc_info=True
            )

    return SpoolHooks(pending=pending, quarantined=quarantined)


@dataclasses.dataclass
class _Books:
    """One run's counters, kept by the flusher thread, saved to its LiveRun row."""

    pk: int
    run_id: int
    started_ms: float
    recorded: int = 0
    stored: int = 0
    spooled: int = 0
    dropped: int = 0
    rejected: int = 0
    experiments: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    open: bool = True  # still taking seqs (False: rotated out at MAX_SEQ, or closed)
    saved: bool = False  # saved since it last changed
    saved_experiments: frozenset[str] = frozenset()  # on its LiveRun row (so a later start knows them)
    catalogued: set[str] = dataclasses.field(default_factory=set)  # told the run catalog 'running'
    catalog_final: bool = False


class _Item(NamedTuple):
    """One record() call. record() queues a plain tuple of these fields (the cheapest thing to
    build on the request path); the flusher reads it as an _Item."""

    result: StreamResult
    experiment: str
    variant: str
    user_id: str
    config_revision: int
    sent_unix_ms: float
    request_id: str
    prompt_tokens: int
    max_tokens: int
    gateway_ms: float
    attempt: int


class LiveRecorder:
    """The gateway process's sample recorder (module docstring). ``store`` and ``spool_dir``
    default to the process's (samples.factory.sample_store, settings.SPOOL_DIR); the other
    keywords tune batching and are for tests and the bench."""

    def __init__(
        self,
        *,
        worker: str,
        store: SampleStore | None = None,
        spool_dir: str | None = None,
        batch_rows: int = BATCH_ROWS,
        flush_ms: float = FLUSH_MS,
        queue_rows: int = QUEUE_ROWS,
        retry_s: float = RETRY_S,
        heartbeat_s: float = HEARTBEAT_S,
        max_seq: int = MAX_SEQ,
        flush_budget_s: float = FLUSH_BUDGET_S,
    ) -> None:
        if batch_rows < 1 or queue_rows < batch_rows or flush_ms <= 0 or max_seq < 1:
            raise ValueError("LiveRecorder: need batch_rows >= 1, queue_rows >= batch_rows, flush_ms > 0")
        self.worker = worker
        self._store, self._spool_dir = store, spool_dir
        self.batch_rows, self.flush_s, self.queue_rows = batch_rows, flush_ms / 1000.0, queue_rows
        self.high_water = max(batch_rows, queue_rows // 2)
        self.retry_s, self.heartbeat_s, self.max_seq = retry_s, heartbeat_s, max_seq
        self.flush_budget_s = flush_budget_s
        self.writer: SpoolingWriter | None = None
        # _Item fields, in record() order; rows taken stay counted until written (samples.batching)
        self._queue = BatchQueue(batch_rows=batch_rows, max_age_s=self.flush_s, capacity=queue_rows)
        self._held: collections.deque[list[SampleRow]] = collections.deque()  # built, not written yet
        self._books: dict[int, _Books] = {}  # run_id -> books; the last one takes new seqs
        self._current: _Books | None = None
        self._seq = 0
        self._close_by = float("inf")  # monotonic: from then on, close() spills what is left
        self._last_heartbeat = 0.0
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._drained = threading.Event()

    # ---- the gateway's side ------------------------------------------------------------------

    def start(self) -> None:
        """Start the flusher thread; it registers this process's live run (a new run_id) and
        first flushes what an earlier process left spooled. Waits for the registration and
        raises what it raised (the database down: the gateway cannot record, so it says so at
        start). Safe to call from an event loop at startup: no database call on this thread."""
        if self._thread is not None:
            return
        if self.writer is None:
            from django.conf import settings

            from samples.factory import sample_store

            store = self._store if self._store is not None else sample_store()
            self.writer = SpoolingWriter(
                store, str(self._spool_dir or settings.SPOOL_DIR), hooks=live_spool_hooks(),
                pause_s=self.retry_s, flush_budget_s=self.flush_budget_s,
            )  # fmt: skip
        self._started.clear()
        self._start_error = None
        self._thread = threading.Thread(target=self._run, name="abplat-live-recorder", daemon=True)
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            raise RuntimeError(f"live recorder: registering the run took over {START_TIMEOUT_S:g} s")
        if self._start_error is not None:
            self._thread = None  # start() may be called again
            raise self._start_error

    def record(
        self,
        result: StreamResult,
        *,
        experiment: str,
        variant: str,
        user_id: str,
        config_revision: int,
        sent_unix_ms: float,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        gateway_ms: float,
        attempt: int = 1,
    ) -> None:
        """Queue one request's sample (module docstring). Never blocks, never raises.

        sent_unix_ms: wall-clock ms when the upstream request was written (the StreamResult
        clock's zero); gateway_ms: the gateway's own time before that, from the client's request
        received; request_id: the X-Request-Id the client saw, unique per request; attempt: 2
        for the retry on the control of a variant that failed before its first byte (its own
        sample, under the control's variant key). A bad value is counted as rejected when the
        row is built on the flusher thread, never raised here."""
        try:
            item = (result, experiment, variant, user_id, config_revision, sent_unix_ms, request_id,
                    prompt_tokens, max_tokens, gateway_ms, attempt)  # fmt: skip
            self._queue.put(item)  # refused when full or closed: counted there (dropped)
        except Exception:  # pragma: no cover - a bug here must not fail a user's request
            log.exception("live recorder: record() failed")

    def close(self, timeout: float = 10.0) -> bool:
        """Stop taking samples, write every queued one (store, or spool when the store is down
        or does not answer in time) and close the run. True when all of them were written in
        ``timeout``; False (logged) if the flusher is still inside a store call: it goes on
        writing, to the spool, as long as the process lives."""
        self._close_by = time.monotonic() + timeout / 2  # then spill what is left
        self._queue.close()
        if self._thread is None:
            return not self._queue.waiting()
        self._thread.join(timeout)
        if self._thread.is_alive() and not self._drained.is_set():
            log.error(
                "live recorder: %d samples not written yet after %g s; still trying", self.queued(), timeout
            )
            return False
        return self._drained.is_set()

    # ---- for the dashboards, tests and /metrics -------------------------------------------------

    @property
    def run_id(self) -> int | None:
        """The run_id new samples get (None before start())."""
        return self._current.run_id if self._current else None

    def queued(self) -> int:
        """Samples in memory: queued, or built and waiting for a write to succeed."""
        return self._queue.in_memory()

    def counts(self) -> dict[str, int]:
        """This process's counters over all its runs (a snapshot; the flusher updates them)."""
        out = dict.fromkeys(("recorded", "stored", "spooled", "dropped", "rejected"), 0)
        for b in list(self._books.values()):
            for k in out:
                out[k] += getattr(b, k)
        out["dropped"] += sum(self._queue.refused())  # not in a run's books yet
        out["queued"] = self._queue.in_memory()
        return out

    # ---- the flusher thread ----------------------------------------------------------------------

    def _run(self) -> None:
        from django.db import connections

        try:
            try:
                self._current = self._register()
            except BaseException as exc:
                self._start_error = exc
                return
            finally:
                self._started.set()
            self._retry_spool()  # what an earlier process left spooled
            self._catalog_dead()
            while True:
                items, closing = self._take()
                if items:
                    self._build(items)
                self._write_held(closing)
                if self.writer.draining or self._spooled_since_pause():
                    self._retry_spool()
                if time.monotonic() - self._last_heartbeat >= self.heartbeat_s:
                    self._heartbeat()
                    self._catalog()
                if closing and not items and not self._held and not self._queue.waiting():
                    break
            self._drained.set()
            for b in self._books.values():
                b.open = False
            self._heartbeat(closing=True)
            if any(not self._stored(run_id) for run_id in self._books):
                self._retry_spool()  # stored now if the store is back: the catalog can say done
            self._catalog()
        except BaseException:  # pragma: no cover - the thread must say why it stopped
            log.exception("live recorder: the flusher thread stopped; samples stay queued")
            raise
        finally:
            connections.close_all()

    def _register(self) -> _Books:
        from gateway.models import LiveRun

        assert self.writer is not None
        run = LiveRun.register(self.writer.spool.id, self.worker)
        books = _Books(pk=run.pk, run_id=run.run_id, started_ms=run.started_at.timestamp() * 1000.0)
        self._books[run.run_id] = books
        self._seq = 0
        log.info("live recorder: recording as live run %s (%s)", run.run_id, self.worker)
        return books

    def _take(self) -> tuple[list[tuple], bool]:
        """The next batch (waits up to flush_ms for batch_rows), and whether close() was called.
        While the store is away or the queue is deep, batches are larger (fewer fsyncs)."""
        items, closing = self._queue.take(limit=self.batch_rows * (20 if self._spilling() else 1))
        metrics.LIVE_QUEUE_ROWS.set(self._queue.in_memory())
        return items, closing

    def _spilling(self) -> bool:
        assert self.writer is not None
        return self.writer.spilling() or self._queue.in_memory() >= self.high_water

    def _spooled_since_pause(self) -> bool:
        """The writer's pause after a store failure is over and the spool holds batches: time
        to try the store again (a pause still running, or an empty spool: nothing to do)."""
        assert self.writer is not None
        return not self.writer.paused() and bool(self.writer.spool.pending_files())

    def _build(self, items: Sequence[tuple]) -> None:
        """Rows of a batch, each with the next seq of the current run (a new run at max_seq)."""
        rows: list[SampleRow] = []
        for at, raw in enumerate(items):
            it = _Item._make(raw)
            if self._seq >= self.max_seq:
                if rows:
                    self._held.append(rows)
                    rows = []
                try:
                    self._rotate()
                except Exception:  # the database down: no new run_id; the rest waits in memory
                    log.exception("live recorder: starting the next live run failed; retrying")
                    self._queue.give_back(items[at:])
                    time.sleep(min(self.retry_s, 1.0))
                    return
            if at and at % YIELD_EVERY == 0:
                time.sleep(0)  # let the event loop have the GIL: it serves requests meanwhile
            books = self._current
            assert books is not None
            self._seq += 1
            try:
                rows.append(self._row(it, books))
                books.recorded += 1
            except (SampleError, TypeError, ValueError, AttributeError) as exc:
                books.rejected += 1
                self._seq -= 1  # seqs of durable rows stay 1..K without holes
                self._queue.done(1)
                metrics.LIVE_SAMPLES_DROPPED.labels("invalid").inc()
                log.warning("live recorder: sample of request %r rejected: %s", it.request_id, exc)
            books.saved = False
        if rows:
            self._held.append(rows)

    def _row(self, it: _Item, books: _Books) -> SampleRow:
        gateway_ms = float(it.gateway_ms)
        row = row_from(
            it.result,
            SampleContext(
                experiment=it.experiment,
                run_id=books.run_id,
                seq=self._seq,
                variant=it.variant,
                mode=MODE,
                sent_unix_ms=it.sent_unix_ms,
                request_id=it.request_id,
                user_id=it.user_id,
                config_revision=it.config_revision,
                # the client's request received, ms after the run's start (module docstring)
                scheduled_offset_ms=max(0.0, float(it.sent_unix_ms) - gateway_ms - books.started_ms),
                gateway_ms=gateway_ms,
                prompt_tokens=it.prompt_tokens,
                prompt_tokens_estimated=True,  # used only without a usage event (row_from)
                max_tokens=it.max_tokens,
                worker=self.worker,
                attempt=it.attempt,
            ),
        )
        metrics.LIVE_SAMPLES_RECORDED.labels(it.experiment).inc()
        return row

    def _rotate(self) -> None:
        """The current run used every seq: later samples go to a new run (a new run_id)."""
        assert self._current is not None
        self._current.open = False
        self._current.saved = False
        self._heartbeat()
        self._current = self._register()

    def _write_held(self, closing: bool) -> None:
        """Write the built batches in order: store (SpoolingWriter.write, which spools when the
        store fails) or straight to the spool while spilling. A batch that cannot be written
        anywhere (the spool's disk failing) stays held and is tried again."""
        assert self.writer is not None
        while self._held:
            batch = self._held[0]
            spill = self._spilling() or (closing and time.monotonic() >= self._close_by)
            try:
                if spill:
                    self.writer.spill(batch)
                    where = "spool"
                else:
                    where = "store" if self.writer.write(batch) == "stored" else "spool"
            except SampleError as exc:  # not from row_from's rows; counted, never retried forever
                self._reject(batch, exc)
                continue
            except Exception as exc:
                if not spill and self._spill_after(exc, batch):
                    where = "spool"
                else:
                    log.error("live recorder: %d samples could not be written (%s); retrying in %g s",
                              len(batch), exc, self.retry_s)  # fmt: skip
                    self.writer.pause()
                    time.sleep(min(self.retry_s, 1.0))  # the disk failing: no busy loop of errors
                    if not closing:
                        return
                    continue
            self._held.popleft()
            self._queue.done(len(batch))
            self._count(batch, where)

    def _spill_after(self, exc: BaseException, batch: list[SampleRow]) -> bool:
        """The store refused a batch with an error that is not "unavailable" (not migrated, a
        permanent error): keep it in the spool for a human, and spool until the next retry."""
        assert self.writer is not None
        log.error("live recorder: the store refused %d samples (%s: %s); spooling them",
                  len(batch), type(exc).__name__, exc)  # fmt: skip
        self.writer.pause()
        try:
            self.writer.spill(batch)
        except Exception:
            log.exception("live recorder: spooling %d samples failed too", len(batch))
            return False
        return True

    def _reject(self, batch: list[SampleRow], exc: SampleError) -> None:
        bad = [batch[exc.row]] if exc.row is not None and exc.row < len(batch) else list(batch)
        log.error("live recorder: %d samples rejected by the validator: %s", len(bad), exc)
        for row in bad:
            batch.remove(row)
            self._books[int(row["run_id"])].rejected += 1
            self._books[int(row["run_id"])].recorded -= 1
            metrics.LIVE_SAMPLES_DROPPED.labels("invalid").inc()
        self._queue.done(len(bad))
        if not batch:
            self._held.popleft()

    def _count(self, batch: list[SampleRow], where: str) -> None:
        per: collections.Counter[tuple[int, str]] = collections.Counter(
            (int(r["run_id"]), r["experiment"]) for r in batch
        )
        for (run_id, experiment), n in per.items():
            books = self._books[run_id]
            if where == "store":
                books.stored += n
            else:
                books.spooled += n
            books.experiments[experiment] += n
            books.saved = False
            metrics.LIVE_SAMPLES_WRITTEN.labels(experiment, where).inc(n)

    def _retry_spool(self) -> None:
        """Flush the spool (this process's earlier batches, and an earlier process's) through the
        writer's retry (SpoolingWriter.retry: a ping, then at most flush_budget_s), stopping
        early when the queue passes its high-water mark: this thread must keep spooling the
        samples that arrive meanwhile. The store is back when the spool is empty."""
        assert self.writer is not None
        try:
            self.writer.retry(stop=lambda: self.queued() >= self.high_water)
        except Exception:
            log.exception("live recorder: flushing the spool failed")  # the writer paused

    def _heartbeat(self, closing: bool = False) -> None:
        """Save every run's counters (and the drops record() counted) to its LiveRun row."""
        from django.utils import timezone

        from gateway.models import LiveRun

        self._last_heartbeat = time.monotonic()
        full, after = self._queue.refused(reset=True)
        metrics.LIVE_QUEUE_ROWS.set(self._queue.in_memory())
        if full:
            metrics.LIVE_SAMPLES_DROPPED.labels("queue_full").inc(full)
        if after:
            metrics.LIVE_SAMPLES_DROPPED.labels("closed").inc(after)
        if self._current is not None:
            self._current.dropped += full + after
            self._current.saved = self._current.saved and not (full or after)
        now = timezone.now()
        for books in list(self._books.values()):
            if books.saved and not closing and books is not self._current:
                continue  # the current run's heartbeat_at moves on even when it is idle
            fields: dict[str, Any] = {
                "recorded": books.recorded, "stored": books.stored, "spooled": books.spooled,
                "dropped": books.dropped, "rejected": books.rejected,
                "experiments": dict(books.experiments), "heartbeat_at": now,
            }  # fmt: skip
            if not books.open and not self._held_of(books.run_id):
                fields.update(status=LiveRun.Status.CLOSED, closed_at=now)
            try:
                LiveRun.objects.filter(pk=books.pk).update(**fields)
                books.saved = True
                books.saved_experiments = frozenset(books.experiments)
            except Exception:
                log.warning("live recorder: saving the counters of live run %s failed; next heartbeat tries again",
                            books.run_id, exc_info=True)  # fmt: skip
        # What the spool holds, again: another process may have flushed it (`manage.py
        # flush_samples`, a replay worker sharing the directory) through hooks that skip live
        # runs. Read without the spool's lock (a flush may hold it for long): a batch being
        # spooled right now shows at the next heartbeat.
        assert self.writer is not None
        try:
            LiveRun.sync_spool(self.writer.spool.id, self.writer.spool.rows_by_run())
        except Exception:
            log.warning("live recorder: updating the spool's books failed; next heartbeat", exc_info=True)

    def _stored(self, run_id: int) -> bool:
        """No sample of the run waits in the spool (its files' headers say; a torn file counts
        in full), so all it wrote is in the store."""
        assert self.writer is not None
        return self.writer.spool.rows_by_run().get(run_id, 0) == 0

    def _held_of(self, run_id: int) -> bool:
        """Rows of the run still wait to be written (a held batch holds one run's rows)."""
        return any(int(batch[0]["run_id"]) == run_id for batch in self._held if batch)

    # ---- the sample store's run catalog (what the report reads: samples.store.record_run) -----

    def _catalog(self) -> None:
        """Tell the run catalog each run's status per experiment, while the store is up:
        'running' for an experiment once its LiveRun row names it (so a later start can finish
        what a killed process catalogued), and the final status once a run is closed and every
        sample of it is in the store. A failure waits for the next heartbeat."""
        from gateway.models import LiveRun

        assert self.writer is not None
        if self.writer.paused():
            return
        store = self.writer.store
        try:
            for books in list(self._books.values()):
                for experiment in sorted(books.saved_experiments - books.catalogued):
                    store.record_run(books.run_id, experiment, MODE, "running", source=MODE,
                                     started_ms=int(books.started_ms))  # fmt: skip
                    books.catalogued.add(experiment)
                if books.open or books.catalog_final or not books.saved or self._held_of(books.run_id):
                    continue
                if not self._stored(books.run_id):
                    continue  # spooled samples first: a run is done when its samples are stored
                for experiment in sorted(books.saved_experiments):
                    store.record_run(books.run_id, experiment, MODE, "done", source=MODE,
                                     started_ms=int(books.started_ms), finished_ms=int(time.time() * 1000))  # fmt: skip
                LiveRun.objects.filter(pk=books.pk).update(catalog_final=True)
                books.catalog_final = True
        except Exception as exc:
            log.info("live recorder: the run catalog did not take a status yet (%s); next heartbeat", exc)

    def _catalog_dead(self) -> None:
        """Runs of this spool that ended before their process could tell the catalog (killed:
        'failed'; closed while the store was down: 'done'), once their spooled samples are stored."""
        from gateway.models import LiveRun

        assert self.writer is not None
        if self.writer.paused():
            return
        mine = {b.pk for b in self._books.values()}
        try:
            ended = LiveRun.objects.filter(spool=self.writer.spool.id, catalog_final=False).exclude(
                status=LiveRun.Status.RUNNING
            )
            for run in ended.exclude(pk__in=mine):
                if not self._stored(run.run_id):
                    continue
                for experiment in sorted(run.experiments):
                    self.writer.store.record_run(
                        run.run_id, experiment, MODE, run.catalog_status, source=MODE,
                        started_ms=int(run.started_at.timestamp() * 1000),
                        finished_ms=int(run.heartbeat_at.timestamp() * 1000),
                    )  # fmt: skip
                LiveRun.objects.filter(pk=run.pk).update(catalog_final=True)
        except Exception as exc:
            log.info("live recorder: finishing the catalog of ended live runs failed (%s); next start", exc)
