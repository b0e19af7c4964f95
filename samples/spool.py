"""A local, append-only spool for samples the store could not take, flushed in order later.

Layout of the spool directory (ABPLAT_SPOOL_DIR):
  000000000001.jsonl   one file per spooled batch, numbered in write order. Line 1 is a header
                       {"spool": 2, "seq": n, "rows": N, "runs": [...]}, then N rows, each a
                       JSON array of its values in column order (samples.columns.SampleRow).
                       Format 1 files (one JSON object per row) are still read and flushed.
  spool.lock           flock'ed by whoever writes or flushes, so several processes on one host
                       can share a directory without interleaving sequence numbers.
  quarantine/          torn files, kept for a human after whatever was readable was flushed.

Durability: a batch is written to `<seq>.jsonl.tmp`, fsync'ed, renamed, and the directory
fsync'ed before write() returns "spooled". A crash before the rename leaves a `.tmp`; a crash
(or a filesystem that reorders writes) can also leave a `.jsonl` shorter than its header says.
Both are "torn": flush() inserts every complete, valid row it can read from them, moves the file
to quarantine/ and reports it. Nothing is dropped silently.

No duplicates: before inserting a spooled batch, flush() drops the rows whose key is already
stored (the insert may have landed before it "failed", or a crash may have hit between insert and
unlink), and the table's ReplacingMergeTree + FINAL hides any copy that still slips through.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from samples.columns import COLUMN_NAMES, SampleError, SampleRow, row_key, validate_samples
from samples.store import SampleStore, StoreUnavailable

log = logging.getLogger(__name__)

SPOOL_FORMAT = 2  # rows as JSON arrays in column order
_READABLE_FORMATS = (1, 2)  # 1: rows as JSON objects (written before format 2)
_NAME = re.compile(r"^(\d{12})\.jsonl(\.tmp)?$")


@dataclasses.dataclass
class FlushReport:
    files: int = 0  # spool files fully handled (inserted or found already stored)
    inserted: int = 0  # rows inserted by this flush
    skipped_stored: int = 0  # rows dropped because the store already had them
    torn_files: list[str] = dataclasses.field(default_factory=list)  # now in quarantine/
    salvaged: int = 0  # rows read from torn files (counted in inserted/skipped_stored too)
    remaining: int = 0  # files still spooled (the store went away again)


class Spool:
    """The directory itself: numbered batch files, written durably."""

    def __init__(self, directory: str) -> None:
        if not directory:
            raise ValueError("spool directory must be set (ABPLAT_SPOOL_DIR)")
        self.dir = os.path.abspath(directory)
        self.quarantine = os.path.join(self.dir, "quarantine")
        os.makedirs(self.quarantine, exist_ok=True)

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
        header = {
            "spool": SPOOL_FORMAT,
            "seq": seq,
            "rows": len(rows),
            "runs": sorted({int(r["run_id"]) for r in rows}),
        }
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(header) + "\n")
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False, allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.dir, name))
        self._fsync_dir()
        return name

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, name: str) -> tuple[dict[str, Any] | None, list[Any], bool]:
        """(header, rows, complete): rows are SampleRows (format 2) or dicts (format 1). Stops at
        the first unreadable line; never raises on bad content, because a torn file must still
        give up what it holds."""
        header: dict[str, Any] | None = None
        rows: list[Any] = []
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
                continue
            if header["spool"] == 1 and isinstance(obj, dict):
                rows.append(obj)
            elif header["spool"] == 2 and isinstance(obj, list) and len(obj) == len(COLUMN_NAMES):
                rows.append(SampleRow(obj))
            else:
                break
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

    def pending_files(self) -> list[str]:
        return [name for _s, name, _t in self._entries()]

    def remove(self, name: str) -> None:
        os.unlink(os.path.join(self.dir, name))
        self._fsync_dir()

    def move_to_quarantine(self, name: str) -> str:
        target = name if name.endswith(".tmp") else name + ".torn"
        os.replace(os.path.join(self.dir, name), os.path.join(self.quarantine, target))
        self._fsync_dir()
        return os.path.join(self.quarantine, target)


class SpoolingWriter:
    """Writes samples to the store, or to the spool when the store is down; never loses one.

    write(rows) -> "stored" | "spooled". Call flush() when the store may be back (write() also
    tries it first, to keep samples in order), and durable(run_id) before a run reports done.
    """

    def __init__(self, store: SampleStore, spool_dir: str) -> None:
        self.store = store
        self.spool = Spool(spool_dir)

    def write(self, rows: Sequence[SampleRow] | Sequence[Mapping[str, Any]]) -> str:
        """Store a batch of rows (SampleRows, or mappings of every column)."""
        # Validated once, here: never spool what the store would reject, and the store takes
        # the checked columns as they are.
        cols = validate_samples(rows, "SpoolingWriter.write")
        checked = list(rows)
        if not checked:
            return "stored"
        with self.spool.locked():
            # 1. Older spooled batches go first, so the store sees samples in write order.
            if self.spool.pending_files():
                try:
                    self._flush_locked(FlushReport())
                except StoreUnavailable:
                    self.spool.append(checked)
                    return "spooled"
            # 2. Then this batch; a transient failure spools it (permanent errors propagate:
            # a row the store rejects would sit in the spool forever).
            try:
                self.store.insert_columns(cols)
                return "stored"
            except StoreUnavailable as e:
                name = self.spool.append(checked)
                log.warning("sample store unavailable, spooled %d rows to %s: %s", len(checked), name, e)
                return "spooled"

    def flush(self) -> FlushReport:
        """Drain the spool in sequence order. Raises StoreUnavailable (with the spool intact
        from the failing file on) if the store is still down."""
        report = FlushReport()
        with self.spool.locked():
            self._flush_locked(report)
        return report

    def _flush_locked(self, report: FlushReport) -> None:
        files = self.spool.pending_files()
        for i, name in enumerate(files):
            header, rows, complete = self.spool.read(name)
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
                report.salvaged += len(rows)
                where = self.spool.move_to_quarantine(name)
                report.torn_files.append(where)
                log.error(
                    "torn spool file %s (header %s): flushed %d readable rows, kept it at %s",
                    name,
                    header,
                    len(rows),
                    where,
                )
            report.files += 1

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
