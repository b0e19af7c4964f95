"""The embedded default weights store: one file per experiment under a directory.

Layout::

    DIR/.lock            flock(2) taken for every write: the compare-and-set critical section
    DIR/.revision        the store-wide revision counter (text)
    DIR/<key>.json       {"revision": N, "value": "<the document's JSON text>"}, or
                         {"revision": N, "value": null} once deleted (a tombstone)

Writes go to a temp file in DIR, are fsync'ed and renamed over the target, so a reader sees the
old or the new file, never half of one. Watchers poll ``.revision`` (one small read per tick) and
rescan the directory when it moves: no inotify, works on any filesystem.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from experiments.weights.errors import ConflictError, StoreUnavailable
from experiments.weights.store import (
    Listing,
    StoredValue,
    WatchEvent,
    WeightsStore,
    check_key,
)

log = logging.getLogger(__name__)

LOCK_TIMEOUT_S = 5.0
IDLE_TICK_S = 0.5


class LocalWeightsStore(WeightsStore):
    def __init__(self, directory: str | os.PathLike[str], poll_interval: float = 0.02):
        self.directory = Path(directory)
        self.poll_interval = poll_interval
        self.description = f"local weights store {self.directory}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnavailable(f"{self.description}: cannot create directory: {exc}") from exc

    # Files -----------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        # flock is per open file description: it excludes other processes and other threads of
        # this one alike, and the kernel drops it if the holder dies.
        fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            deadline = time.monotonic() + LOCK_TIMEOUT_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise StoreUnavailable(
                            f"{self.description}: write lock held for over {LOCK_TIMEOUT_S} s"
                        ) from None
                    time.sleep(0.001)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _write_atomic(self, path: Path, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def _read_counter(self) -> int:
        try:
            return int((self.directory / ".revision").read_bytes() or b"0")
        except FileNotFoundError:
            return 0

    def _read_entry(self, key: str) -> WatchEvent | None:
        """The key's record: raw None for a tombstone; None when there is no file at all."""
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        return _decode_entry(key, data, self._read_counter())

    def _scan(self, counter: int) -> dict[str, WatchEvent]:
        records: dict[str, WatchEvent] = {}
        for name in sorted(os.listdir(self.directory)):
            if name.startswith(".") or not name.endswith(".json"):
                continue
            key = name[: -len(".json")]
            try:
                data = (self.directory / name).read_bytes()
            except FileNotFoundError:
                continue  # removed between listdir and read
            records[key] = _decode_entry(key, data, counter)
        return records

    # WeightsStore ----------------------------------------------------------------------

    def get_raw(self, key: str) -> StoredValue | None:
        check_key(key)
        record = self._read_entry(key)
        if record is None or record.raw is None:
            return None
        return StoredValue(key, record.raw, record.revision)

    def list_raw(self) -> Listing:
        # Read the counter first: every entry scanned after it is at least that new.
        counter = self._read_counter()
        records = self._scan(counter)
        values = {k: StoredValue(k, r.raw, r.revision) for k, r in records.items() if r.raw is not None}
        top = max((r.revision for r in records.values()), default=0)
        return Listing(values=values, revision=max(counter, top))

    def _write(self, key: str, raw: bytes | None, expected_revision: int | None) -> int:
        check_key(key)
        with self._locked():
            current = self._read_entry(key)
            actual = current.revision if current is not None and current.raw is not None else 0
            if expected_revision is not None and actual != expected_revision:
                raise ConflictError(key, expected_revision, actual)
            revision = max(self._read_counter(), current.revision if current else 0) + 1
            value = raw.decode("utf-8", errors="surrogateescape") if raw is not None else None
            envelope = {"revision": revision, "value": value}
            # Entry first, counter second: a watcher that sees the new counter finds the entry.
            self._write_atomic(self._path(key), json.dumps(envelope).encode())
            self._write_atomic(self.directory / ".revision", str(revision).encode())
            return revision

    def put_raw(self, key: str, raw: bytes, expected_revision: int) -> int:
        return self._write(key, raw, expected_revision)

    def delete(self, key: str) -> int:
        # A tombstone ({"value": null}) rather than an unlink: a watcher that starts after the
        # delete still learns of it from the revision, as it would from etcd's history.
        return self._write(key, None, None)

    def watch(self, start_revision: int, stop: threading.Event) -> Iterator[list[WatchEvent]]:
        known: dict[str, int] | None = None
        last_counter = -1
        last_yield = time.monotonic()
        first = True  # the first scan is always yielded: "the watch is registered"
        while not stop.is_set():
            counter = self._read_counter()
            events: list[WatchEvent] = []
            if counter != last_counter:
                records = self._scan(counter)
                if known is None:
                    events = [r for r in records.values() if r.revision >= start_revision]
                else:
                    events = [r for k, r in records.items() if known.get(k) != r.revision]
                    # a file removed by hand rather than through delete()
                    events += [WatchEvent(k, None, counter) for k in known if k not in records]
                known = {k: r.revision for k, r in records.items()}
                last_counter = counter
            now = time.monotonic()
            if events or first or now - last_yield >= IDLE_TICK_S:
                first = False
                last_yield = now
                yield sorted(events, key=lambda e: e.revision)
            stop.wait(self.poll_interval)


def _decode_entry(key: str, data: bytes, counter: int) -> WatchEvent:
    try:
        envelope = json.loads(data)
        revision = envelope["revision"]
        value = envelope["value"]
        if isinstance(revision, bool) or not isinstance(revision, int) or revision <= 0:
            raise TypeError("revision")
        if value is None:
            return WatchEvent(key, None, revision)  # tombstone
        if not isinstance(value, str):
            raise TypeError("value")
        return WatchEvent(key, value.encode("utf-8", errors="surrogateescape"), revision)
    except (ValueError, KeyError, TypeError):
        # A file edited by hand into something else: hand its bytes on as the document so the
        # router rejects it with a reason (and keeps the previous one), at the current counter.
        log.warning("local weights store: %s.json is not a store entry", key)
        return WatchEvent(key, data, max(counter, 1))
