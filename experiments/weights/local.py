"""The embedded default weights store: one file per experiment under a directory.

Layout::

    DIR/.lock            flock(2) taken for every write: the compare-and-set critical section
    DIR/.revision        the store-wide revision counter (text)
    DIR/<key>.json       {"revision": N, "value": "<the document's JSON text>"}

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

    def _read_entry(self, key: str) -> StoredValue | None:
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        return _decode_entry(key, data, self._read_counter())

    # WeightsStore ----------------------------------------------------------------------

    def get_raw(self, key: str) -> StoredValue | None:
        check_key(key)
        return self._read_entry(key)

    def list_raw(self) -> Listing:
        # Read the counter first: every entry scanned after it is at least that new.
        counter = self._read_counter()
        values = self._scan(counter)
        top = max((v.revision for v in values.values()), default=0)
        return Listing(values=values, revision=max(counter, top))

    def _scan(self, counter: int) -> dict[str, StoredValue]:
        values: dict[str, StoredValue] = {}
        for name in sorted(os.listdir(self.directory)):
            if name.startswith(".") or not name.endswith(".json"):
                continue
            key = name[: -len(".json")]
            try:
                data = (self.directory / name).read_bytes()
            except FileNotFoundError:
                continue  # deleted between listdir and read
            values[key] = _decode_entry(key, data, counter)
        return values

    def put_raw(self, key: str, raw: bytes, expected_revision: int) -> int:
        check_key(key)
        with self._locked():
            current = self._read_entry(key)
            actual = current.revision if current is not None else 0
            if actual != expected_revision:
                raise ConflictError(key, expected_revision, actual)
            revision = max(self._read_counter(), actual) + 1
            envelope = {
                "revision": revision,
                "value": raw.decode("utf-8", errors="surrogateescape"),
            }
            # Entry first, counter second: a watcher that sees the new counter finds the entry.
            self._write_atomic(self._path(key), json.dumps(envelope).encode())
            self._write_atomic(self.directory / ".revision", str(revision).encode())
            return revision

    def delete(self, key: str) -> int:
        check_key(key)
        with self._locked():
            revision = self._read_counter() + 1
            with contextlib.suppress(FileNotFoundError):
                self._path(key).unlink()
            self._write_atomic(self.directory / ".revision", str(revision).encode())
            return revision

    def watch(self, start_revision: int, stop: threading.Event) -> Iterator[list[WatchEvent]]:
        known: dict[str, int] | None = None
        last_counter = -1
        last_yield = time.monotonic()
        while not stop.is_set():
            counter = self._read_counter()
            events: list[WatchEvent] = []
            if counter != last_counter:
                values = self._scan(counter)
                if known is None:
                    events = [
                        WatchEvent(k, v.raw, v.revision)
                        for k, v in values.items()
                        if v.revision >= start_revision
                    ]
                else:
                    events = [
                        WatchEvent(k, v.raw, v.revision)
                        for k, v in values.items()
                        if known.get(k) != v.revision
                    ]
                    events += [WatchEvent(k, None, counter) for k in known if k not in values]
                known = {k: v.revision for k, v in values.items()}
                last_counter = counter
            now = time.monotonic()
            if events or now - last_yield >= IDLE_TICK_S:
                last_yield = now
                yield sorted(events, key=lambda e: e.revision)
            stop.wait(self.poll_interval)


def _decode_entry(key: str, data: bytes, counter: int) -> StoredValue:
    try:
        envelope = json.loads(data)
        revision = envelope["revision"]
        value = envelope["value"]
        if isinstance(revision, bool) or not isinstance(revision, int) or revision <= 0:
            raise TypeError("revision")
        if not isinstance(value, str):
            raise TypeError("value")
        return StoredValue(key, value.encode("utf-8", errors="surrogateescape"), revision)
    except (ValueError, KeyError, TypeError):
        # A file edited by hand into something else: hand its bytes on as the document so the
        # router rejects it with a reason (and keeps the previous one), at the current counter.
        log.warning("local weights store: %s.json is not a store entry", key)
        return StoredValue(key, data, max(counter, 1))
