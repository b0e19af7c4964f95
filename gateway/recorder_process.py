"""The host's live recorder: tails the gateway processes' queue files into the sample store.

One per spool directory (its flock, gateway.record_queue), run by the first gateway process on
the host as a detached child, or by an operator under a supervisor (`manage.py
gateway_recorder`); with the embedded store (one process may open chDB) a thread of the gateway
process itself. Its work, off the gateway's interpreter:

1. Its reader (the thread that calls ``run``, or a test calling ``read_once``) lists the queue
   files, reads each one's new records from its durable offset and queues them on a
   samples.flush.FlushLoop, keeping at most MAX_IN_FLIGHT of them in memory: the queue files are
   the buffer, so nothing is refused, whatever the store does.
2. The loop's thread builds rows (samples.rows.row_from), each with the next seq of its file's
   run: seqs follow the file's order, so a re-read gives every row the key and seq it had; a run
   that used every seq goes on as a new run, registered and written to the file's state before
   any row of it is written. The rows go through the spooling writer (samples.spool): to the
   store, or to the durable spool when the store is down or slow.
3. Once a batch is durable (stored or spooled) the file's state is replaced (fsync'ed): the
   offset up to which every record is durable, the seq there, the runs, the counts.
4. A file whose writer is gone (its flock free) and whose records are all durable: its runs'
   books are saved closed with exact counts (the closing record adds the writer's own: what it
   could not write), the run catalog is told, and the file and its state are removed.
5. A SHADOW record (a shadow's comparison row, gateway/shadow.py) is not a sample: the reader
   keeps it aside, and the loop's thread writes the ones read at each pass through the
   ShadowWriter (gateway/shadow_store.py: the store's fidelity_shadows, or its own spool while
   the store is down); once written, it is durable like a sample and the offset moves past it.

No duplicates across a crash of the recorder: after a crash between a store write and the
state's write, the records after the durable offset are read again. A start that finds the
``recorder.running`` mark of the last one (it did not stop cleanly) treats the first MAX_IN_FLIGHT records after each durable
offset as possibly stored already: their rows are spooled, and the spool's flush skips the keys
already stored (samples.spool). A re-read row has the same key (seq and run_id come from the
file and its state), so nothing is written twice.

Every database call is on the loop's thread (as in the gateway's recorder before it).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import socket
import threading
import time
from typing import Any

from gateway import record_queue as rq
from gateway.live_books import MODE, LiveBooks, RunBooks, live_spool_hooks
from gateway.live_catalog import LiveCatalog
from gateway.shadow_store import ShadowWriter
from samples.columns import SampleError, SampleRow
from samples.flush import Built, FlushHooks, FlushLoop, InvalidRows
from samples.rows import SampleContext, row_from
from samples.spool import FLUSH_BUDGET_S, SpoolingWriter
from samples.store import SampleStore
from telemetry import metrics

log = logging.getLogger(__name__)

MAX_SEQ = 2**32 - 1  # samples.seq is UInt32: a run that reaches it goes on as a new run
BATCH_ROWS = 500
# A batch leaves at BATCH_ROWS or after FLUSH_MS: one insert a second per host at low rates, as
# ClickHouse asks (each insert is a part to merge); samples reach the store within a second.
FLUSH_MS = 1000.0
# Records read and not yet durable, over every file: the bound of what a crash may have written
# past the durable offsets (module docstring), and of the recorder's memory.
MAX_IN_FLIGHT = 5000
RETRY_S = 5.0
HEARTBEAT_S = 5.0
POLL_S = 0.2  # the reader looks for new records this often (a batch leaves every FLUSH_MS anyway)
IDLE_EXIT_S = 10.0  # a recorder a gateway started ends after this long with nothing to do
NICE = 19  # the recorder process's niceness (serve)


@dataclasses.dataclass(eq=False)
class _Entry:
    """One record read from a queue file, not durable yet."""

    end: int  # the offset after it
    suspect: bool = False  # may be stored already (a re-read after a crash)
    run: int = 0  # index in the file's runs, once built
    seq: int = 0
    experiment: str = ""
    done: str = ""  # "store", "spool", "rejected", "invalid", "mark", "shadow" (not a sample)


@dataclasses.dataclass(eq=False)
class _Tail:
    """One queue file as the recorder follows it."""

    run_id: int  # the file's first run
    path: str
    runs: list[int]
    acked: int = 0  # offset: every record before it is durable (the state file's)
    read_at: int = 0  # offset of the next record to read
    acked_run: int = 0  # the run index and seq at ``acked``
    acked_seq: int = 0
    run: int = 0  # the run index and last seq given (the loop's thread)
    seq: int = 0
    counts: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)  # durable, per run
    header: tuple | None = None
    closing: tuple | None = None  # the writer's CLOSED record
    entries: collections.deque[_Entry] = dataclasses.field(default_factory=collections.deque)
    suspect_left: int = 0
    ended: bool = False  # every record read and the writer gone
    lost_bytes: int = 0  # a torn end (a crash of the host mid-write): not a record
    unsaved: bool = False  # ``acked`` moved since the state file was written
    closing_booked: bool = False

    def state(self) -> dict[str, Any]:
        return {
            "offset": self.acked,
            "run": self.acked_run,
            "seq": self.acked_seq,
            "runs": self.runs,
            "counts": {str(r): c for r, c in self.counts.items()},
        }


def _zero() -> dict[str, Any]:
    return {"recorded": 0, "stored": 0, "spooled": 0, "rejected": 0, "experiments": {}}


class QueueRecorder:
    """The recorder of the queue files in ``spool_dir``/live-queue (module docstring). ``store``
    defaults to the process's (samples.factory.sample_store); the keywords tune it for tests."""

    def __init__(
        self,
        spool_dir: str,
        *,
        store: SampleStore | None = None,
        batch_rows: int = BATCH_ROWS,
        flush_ms: float = FLUSH_MS,
        retry_s: float = RETRY_S,
        heartbeat_s: float = HEARTBEAT_S,
        max_seq: int = MAX_SEQ,
        flush_budget_s: float = FLUSH_BUDGET_S,
        max_in_flight: int = MAX_IN_FLIGHT,
    ) -> None:
        if batch_rows < 1 or flush_ms <= 0 or max_seq < 1 or max_in_flight < batch_rows:
            raise ValueError("QueueRecorder: need batch_rows >= 1, flush_ms > 0, max_in_flight >= batch_rows")
        self.spool_dir = os.path.abspath(spool_dir)
        self.dir = rq.queue_dir(spool_dir)
        self._store = store
        self.batch_rows, self.flush_ms, self.retry_s = batch_rows, flush_ms, retry_s
        self.heartbeat_s, self.max_seq, self.flush_budget_s = heartbeat_s, max_seq, flush_budget_s
        self.max_in_flight = max_in_flight
        self.writer: SpoolingWriter | None = None
        self.shadow_writer: ShadowWriter | None = None
        self.shadows: list[tuple[_Tail, _Entry, tuple]] = []  # SHADOW records read, not written (lock)
        self.books: LiveBooks | None = None
        self.tails: dict[int, _Tail] = {}
        self.lock = threading.Lock()  # tails' entries: the reader appends, the loop's thread acks
        self.in_flight = 0
        self.dirty = False  # the last recorder did not stop cleanly
        self.suspect: set[tuple[int, int]] = set()  # (run_id, seq) of rows that may be stored already
        self._lock_fd: int | None = None
        self.loop = FlushLoop(
            batch_rows=batch_rows,
            max_age_s=flush_ms / 1000.0,
            # never refused, and its high-water mark (half) never reached by the reader alone:
            # the loop spills only when the store fails or the spool drains
            capacity=max_in_flight * 4,
            max_batch_rows=batch_rows,
            log=log,
            name="abplat-live-recorder",
        )
        self._idle_since = time.monotonic()

    # ---- the lock ------------------------------------------------------------------------------

    def acquire(self) -> bool:
        """Take the host's recorder lock; False when another recorder holds it."""
        if self._lock_fd is None:
            self._lock_fd = rq.try_lock(self.dir)
        return self._lock_fd is not None

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # ---- running -------------------------------------------------------------------------------

    def start(self) -> None:
        """With the lock held: open the writer and start the loop's thread (which marks the
        runs of dead writers without a queue file abandoned, and flushes the spool)."""
        assert self._lock_fd is not None, "QueueRecorder.start: acquire() the lock first"
        running = os.path.join(self.dir, rq.RUNNING_FILE)
        self.dirty = os.path.exists(running)  # left by a recorder that did not stop cleanly
        with open(running, "w") as f:
            os.fsync(f.fileno())
        rq.fsync_dir(self.dir)
        if self.writer is None:
            from samples.factory import sample_store

            store = self._store if self._store is not None else sample_store()
            self.writer = SpoolingWriter(
                store,
                self.spool_dir,
                hooks=live_spool_hooks(),
                pause_s=self.retry_s,
                flush_budget_s=self.flush_budget_s,
            )
            self.books = LiveBooks(self.writer.spool)
            self.shadow_writer = ShadowWriter(
                store, self.spool_dir, pause_s=self.retry_s, store_paused=self.writer.paused
            )
        hooks = _LoopHooks(self, LiveCatalog(self.books, self.writer))
        self.loop.start(self._write, spill_to=self.writer, hooks=hooks)

    def run(self, stop: threading.Event, idle_exit_s: float | None = None, poll_s: float = POLL_S) -> None:
        """Read until ``stop`` is set (or, with ``idle_exit_s``, nothing was left to do for that
        long), then stop cleanly. The caller holds the lock and called start()."""
        while not stop.is_set():
            busy = self.read_once()
            if idle_exit_s is not None and self.idle_for() >= idle_exit_s and self._give_up_lock():
                break
            stop.wait(0 if busy else poll_s)
        self.read_once()  # what was written up to the stop (a closing gateway's last records)
        self.stop()

    def stop(self, timeout: float | None = None) -> bool:
        """Write every record read, save the books, mark a clean stop, release the lock."""
        ok = self.loop.close(timeout)
        if ok and self._lock_fd is not None:
            _unlink(os.path.join(self.dir, rq.RUNNING_FILE))
            rq.fsync_dir(self.dir)
        self.release()
        return ok

    def drain(self, timeout: float = 60.0) -> bool:
        """For tests and tools: take the lock, read and write every record there is now, finish
        the files whose writer is gone, and stop. False when the lock is held elsewhere."""
        if not self.acquire():
            return False
        self.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            busy = self.read_once()
            if (
                not busy
                and not self.in_flight
                and all(t.ended or t.acked == t.read_at for t in self.tails.values())
            ):
                break
            time.sleep(0 if busy else 0.005)
        return self.stop(timeout)

    def idle_for(self) -> float:
        """Seconds with no queue file, nothing in flight and nothing spooled (0 when busy)."""
        spooled = (self.writer and self.writer.spool.pending_files()) or (
            self.shadow_writer and self.shadow_writer.pending_files()
        )
        if self.tails or self.in_flight or spooled:
            self._idle_since = time.monotonic()
        return time.monotonic() - self._idle_since

    def _give_up_lock(self) -> bool:
        """Idle: release the lock, then look again. A gateway that started meanwhile made its
        queue file before it looked for a recorder: either this look sees the file (the recorder
        goes on, taking the lock back if nobody took it) or that gateway saw the lock free and
        started another recorder. True: end."""
        running = os.path.join(self.dir, rq.RUNNING_FILE)
        _unlink(running)  # idle: nothing read is left unwritten, this is a clean stop
        rq.fsync_dir(self.dir)
        self.release()
        if not rq.queue_files(self.dir)[0] or not self.acquire():
            return True
        with open(running, "w") as f:
            os.fsync(f.fileno())
        rq.fsync_dir(self.dir)
        return False

    # ---- the reader ------------------------------------------------------------------------------

    def read_once(self) -> bool:
        """One pass over the queue files (module docstring, 1). True when it queued records."""
        queued_any = False
        queues, creating, states = rq.queue_files(self.dir)
        for run_id in creating:  # a writer that died before its file had a header: nothing in it
            tmp = rq.queue_path(self.dir, run_id) + ".tmp"
            if not rq.writer_alive(tmp):
                _unlink(tmp)
        for run_id in states:
            if run_id not in queues and run_id not in self.tails:
                _unlink(rq.state_path(self.dir, run_id))  # its file was finished (a crash between)
        for run_id in queues:
            tail = self.tails.get(run_id)
            if tail is None:
                tail = self.tails[run_id] = self._adopt(run_id)
            if not tail.ended:
                queued_any |= self._read(tail)
        return queued_any

    def _adopt(self, run_id: int) -> _Tail:
        path = rq.queue_path(self.dir, run_id)
        state = rq.read_state(self.dir, run_id) or {}
        tail = _Tail(run_id=run_id, path=path, runs=list(state.get("runs", [run_id])))
        tail.acked = tail.read_at = int(state.get("offset", 0))
        tail.run = tail.acked_run = int(state.get("run", 0))
        tail.seq = tail.acked_seq = int(state.get("seq", 0))
        tail.counts = {int(r): c for r, c in state.get("counts", {}).items()}
        if tail.acked:  # the header is the file's first record
            [(tail.header, _end)], _at, _partial = rq.read_records(path, 0, 1)
        if self.dirty:
            tail.suspect_left = self.max_in_flight
        return tail

    def _read(self, tail: _Tail) -> bool:
        room = self.max_in_flight - self.in_flight
        if room <= 0:
            return False
        alive = rq.writer_alive(tail.path)  # before reading: a writer gone then wrote nothing after
        try:
            records, at, partial = rq.read_records(tail.path, tail.read_at, room)
        except rq.Torn as exc:
            records, at, partial = [], tail.read_at, True
            if not alive:
                log.error("live recorder: %s; the rest of the file is lost", exc)
        except FileNotFoundError:
            return False
        for record, end in records:
            kind = record[0]
            entry = _Entry(end=end)
            if kind == rq.SAMPLE:
                if tail.suspect_left > 0:
                    entry.suspect = True
                    tail.suspect_left -= 1
                with self.lock:
                    tail.entries.append(entry)
                    self.in_flight += 1
                self.loop.put((tail, entry, record))
                continue
            if kind == rq.SHADOW:
                with self.lock:
                    tail.entries.append(entry)
                    self.in_flight += 1
                    self.shadows.append((tail, entry, record))
                continue
            if kind == rq.HEADER:
                tail.header = record
            elif kind == rq.CLOSED:
                tail.closing = record
            entry.done = "mark"
            with self.lock:
                tail.entries.append(entry)
        tail.read_at = at
        if not alive and len(records) < room:
            if partial:
                tail.lost_bytes = os.path.getsize(tail.path) - at
                log.error(
                    "live recorder: %s ends with %d bytes that are not a record (cut by a crash of "
                    "the host); the samples before them are kept",
                    tail.path,
                    tail.lost_bytes,
                )
            tail.ended = True
        if records:
            with self.lock:
                self._ack(tail)
        return any(r[0] == rq.SAMPLE for r, _ in records)

    # ---- the loop's thread -----------------------------------------------------------------------

    def _write(self, batch: list[Any]) -> str:
        """The loop's write: a batch holding a row that may be stored already is spooled (the
        spool's flush skips stored keys); the others go through the spooling writer."""
        assert self.writer is not None
        if self.suspect and any((row["run_id"], row["seq"]) in self.suspect for row in batch):
            self.writer.spill(batch)
            return "spooled"
        return self.writer.write(batch)

    def _ack(self, tail: _Tail) -> None:
        """Lock held: move the file's durable offset over the front records that are done (its
        state is to be saved: ``unsaved``)."""
        while tail.entries and tail.entries[0].done:
            entry = tail.entries.popleft()
            tail.unsaved = True
            tail.acked = entry.end
            if entry.done == "mark":
                continue
            self.in_flight -= 1
            if entry.done == "shadow":
                continue  # not a sample: no seq, no count
            if entry.done in ("rejected",):
                counts = tail.counts.setdefault(tail.runs[entry.run], _zero())
                counts["rejected"] += 1
                continue
            tail.acked_run, tail.acked_seq = entry.run, entry.seq
            counts = tail.counts.setdefault(tail.runs[entry.run], _zero())
            if entry.done == "invalid":
                counts["rejected"] += 1
                continue
            counts["recorded"] += 1
            counts["stored" if entry.done == "store" else "spooled"] += 1
            counts["experiments"][entry.experiment] = counts["experiments"].get(entry.experiment, 0) + 1

    def write_shadows(self) -> None:
        """The loop's thread: write the SHADOW records read so far (module docstring, 5), or,
        with none, flush the shadows' spool once the store may be back. A write that fails
        otherwise (the spool's disk) leaves them to the next pass."""
        writer = self.shadow_writer
        assert writer is not None
        with self.lock:
            pending, self.shadows = self.shadows, []
        if not pending:
            if writer.retry_due():
                writer.retry()
            return
        rows = []
        for _tail, _entry, record in pending:
            row = record[2] if len(record) > 2 else None
            if isinstance(row, dict):
                rows.append(row)
            else:
                log.warning("live recorder: a shadow record that is not a row, skipped: %r", record[:3])
        try:
            writer.write(rows)
        except Exception:
            log.exception("live recorder: writing %d shadow rows failed; retrying", len(rows))
            with self.lock:
                self.shadows[:0] = pending
            return
        for _tail, entry, _record in pending:
            entry.done = "shadow"
        for tail in {id(t): t for t, _e, _r in pending}.values():
            self.save_state(tail)

    def save_state(self, tail: _Tail) -> None:
        """The loop's thread: write the file's state if its durable offset moved (or its runs
        changed: ``unsaved`` set by the caller)."""
        with self.lock:
            self._ack(tail)
            state = tail.state() if tail.unsaved else None
            tail.unsaved = False
        if state is not None and os.path.exists(tail.path):
            rq.write_state(self.dir, tail.run_id, state)

    def finish_ended(self) -> None:
        """The loop's thread: close the books of files whose writer is gone and whose records
        are all durable, then remove them (module docstring, 4)."""
        assert self.books is not None
        for tail in [t for t in list(self.tails.values()) if t.ended and not t.entries]:
            try:
                books = [self.books.adopt(r, tail.counts.get(r)) for r in tail.runs]
            except Exception:
                log.warning("live recorder: the database is not answering; %s waits", tail.path)
                return
            if tail.closing is not None and not tail.closing_booked:
                self.books.dropped(books[-1], int(tail.closing[2]))
                if tail.closing[3]:
                    self.books.rejected(books[-1], int(tail.closing[3]))
                tail.closing_booked = True
            for b in books:
                b.open, b.saved = False, False
            if not self.books.heartbeat(closing=True):
                return  # the books first: the file is their only source
            if tail.closing is None:
                log.warning(
                    "live recorder: the gateway of live run %s ended without closing (killed); every "
                    "sample it wrote is recorded, a stream it was serving has none",
                    tail.run_id,
                )
            _unlink(tail.path)
            _unlink(rq.state_path(self.dir, tail.run_id))
            rq.fsync_dir(self.dir)
            del self.tails[tail.run_id]


class _LoopHooks(FlushHooks):
    """What the recorder does on its flush loop's thread (samples.flush.FlushHooks)."""

    def __init__(self, rec: QueueRecorder, catalog: LiveCatalog) -> None:
        self.rec, self.catalog = rec, catalog
        assert rec.books is not None
        self.books: LiveBooks = rec.books
        self.where: dict[tuple[int, int], tuple[_Tail, _Entry]] = {}  # built rows not written yet

    def starting(self) -> None:
        from gateway.models import LiveRun

        keep = set(rq.queue_files(self.rec.dir)[0])
        for run_id in keep:
            keep.update((rq.read_state(self.rec.dir, run_id) or {}).get("runs", []))
        LiveRun.abandon_dead(self.books.spool.id, keep)

    def started(self) -> None:
        self.rec.loop.retry_spool()  # what an earlier recorder left spooled
        self.rec.write_shadows()  # and its spooled shadow rows
        self.catalog.finish_ended()

    def rows(self, items: list[Any]) -> Built:
        rows: list[SampleRow] = []
        invalid = 0
        touched: set[int] = set()
        for at, (tail, entry, record) in enumerate(items):
            try:
                books = self._run_books(tail)
            except Exception:  # the database down: no books, no new run; the rest waits
                log.exception("live recorder: the database is not answering; retrying")
                time.sleep(min(self.rec.retry_s, 1.0))
                return Built([rows] if rows else [], invalid, left=items[at:])
            tail.seq += 1
            try:
                row = self._row(tail, record, books)
            except (SampleError, TypeError, ValueError, AttributeError, IndexError) as exc:
                tail.seq -= 1  # seqs of durable rows stay 1..K without holes
                invalid += 1
                self.books.rejected(books)
                entry.run, entry.done = tail.run, "rejected"
                touched.add(id(tail))
                log.warning("live recorder: a sample in %s rejected: %s", tail.path, exc)
                continue
            books.recorded += 1
            books.saved = False
            entry.run, entry.seq, entry.experiment = tail.run, tail.seq, row["experiment"]
            if entry.suspect:
                self.rec.suspect.add((books.run_id, tail.seq))
            self.where[(books.run_id, tail.seq)] = (tail, entry)
            rows.append(row)
        if touched:
            self._acked({id(t): t for t, _e, _r in items if id(t) in touched}.values())
        return Built([rows] if rows else [], invalid)

    def _run_books(self, tail: _Tail) -> RunBooks:
        """The books of the run the file's next row goes to: the next run once the current one
        used every seq (registered, and written to the file's state before any row of it)."""
        if tail.seq >= self.rec.max_seq:
            if tail.run + 1 >= len(tail.runs):
                header = tail.header or (None, None, None, "", 0, "")
                books = self.books.register(str(header[3]), int(header[4] or 0), str(header[5]))
                with self.rec.lock:
                    tail.runs.append(books.run_id)
                    tail.unsaved = True
                self.rec.save_state(tail)
            tail.run += 1
            tail.seq = 0
        return self.books.adopt(tail.runs[tail.run], tail.counts.get(tail.runs[tail.run]))

    def _row(self, tail: _Tail, record: tuple, books: RunBooks) -> SampleRow:
        (_k, recorded_ms, _o, _v, experiment, variant, user_id, revision, sent_unix_ms, request_id) = record[
            :10
        ]
        prompt_tokens, max_tokens, gateway_ms, attempt = record[10:14]
        assert tail.header is not None, f"{tail.path}: no header record"
        gateway_ms = float(gateway_ms)
        row = row_from(
            rq.result_from(tail.header, record),
            SampleContext(
                experiment=experiment,
                run_id=books.run_id,
                seq=tail.seq,
                variant=variant,
                mode=MODE,
                sent_unix_ms=sent_unix_ms,
                request_id=request_id,
                user_id=user_id,
                config_revision=revision,
                # the client's request received, ms after the run's start (gateway.recording)
                scheduled_offset_ms=max(0.0, float(sent_unix_ms) - gateway_ms - books.started_ms),
                gateway_ms=gateway_ms,
                prompt_tokens=prompt_tokens,
                prompt_tokens_estimated=True,  # used only without a usage event (row_from)
                max_tokens=max_tokens,
                worker=str(tail.header[3]),
                attempt=attempt,
                recorded_ms=int(recorded_ms),  # the request's end: a re-read row is the same row
            ),
        )
        metrics.LIVE_SAMPLES_RECORDED.labels(experiment).inc()
        return row

    def written(self, rows: list[Any], where: str) -> None:
        self.books.written(rows, where)
        self._done(rows, where)

    def invalid(self, error: InvalidRows) -> None:
        self.books.invalid(error.rows)
        self._done(error.rows, "invalid")

    def _done(self, rows: list[Any], how: str) -> None:
        tails = {}
        for row in rows:
            key = (int(row["run_id"]), int(row["seq"]))
            tail, entry = self.where.pop(key)
            self.rec.suspect.discard(key)
            entry.done = how
            tails[id(tail)] = tail
        self._acked(tails.values())

    def _acked(self, tails: Any) -> None:
        """Save the state of each file whose durable offset moved (module docstring, 3)."""
        for tail in tails:
            self.rec.save_state(tail)

    def tick(self) -> None:
        metrics.LIVE_QUEUE_ROWS.set(self.rec.loop.queued())
        self.rec.write_shadows()
        if any(t.ended and not t.entries for t in list(self.rec.tails.values())):
            self.rec.finish_ended()
            self.catalog.tell()
        if self.books.heartbeat_due(self.rec.heartbeat_s):
            self.books.heartbeat()
            self.catalog.tell()
            self._forget_final()
            _close_connections()

    def drained(self) -> None:
        self.rec.write_shadows()
        for tail in list(self.rec.tails.values()):
            self.rec.save_state(tail)
        self.rec.finish_ended()
        self.books.heartbeat(closing=True)
        if any(self.books.waiting_in_spool(run_id) for run_id in self.books.runs):
            self.rec.loop.retry_spool()  # stored now if the store is back: the catalog can say done
        self.catalog.tell()

    def _forget_final(self) -> None:
        live = {r for t in self.rec.tails.values() for r in t.runs}
        for run_id, books in list(self.books.runs.items()):
            if run_id not in live and books.catalog_final:
                self.books.forget(run_id)

    def stopped(self) -> None:
        _close_connections()


def _close_connections() -> None:
    from django.db import connections

    connections.close_all()  # an idle recorder holds no database connection


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def serve(spool_dir: str, *, idle_exit_s: float | None = None, stop: threading.Event | None = None) -> int:
    """`manage.py gateway_recorder`: the host's recorder until SIGTERM/SIGINT (or, with
    ``idle_exit_s``, until idle that long). 0, or 3 when another recorder holds the lock."""
    import faulthandler
    import signal

    # Below the gateway's processes in the CPU scheduler: on a host whose cores are busy, a
    # request's wakeup goes ahead of a batch being built or inserted (the store's client threads,
    # chDB's included, are started after this and inherit it); the recorder still gets its share
    # (not SCHED_IDLE, which a saturated host would starve), and the queue files wait meanwhile.
    os.nice(NICE)
    rec = QueueRecorder(spool_dir)
    if not rec.acquire():
        log.info("live recorder: another recorder holds %s (pid %s)", rec.dir, rq.recorder_pid(rec.dir))
        return 3
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        # `kill -USR1 <pid>`: every thread's stack to stderr (recorder.log when a gateway started
        # it), to see where a recorder that does not stop or does not drain is waiting
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    log.info("live recorder: pid %s on %s (%s)", os.getpid(), rec.dir, socket.gethostname())
    rec.start()
    rec.run(stop, idle_exit_s=idle_exit_s)
    return 0
