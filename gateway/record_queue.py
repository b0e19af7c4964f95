"""The live recording's queue files: what a gateway process hands to its host's recorder.

Pure: the standard library only (no Django, no store). One file per gateway run, in
``<spool dir>/live-queue/``, written by the gateway process and read by the recorder process
(gateway.recorder_process); both sides are here so the format has one definition.

Layout of live-queue/:
  <run_id>.queue   one gateway run's records, appended by its process. Each record is a 4-byte
                   little-endian length, then a marshal'ed plain tuple (marshal: the cheapest
                   serialization CPython has, and it reads back only plain values):
                     (HEADER, FORMAT, result field names, worker, pid, host)   the first record
                     (SAMPLE, recorded_ms, outcome, result values, experiment, variant, user_id,
                      config_revision, sent_unix_ms, request_id, prompt_tokens, max_tokens,
                      gateway_ms, attempt)                                     one per request
                     (SHADOW, recorded_ms, {column: value})   one per shadow of a request to
                                                              the control (gateway/shadow.py): a
                                                              fidelity_shadows row but recorded_ms
                     (CLOSED, appended, dropped, rejected)                     at a clean close
                   The writer holds an flock on it for its life: a file whose lock is free has
                   no writer (closed, or its process is gone).
  <run_id>.queue.tmp  a file being created (its header not written yet): never read.
  <run_id>.state   the recorder's read state of the queue file (JSON, replaced atomically and
                   fsync'ed): the offset up to which every record is durable (stored or spooled),
                   the seq of the last row there, the run_ids its rows went to, the counts.
  recorder.lock    flock'ed by the host's one recorder; holds its pid.
  recorder.running written by a recorder when it starts, removed when it stops cleanly: a
                   start that finds it re-reads the tails as possibly stored already.

Why an append with one os.write: a write that returned is in the page cache, and survives a
SIGKILL of its process (not a power loss: the host's crash takes the page cache); the gateway
calls it on its event loop at the end of each request, before the client sees that end.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import marshal
import operator
import os
import re
import socket
import struct
from collections import Counter
from typing import Any

from samples.file_lock import flock_held
from streaming.result import Outcome, StreamResult

FORMAT = 1
HEADER, SAMPLE, CLOSED, SHADOW = 0, 1, 2, 3  # a recorder that does not know a kind skips it
QUEUE_DIR = "live-queue"
LOCK_FILE = "recorder.lock"
RUNNING_FILE = "recorder.running"
_LEN = struct.Struct("<I")
_QUEUE = re.compile(r"^(\d+)\.queue$")
_TMP = re.compile(r"^(\d+)\.queue\.tmp$")
_STATE = re.compile(r"^(\d+)\.state$")
READ_CHUNK = 1 << 20

# A StreamResult as marshal can take it: its outcome's value apart (an enum is not a plain
# value), the other fields by name (the header names them, so a recorder of another version
# still reads the file).
RESULT_FIELDS = tuple(f for f in StreamResult.__slots__ if f != "outcome")  # type: ignore[attr-defined]
_RESULT_VALUES = operator.attrgetter(*RESULT_FIELDS)


def queue_dir(spool_dir: str) -> str:
    return os.path.join(os.path.abspath(spool_dir), QUEUE_DIR)


def queue_path(directory: str, run_id: int) -> str:
    return os.path.join(directory, f"{run_id}.queue")


def state_path(directory: str, run_id: int) -> str:
    return os.path.join(directory, f"{run_id}.state")


# ---- the gateway's side ----------------------------------------------------------------------


class QueueWriter:
    """Appends one gateway run's records to its queue file; holds the file's flock while open.
    ``append`` is the request path's whole cost of recording: a marshal and an os.write."""

    def __init__(self, directory: str, run_id: int, worker: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.run_id = run_id
        self.path = queue_path(directory, run_id)
        tmp = self.path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            header = (HEADER, FORMAT, RESULT_FIELDS, worker, os.getpid(), socket.gethostname())
            _write_all(fd, _frame(header))
            # named only once locked and headed: a reader never sees it without its writer
            os.replace(tmp, self.path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self.fd: int | None = fd
        self.appended = 0  # samples written
        self.dropped = 0  # samples whose write failed (the disk full or failing), or after close
        self.rejected = 0  # measurements marshal could not take (a caller's bug)
        self.shadows: Counter[str] = (
            Counter()
        )  # shadow records: "appended", "dropped", "rejected" (not samples)

    def append(self, sample: tuple) -> bool:
        """One sample tuple (sample_record). False when it was not written (counted)."""
        how = self._write(sample)
        if how == "appended":
            self.appended += 1
        elif how == "dropped":
            self.dropped += 1
        else:
            self.rejected += 1
        return how == "appended"

    def append_shadow(self, recorded_ms: float, row: dict) -> bool:
        """One SHADOW record (module docstring); counted apart from the samples."""
        how = self._write((SHADOW, recorded_ms, row))
        self.shadows[how] += 1
        return how == "appended"

    def _write(self, record: tuple) -> str:
        """One record: "appended", "dropped" (not written) or "rejected" (marshal refused it)."""
        if self.fd is None:
            return "dropped"
        try:
            data = marshal.dumps(record)
        except ValueError:
            return "rejected"
        buf = _LEN.pack(len(data)) + data
        try:
            written = os.write(self.fd, buf)
        except OSError:
            return "dropped"
        if written != len(buf):  # the disk filled mid-record: the rest, or the file is torn
            try:
                _write_all(self.fd, buf[written:])
            except OSError:
                self.close_fd()  # a torn record ends what a reader can read: write nothing after it
                return "dropped"
        return "appended"

    def close(self) -> bool:
        """Write the closing record (the writer's counts) and release the file. False if that
        record could not be written (the recorder then closes the run as of what it read)."""
        if self.fd is None:
            return False
        ok = True
        try:
            _write_all(self.fd, _frame((CLOSED, self.appended, self.dropped, self.rejected)))
        except OSError:
            ok = False
        self.close_fd()
        return ok

    def close_fd(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the flock
            self.fd = None


def sample_record(
    recorded_ms: float,
    result: StreamResult,
    experiment: Any,
    variant: Any,
    user_id: Any,
    config_revision: Any,
    sent_unix_ms: Any,
    request_id: Any,
    prompt_tokens: Any,
    max_tokens: Any,
    gateway_ms: Any,
    attempt: Any,
) -> tuple:
    """The SAMPLE record of one request (module docstring)."""
    return (
        SAMPLE,
        recorded_ms,
        result.outcome.value,
        _RESULT_VALUES(result),
        experiment,
        variant,
        user_id,
        config_revision,
        sent_unix_ms,
        request_id,
        prompt_tokens,
        max_tokens,
        gateway_ms,
        attempt,
    )


def _frame(obj: tuple) -> bytes:
    data = marshal.dumps(obj)
    return _LEN.pack(len(data)) + data


def _write_all(fd: int, buf: bytes) -> None:
    view = memoryview(buf)
    while view:
        view = view[os.write(fd, view) :]


# ---- the recorder's side ---------------------------------------------------------------------


class Torn(ValueError):
    """Bytes of a queue file that are not a record (a write cut by a crash of the host)."""


def read_records(path: str, offset: int, limit: int) -> tuple[list[tuple[tuple, int]], int, bool]:
    """Up to ``limit`` whole records from ``offset``: ([(record, end offset)], where the next
    record starts, whether bytes after it are an incomplete record (being written, or torn)).
    A record marshal cannot read raises Torn naming the offset."""
    out: list[tuple[tuple, int]] = []
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(READ_CHUNK)
        at = 0
        while len(out) < limit and len(data) - at >= _LEN.size:
            (n,) = _LEN.unpack_from(data, at)
            if len(data) - at - _LEN.size < n:
                if at == 0 and len(data) == READ_CHUNK:  # one record larger than a chunk
                    data += f.read(n + _LEN.size - len(data))
                    if len(data) - _LEN.size >= n:
                        continue
                break
            start = at + _LEN.size
            try:
                record = marshal.loads(data[start : start + n])
            except (EOFError, ValueError, TypeError) as exc:
                raise Torn(f"{path}: no record at offset {offset + at} ({exc})") from None
            if not isinstance(record, tuple) or not record:
                raise Torn(f"{path}: offset {offset + at} holds {type(record).__name__}, not a record")
            at = start + n
            out.append((record, offset + at))
        partial = len(out) < limit and len(data) > at
    return out, offset + at, partial


def result_from(header: tuple, record: tuple) -> StreamResult:
    """The StreamResult of a SAMPLE record, by the field names of its file's header."""
    values = dict(zip(header[2], record[3], strict=True))
    known = {k: v for k, v in values.items() if k in StreamResult.__slots__}  # type: ignore[attr-defined]
    return StreamResult(outcome=Outcome(record[2]), **known)


def writer_alive(path: str) -> bool:
    """Someone holds the file's flock (its writer). A missing file has none."""
    return flock_held(path)


def queue_files(directory: str) -> tuple[list[int], list[int], list[int]]:
    """(run_ids of queue files, of files being created, of state files), sorted."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return [], [], []
    found: tuple[list[int], list[int], list[int]] = ([], [], [])
    for name in names:
        for kind, pattern in enumerate((_QUEUE, _TMP, _STATE)):
            m = pattern.match(name)
            if m:
                found[kind].append(int(m.group(1)))
    return sorted(found[0]), sorted(found[1]), sorted(found[2])


def read_state(directory: str, run_id: int) -> dict[str, Any] | None:
    try:
        with open(state_path(directory, run_id), encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def write_state(directory: str, run_id: int, state: dict[str, Any]) -> None:
    """Replace the state file durably: written, fsync'ed, renamed, the directory fsync'ed."""
    path = state_path(directory, run_id)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(directory)


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def try_lock(directory: str) -> int | None:
    """Take the host's recorder lock (writing this pid in it): its fd, or None if held."""
    os.makedirs(directory, exist_ok=True)
    fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def recorder_running(directory: str) -> bool:
    """A recorder holds the host's lock."""
    return writer_alive(os.path.join(directory, LOCK_FILE))


def recorder_pid(directory: str) -> int | None:
    try:
        with open(os.path.join(directory, LOCK_FILE), encoding="utf-8") as f:
            return int(f.read().strip() or 0) or None
    except (FileNotFoundError, ValueError):
        return None
