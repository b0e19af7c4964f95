"""A local, append-only spool for samples the store could not take, flushed in order later.

Layout of the spool directory (ABPLAT_SPOOL_DIR):
  000000000001.jsonl   one file per spooled batch, numbered in write order. Line 1 is a header
                       {"spool": 3, "seq": n, "rows": N, "runs": [...], "counts": {run: rows},
                       "columns": [name, ...]}, then N rows, each a JSON array of its values in
                       the header's column order (samples.columns.SampleRow when that is this
                       code's). Older files are still read and flushed: format 3 of fewer
                       columns (written before gateway_ms), format 2 (arrays in the column order
                       before itl_gaps_us), format 1 (one JSON object per row), and headers
                       without "counts"; a column they lack gets its
                       samples.columns.ADDED_DEFAULTS value ([]: no gaps recorded; 0.0: no
                       gateway time, as in a replay's row or a live row of that time, which
                       held it in schedule_lag_ms).
  spool.lock           flock'ed by whoever writes or flushes, so several processes on one host
                       can share a directory without interleaving sequence numbers.
  spool.id             the spool's name, "host:directory" of where it was created: it stays with
                       the directory, so a retired worker's spool flushed elsewhere
                       (`manage.py flush_samples --spool-dir`) clears what was recorded for it.
  quarantine/          torn files, kept for a human after whatever was readable was flushed.

Durability: a batch is written to `<seq>.jsonl.tmp`, fsync'ed, renamed, and the directory
fsync'ed before write() returns "spooled". A crash before the rename leaves a `.tmp`; a crash
(or a filesystem that reorders writes) can also leave a `.jsonl` shorter than its header says.
Both are "torn", and so is a file this code cannot read (another spool format, rows of another
column schema, a value the validator now rejects): flush() inserts every complete, valid row it
can read from them, moves the file to quarantine/ and counts the rows its header promised that
it could not read, per run (FlushReport.quarantined, SpoolHooks.quarantined). Nothing is dropped
silently.

Other hosts: each worker has its own spool, which only it can flush. SpoolHooks tell whoever
keeps the books (workers records them per run and spool in its database) what the spool holds
per run: before a batch is spooled (so the record may run ahead of the files, never behind them)
and after a flush landed rows; and which rows a quarantined file lost, before it is moved.

No duplicates: before inserting a spooled batch, flush() drops the rows whose key is already
stored (the insert may have landed before it "failed", or a crash may have hit between insert and
unlink), and the table's ReplacingMergeTree + FINAL hides any copy that still slips through.
"""

from __future__ import annotations

import dataclasses
import fcntl
import itertools
import json
import logging
import os
import re
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from samples.columns import ADDED_DEFAULTS, COLUMN_NAMES, SampleError, SampleRow, row_key, validate_samples
from samples.store import SampleStore, StoreUnavailable
from telemetry import metrics

log = logging.getLogger(__name__)

SPOOL_FORMAT = 3  # rows as JSON arrays in the header's column order
_READABLE_FORMATS = (1, 2, 3)  # 1: rows as JSON objects; 2: arrays in the columns of FORMAT_2_COLUMNS
# Format 2's columns: this code's, less those added since (samples.columns.ADDED_DEFAULTS).
FORMAT_2_COLUMNS = tuple(n for n in COLUMN_NAMES if n not in ADDED_DEFAULTS)
# The retry policy's defaults (SpoolingWriter): spool this long after a store failure before
# trying it again, and flush at most this long at a time while new samples keep coming.
PAUSE_S = 5.0
FLUSH_BUDGET_S = 1.0
_NAME = re.compile(r"^(\d{12})\.jsonl(\.tmp)?$")
ID_FILE = "spool.id"


@dataclasses.dataclass(frozen=True)
class QuarantinedFile:
    path: str  # where it is now, under quarantine/
    header: dict[str, Any] | None  # its first line, if that was a JSON object (any format)
    salvaged: int  # rows read from it (and inserted, or found already stored)
    lost: dict[int, int]  # run -> rows its header promised that could not be read

    @property
    def lost_rows(self) -> int:
        return sum(self.lost.values())


@dataclasses.dataclass
class FlushReport:
    files: int = 0  # spool files fully handled (inserted or found already stored)
    inserted: int = 0  # rows inserted by this flush
    skipped_stored: int = 0  # rows dropped because the store already had them
    torn_files: list[str] = dataclasses.field(default_factory=list)  # now in quarantine/
    salvaged: int = 0  # rows read from torn files (counted in inserted/skipped_stored too)
    remaining: int = 0  # files still spooled (the store went away again)
    quarantined: list[QuarantinedFile] = dataclasses.field(default_factory=list)

    @property
    def lost(self) -> int:
        """Rows that quarantined files held but this code could not read (see the files)."""
        return sum(q.lost_rows for q in self.quarantined)


class _FlushBudget(Exception):
    """A budgeted flush used its time (or its caller had other work): the rest waits."""


@dataclasses.dataclass(frozen=True)
class SpoolHooks:
    """Who hears what a spool holds, called with the spool's lock held (so the calls of every
    process sharing the directory come in order). Both raise to refuse: nothing is spooled or
    quarantined then.

    pending(spool_id, {run: rows}): the spool now holds (or is about to hold) these rows per
        run; runs not named hold none.
    quarantined(spool_id, path, {run: rows}): the file about to move to ``path`` lost these
        rows per run. Called again for the same path if the move did not happen: idempotent.
    """

    pending: Callable[[str, dict[int, int]], None]
    quarantined: Callable[[str, str, dict[int, int]], None]


def _run_counts(rows: Sequence[Any]) -> dict[int, int]:
    return dict(Counter(int(r["run_id"]) for r in rows))


class Spool:
    """The directory itself: numbered batch files, written durably."""

    def __init__(self, directory: str) -> None:
        if not directory:
            raise ValueError("spool directory must be set (ABPLAT_SPOOL_DIR)")
        self.dir = os.path.abspath(directory)
        self.quarantine = os.path.join(self.dir, "quarantine")
        os.makedirs(self.quarantine, exist_ok=True)
        self.id = self._identity()

    def _identity(self) -> str:
        """The spool's id (its spool.id file), written the first time: "host:directory"."""
        path = os.path.join(self.dir, ID_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                found = f.read().strip()
            if found:
                return found
        except FileNotFoundError:
            pass
        ident = f"{socket.gethostname()}:{self.dir}"
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(ident + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # processes starting together write the same text
        self._fsync_dir()
        return ident

    @contextmanager
    def locked(self) -> Iterator[None]:
        fd = os.open(os.path.join(self.dir, "spool.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _entries(self) -> list[tuple[int, str, bool]]:
        """(seq, filename, is_tmp) sorted by seq."""
        out = []
        for name in os.listdir(self.dir):
            m = _NAME.match(name)
            if m:
                out.append((int(m.group(1)), name, m.group(2) is not None))
        return sorted(out)

    def _next_seq(self) -> int:
        seqs = [s for s, _n, _t in self._entries()]
        for name in os.listdir(self.quarantine):
            m = re.match(r"^(\d{12})\.", name)
            if m:
                seqs.append(int(m.group(1)))
        return max(seqs, default=0) + 1

    def append(self, rows: Sequence[SampleRow] | Sequence[Mapping[str, Any]]) -> str:
        """Write one batch of valid rows durably (caller holds the lock); returns the file name."""
        rows = [SampleRow.of(r) for r in rows]
        seq = self._next_seq()
        name = f"{seq:012d}.jsonl"
        tmp = os.path.join(self.dir, name + ".tmp")
        counts = _run_counts(rows)
        header = {
            "spool": SPOOL_FORMAT,
            "seq": seq,
            "rows": len(rows),
            "runs": sorted(counts),
            "counts": {str(run): n for run, n in sorted(counts.items())},
            "columns": list(COLUMN_NAMES),
        }
        lines = (json.dumps(r, ensure_ascii=False, allow_nan=False) for r in rows)
        write_durably(tmp, os.path.join(self.dir, name), itertools.chain([json.dumps(header)], lines))
        return name

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, name: str) -> tuple[dict[str, Any] | None, list[Any], bool]:
        """(header, rows, complete): rows are SampleRows in this code's column order (formats 2
        and 3, a column the file lacks filled from ADDED_DEFAULTS) or dicts (format 1, filled
        the same way). Stops at the first unreadable line (and reads no row of a file whose
        columns this code cannot map); never raises on bad content, because a torn file must
        still give up what it holds."""
        header: dict[str, Any] | None = None
        rows: list[Any] = []
        to_row: Any = None
        path = os.path.join(self.dir, name)
        with open(path, "rb") as f:
            data = f.read()
        lines = data.split(b"\n")
        ends_clean = data.endswith(b"\n")
        if ends_clean:
            lines = lines[:-1]
        for i, raw in enumerate(lines):
            if i == len(lines) - 1 and not ends_clean:
                break  # a last line without its newline was cut mid-write
            try:
                obj = json.loads(raw)
            except ValueError:
                break
            if i == 0:
                if not isinstance(obj, dict) or obj.get("spool") not in _READABLE_FORMATS:
                    break
                header = obj
                to_row = _row_reader(obj)
                if to_row is None:
                    break
                continue
            row = to_row(obj)
            if row is None:
                break
            rows.append(row)
        # Keep the rows before the first invalid one (the validator names a bad row; the rows
        # before it may hide another in a column checked later, so check the prefix again).
        while rows:
            try:
                validate_samples(rows, f"spool {name}")
                break
            except SampleError as e:
                rows = rows[: e.row or 0]
        complete = (
            header is not None
            and not name.endswith(".tmp")
            and header.get("rows") == len(rows)
            and len(lines) == len(rows) + 1
        )
        return header, rows, complete

    def header(self, name: str) -> dict[str, Any] | None:
        """A file's first line if it is a JSON object, whatever its format (what it claims to
        hold, even where read() cannot read it)."""
        try:
            with open(os.path.join(self.dir, name), "rb") as f:
                line = f.readline()
            head = json.loads(line)
        except (OSError, ValueError):
            return None
        return head if isinstance(head, dict) else None

    def claimed(self, name: str) -> dict[int, int]:
        """run -> rows a file's header says it holds ({} without a readable header: then it
        holds nothing readable either). Headers without per-run counts (older writers) give
        their total to each run they name: an upper bound."""
        head = self.header(name)
        if head is None:
            return {}
        try:
            counts = head.get("counts")
            if isinstance(counts, dict):
                return {int(run): int(n) for run, n in counts.items() if int(n) > 0}
            total = int(head.get("rows", 0))
            return {int(run): total for run in head.get("runs", [])} if total > 0 else {}
        except (TypeError, ValueError):
            return {}

    def rows_by_run(self) -> dict[int, int]:
        """run -> rows waiting in the spool (what the headers claim: a torn file counts in full
        until it is flushed). Reads one line per file."""
        total: Counter[int] = Counter()
        for name in self.pending_files():
            total.update(self.claimed(name))
        return dict(total)

    def pending_files(self) -> list[str]:
        return [name for _s, name, _t in self._entries()]

    def depth(self) -> tuple[int, int]:
        """(rows, bytes) waiting: rows as the headers claim them (rows_by_run), bytes on disk."""
        size = 0
        for name in self.pending_files():
            try:
                size += os.path.getsize(os.path.join(self.dir, name))
            except FileNotFoundError:
                pass  # flushed by another process meanwhile
        return sum(self.rows_by_run().values()), size

    def remove(self, name: str) -> None:
        os.unlink(os.path.join(self.dir, name))
        self._fsync_dir()

    def quarantine_path(self, name: str) -> str:
        return os.path.join(self.quarantine, name if name.endswith(".tmp") else name + ".torn")

    def move_to_quarantine(self, name: str) -> str:
        target = self.quarantine_path(name)
        os.replace(os.path.join(self.dir, name), target)
        self._fsync_dir()
        return target


def write_durably(tmp: str, path: str, lines: Iterable[str]) -> None:
    """A file of lines, durably (module docstring, "Durability"): written to ``tmp``, fsync'ed,
    renamed to ``path``, its directory fsync'ed. Also the gateway's spool of shadow rows
    (gateway/shadow_store.py)."""
    with open(tmp, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _row_reader(header: Mapping[str, Any]) -> Callable[[Any], Any] | None:
    """How the rows of a file with this header become this code's rows (None: they cannot).
    A row it cannot read gives None."""
    if header["spool"] == 1:

        def from_object(obj: Any) -> Any:
            if not isinstance(obj, dict):
                return None
            return {**{k: v for k, v in ADDED_DEFAULTS.items() if k not in obj}, **obj}

        return from_object
    columns = FORMAT_2_COLUMNS if header["spool"] == 2 else header.get("columns")
    if not isinstance(columns, list | tuple) or len(set(columns)) != len(columns):
        return None
    if list(columns) == list(COLUMN_NAMES):
        width = len(COLUMN_NAMES)
        return lambda obj: SampleRow(obj) if isinstance(obj, list) and len(obj) == width else None
    # another column list: each of ours from its position there, or its default; a column of
    # the file that this code does not know (newer code wrote it) makes the file unreadable
    if set(columns) - set(COLUMN_NAMES) or set(COLUMN_NAMES) - set(columns) - set(ADDED_DEFAULTS):
        return None
    at = {n: i for i, n in enumerate(columns)}
    picks = [(at[n], None) if n in at else (None, ADDED_DEFAULTS[n]) for n in COLUMN_NAMES]
    width = len(columns)

    def mapped(obj: Any) -> Any:
        if not isinstance(obj, list) or len(obj) != width:
            return None
        return SampleRow(obj[i] if i is not None else default for i, default in picks)

    return mapped


class SpoolingWriter:
    """Writes samples to the store, or to the spool when the store is down; never loses one.

    write(rows) -> "stored" | "spooled". Call flush() when the store may be back (write() also
    tries it first, to keep samples in order), and durable(run_id) before a run reports done:
    it answers for this spool only; ``hooks`` (SpoolHooks) tell the other hosts.

    The one retry policy of sample writing, for replays and the live gateway alike (the store's
    backend retries a single call's transient errors; nothing above this retries a store):
    - After the store failed a write, writes go straight to the spool for ``pause_s``, without a
      store call: during an outage each would cost the backend's connect timeout and retries
      while samples wait behind it (``paused()``).
    - Then the next write, or ``retry()``, first asks the store a trivial query (a store still
      away costs one connect timeout, and pauses again) and only then flushes the spool, at most
      ``flush_budget_s`` at a time and a whole file at a time: after a long outage the spool can
      take minutes to flush, and its writer must keep taking samples meanwhile.
    - While the spool is not yet empty (a flush used its budget), new batches are spooled behind
      it (``draining``): the store sees samples in write order. ``spilling()`` is either state.
    ``clock`` (monotonic seconds) is injectable for tests.
    """

    def __init__(
        self,
        store: SampleStore,
        spool_dir: str,
        hooks: SpoolHooks | None = None,
        *,
        pause_s: float = PAUSE_S,
        flush_budget_s: float = FLUSH_BUDGET_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if pause_s < 0 or flush_budget_s < 0:
            raise ValueError(
                f"SpoolingWriter: pause_s ({pause_s}) and flush_budget_s ({flush_budget_s}) must be >= 0"
            )
        self.store = store
        self.spool = Spool(spool_dir)
        self.hooks = hooks
        self.pause_s, self.flush_budget_s, self._clock = pause_s, flush_budget_s, clock
        self._down_until = 0.0  # clock(): until then, spool without trying the store
        self.draining = False  # the store is back, the spool not flushed yet: spool behind it
        store.prepare_for_writes()  # before its owner's clock starts, not in its first batch

    # ---- the retry policy (class docstring) ----------------------------------------------------

    def paused(self) -> bool:
        """The store failed less than pause_s ago: writes spool without trying it."""
        return self._clock() < self._down_until

    def spilling(self) -> bool:
        """Writes go to the spool now (paused, or draining behind spooled batches)."""
        return self.draining or self.paused()

    def pause(self) -> None:
        """The store failed: spool for pause_s before trying it again."""
        self._down_until = self._clock() + self.pause_s
        self.draining = False

    def _resume(self) -> None:
        self._down_until = 0.0
        self.draining = False

    def retry(self, stop: Callable[[], bool] | None = None) -> FlushReport | None:
        """Try the store again (class docstring): a ping, then a flush of at most flush_budget_s
        that also stops after a file when ``stop()`` is true (its caller has other work). The
        flush's report, or None when the store did not answer (paused again). After a flush that
        stopped early the writer is draining. Raises what is not "unavailable" (a store that
        refuses rows), after pausing: the caller decides what to tell."""
        with self.spool.locked():
            return self._retry_locked(stop)

    def _retry_locked(self, stop: Callable[[], bool] | None = None) -> FlushReport | None:
        if not self.spool.pending_files():
            self._resume()
            return FlushReport()
        try:
            self.store.ping()
        except StoreUnavailable as exc:
            log.info("spool %s: the sample store is still unavailable (%s); spooling", self.spool.id, exc)
            self.pause()
            return None
        deadline = self._clock() + self.flush_budget_s

        def budget(done: int, files: int) -> None:
            # after a file is inserted and removed: stopping here leaves the rest as it was
            if done < files and (self._clock() >= deadline or (stop is not None and stop())):
                raise _FlushBudget

        report = FlushReport()
        try:
            self._flush_locked(report, budget)
        except _FlushBudget:
            self._down_until = 0.0
            self.draining = True
            metrics.SPOOL_FLUSHES.labels("ok").inc()
        except StoreUnavailable:
            self.pause()
            metrics.SPOOL_FLUSHES.labels("store_unavailable").inc()
            return None
        except Exception:
            self.pause()
            raise
        else:
            self._resume()
            metrics.SPOOL_FLUSHES.labels("ok").inc()
        finally:
            if report.files:
                self._report_pending_quietly()
            self._meter(report)
        if report.inserted or report.skipped_stored:
            log.info(
                "spool %s: flushed %d spooled samples (%d already stored)%s",
                self.spool.id,
                report.inserted,
                report.skipped_stored,
                "; more to flush" if self.draining else "",
            )
        return report

    # ---- writing -----------------------------------------------------------------------------

    def write(self, rows: Sequence[SampleRow] | Sequence[Mapping[str, Any]]) -> str:
        """Store a batch of rows (SampleRows, or mappings of every column), or spool it while
        the store is away or spooled batches wait (class docstring)."""
        # Validated once, here: never spool what the store would reject, and the store takes
        # the checked columns as they are.
        cols = validate_samples(rows, "SpoolingWriter.write")
        checked = list(rows)
        if not checked:
            return "stored"
        with self.spool.locked():
            if self.paused():
                self._append(checked)
                return "spooled"
            # 1. Older spooled batches go first, so the store sees samples in write order.
            if self.spool.pending_files() and (self._retry_locked() is None or self.draining):
                self._append(checked)
                return "spooled"
            # 2. Then this batch; a transient failure spools it (permanent errors propagate:
            # a row the store rejects would sit in the spool forever).
            try:
                self.store.insert_columns(cols)
                return "stored"
            except StoreUnavailable as e:
                self.pause()
                name = self._append(checked)
                log.warning("sample store unavailable, spooled %d rows to %s: %s", len(checked), name, e)
                return "spooled"

    def spill(self, rows: Sequence[SampleRow] | Sequence[Mapping[str, Any]]) -> str | None:
        """Spool a batch without trying the store first: for a writer that knows the store is
        down, or holds more than the store can take now (the live gateway's recorder, whose
        queue must drain at the disk's speed while the store is slow or away). Validated as in
        write(), counted by the hooks the same way, flushed later like any spooled batch.
        Returns the spool file's name (None for no rows)."""
        validate_samples(rows, "SpoolingWriter.spill")
        checked = list(rows)
        if not checked:
            return None
        with self.spool.locked():
            return self._append(checked)

    def _append(self, rows: Sequence[Any]) -> str:
        """Spool a batch (lock held), telling the hooks first: if they cannot hear it, nothing
        is spooled and the caller sees their error, so no host ever ends a run whose samples
        wait here uncounted."""
        rows = [SampleRow.of(r) for r in rows]
        if self.hooks is not None:
            counts = Counter(self.spool.rows_by_run())
            counts.update(_run_counts(rows))
            self.hooks.pending(self.spool.id, dict(counts))
        name = self.spool.append(rows)
        metrics.SPOOL_SPOOLED_ROWS.inc(len(rows))
        self._meter(None)
        return name

    def _meter(self, report: FlushReport | None) -> None:
        """abplat_spool_* (telemetry/metrics.py), lock held: what a flush did, and the depth."""
        if report is not None:
            metrics.SPOOL_FLUSHED_ROWS.inc(report.inserted)
            metrics.SPOOL_QUARANTINED_FILES.inc(len(report.quarantined))
            metrics.SPOOL_QUARANTINED_ROWS.inc(report.lost)
        rows, size = self.spool.depth()
        metrics.SPOOL_ROWS.set(rows)
        metrics.SPOOL_BYTES.set(size)

    def _report_pending_quietly(self) -> None:
        """Tell the hooks what is left after a flush (lock held). A failure only leaves the
        record counting rows that are stored by now (a finish step waits for nothing longer
        than the next flush, which tells them again): logged, never raised."""
        if self.hooks is None:
            return
        try:
            self.hooks.pending(self.spool.id, self.spool.rows_by_run())
        except Exception:
            log.exception(
                "spool %s: recording what it holds failed; the next flush tries again", self.spool.id
            )

    def flush(self, progress: Callable[[int, int], None] | None = None) -> FlushReport:
        """Drain the spool in sequence order. Raises StoreUnavailable (with the spool intact
        from the failing file on) if the store is still down. Tells the hooks what the spool
        holds afterwards, whatever happened (the periodic flush keeps the record true).
        ``progress(files_done, files)`` is called after each file (flush_samples draws it)."""
        report = FlushReport()
        with self.spool.locked():
            try:
                self._flush_locked(report, progress)
            except StoreUnavailable:
                self.pause()
                metrics.SPOOL_FLUSHES.labels("store_unavailable").inc()
                raise
            else:
                self._resume()
                metrics.SPOOL_FLUSHES.labels("ok").inc()
            finally:
                self._report_pending_quietly()
                self._meter(report)
        return report

    def _flush_locked(self, report: FlushReport, progress: Callable[[int, int], None] | None = None) -> None:
        files = self.spool.pending_files()
        for i, name in enumerate(files):
            _header, rows, complete = self.spool.read(name)
            try:
                if rows:
                    stored = self.store.existing_keys(row_key(r) for r in rows)
                    fresh = [r for r in rows if row_key(r) not in stored]
                    if fresh:
                        self.store.insert_samples(fresh)
                    report.inserted += len(fresh)
                    report.skipped_stored += len(rows) - len(fresh)
            except StoreUnavailable:
                report.remaining = len(files) - i
                raise
            if complete:
                self.spool.remove(name)
            else:
                report.quarantined.append(self._quarantine(name, rows))
                report.salvaged += len(rows)
                report.torn_files.append(report.quarantined[-1].path)
            report.files += 1
            if progress is not None:
                progress(i + 1, len(files))

    def _quarantine(self, name: str, rows: list[Any]) -> QuarantinedFile:
        """Move a file read() could not fully read to quarantine/, after telling the hooks the
        rows per run its header promised and the read did not give (torn, or written by another
        format or column schema): they are counted, never silently gone."""
        head = self.spool.header(name)
        read = _run_counts(rows)
        lost = {
            run: n - read.get(run, 0) for run, n in self.spool.claimed(name).items() if n > read.get(run, 0)
        }
        where = self.spool.quarantine_path(name)
        if lost and self.hooks is not None:
            self.hooks.quarantined(self.spool.id, where, lost)
        self.spool.move_to_quarantine(name)
        log.error(
            "unreadable spool file %s (header %s): flushed %d readable rows, lost %s (run: rows), kept it at %s",
            name,
            head,
            len(rows),
            lost or "nothing",
            where,
        )
        return QuarantinedFile(where, head, len(rows), lost)

    def pending(self, run_id: int | None = None) -> int:
        """Rows still spooled (for one run, or all). Torn files count in full: unknown is
        not durable."""
        total = 0
        with self.spool.locked():
            for name in self.spool.pending_files():
                header, rows, complete = self.spool.read(name)
                if run_id is None:
                    total += max(len(rows), 1 if not complete else 0)
                elif not complete and (header is None or run_id in header.get("runs", [])):
                    total += max(len(rows), 1)
                else:
                    total += sum(1 for r in rows if r["run_id"] == run_id)
        return total

    def durable(self, run_id: int) -> bool:
        """True when nothing of this run waits in the spool: every sample it wrote is stored."""
        return self.pending(run_id) == 0
