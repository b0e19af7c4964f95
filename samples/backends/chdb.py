"""The sample store in-process, through chDB (embedded ClickHouse): no server to run.

chDB 4.4 allows one data directory per process and one process per directory, and a child
forked after the session opened hangs: this module owns the process's one session (_ChdbOwner),
detects a directory locked by another process (StoreLocked, naming the holder's pid) and
refuses use after fork. release_chdb() closes the session (tests, shutdown).

A store written through a spooling writer is warm for writing (``prepare_for_writes``, once
per process): a sample batch goes in as an Arrow table, and the first conversion and the first
``Python(tbl)`` read load pyarrow's pandas layer and pandas itself (~0.5 s, holding every other
thread for 80-140 ms: a replay's event loop among them). The writer is made before a replay
sends, so that happens then, never in its sample sink's first insert mid-schedule
(bench/RESULTS.md, "The first step's lag spike"); processes that only read (the web app, a
report) never load them.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import re
import threading
import zoneinfo
from collections.abc import Callable
from typing import Any

import numpy as np

from samples import columns as colmod
from samples.file_lock import flock_held
from samples.store import (
    QuerySettings,
    QueryTimeout,
    SampleStore,
    StoreError,
    StoreLocked,
    check_ident,
    query_settings,
)


class _ChdbOwner:
    """The process's one chDB session. chDB 4.4 allows one data directory per process (a second
    path raises BAD_ARGUMENTS) and one process per directory (file lock); a child forked after
    the session opened hangs on its first query, so we refuse that loudly instead."""

    def __init__(self, path: str) -> None:
        from chdb import session

        self.path = path
        self.pid = os.getpid()
        self.lock = threading.RLock()  # one query at a time; also makes USE + query atomic
        self.current_db: str | None = None
        os.makedirs(path, exist_ok=True)
        # chDB reports a held lock only on stderr ("Cannot lock file .../status") and raises a
        # bare "Error initializing EmbeddedServer", so probe the same flock ourselves first.
        if _status_locked(path):
            raise StoreLocked(_lock_message(path))
        try:
            self.session = session.Session(path)
        except Exception as e:
            if _status_locked(path):
                raise StoreLocked(_lock_message(path)) from e
            raise StoreError(f"chDB could not open {path}: {e}") from e
        # Same clock as the server's config (timezone UTC), whatever the host's TZ.
        self.session.query("SET session_timezone = 'UTC'")


log = logging.getLogger(__name__)

_owner: _ChdbOwner | None = None
_owner_guard = threading.Lock()
_warm_guard = threading.Lock()
_warmed = False
# A value of each column kind (samples.columns) for the one-row batch prepare_for_writes
# converts: NULL where the column takes it, so every nullable path is exercised.
_WARM_VALUES: dict[str, Any] = {
    "str": "",
    "u8": 0,
    "u16": 0,
    "u32": 0,
    "u64": 0,
    "i64": 0,
    "datetime": 0,
    "f64": 0.0,
    "nf64": None,
    "nu64": None,
    "au32": (),
}


def _status_locked(path: str) -> bool:
    return flock_held(os.path.join(path, "status"))


def _lock_message(path: str) -> str:
    holder = ""
    try:  # ClickHouse writes "PID: n" into <path>/status while it holds the lock
        with open(os.path.join(path, "status")) as f:
            m = re.search(r"PID:\s*(\d+)", f.read())
        holder = f" (pid {m.group(1)})" if m else ""
    except OSError:
        pass
    return (
        f"chDB data directory {path} is locked by another process{holder}: chDB allows one "
        "process per directory. Stop that process (runserver, the gateway, a celery worker, a shell), "
        "read through it (`gateway --with-web` serves the dashboards), or set ABPLAT_CLICKHOUSE_URL to "
        "share a ClickHouse server between processes."
    )


def _chdb_owner(path: str) -> _ChdbOwner:
    global _owner
    path = os.path.realpath(path)
    with _owner_guard:
        if _owner is not None and _owner.pid != os.getpid():
            raise StoreError(
                f"chDB session for {_owner.path} was opened in pid {_owner.pid} and this is a "
                f"forked child (pid {os.getpid()}): chDB hangs after fork. Open the embedded "
                "store only in the process that uses it (run Celery eager or with --pool=solo "
                "/threads), or use a ClickHouse server (ABPLAT_CLICKHOUSE_URL)."
            )
        if _owner is None:
            _owner = _ChdbOwner(path)
        elif _owner.path != path:
            raise StoreError(
                f"chDB already has {_owner.path} open in this process and allows one data "
                f"directory per process; cannot also open {path}"
            )
        return _owner


def release_chdb() -> None:
    """Close this process's chDB session (tests, shutdown, before an intentional fork)."""
    global _owner
    with _owner_guard:
        if _owner is not None and _owner.pid == os.getpid():
            with _owner.lock:
                _owner.session.close()
        _owner = None


def _parse_datetime(text: str, tz: dt.tzinfo) -> dt.datetime:
    return dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S").replace(tzinfo=tz).astimezone(dt.UTC)


def _json_converter(ch_type: str) -> Callable[[Any], Any]:
    t = ch_type
    for wrapper in ("LowCardinality(", "Nullable("):
        if t.startswith(wrapper):
            t = t[len(wrapper) : -1]
    if t.startswith("Array("):
        inner = _json_converter(t[len("Array(") : -1])
        return lambda v: None if v is None else [inner(x) for x in v]
    if re.match(r"^U?Int\d+$", t):
        return lambda v: None if v is None else int(v)
    if t.startswith("Float"):
        return lambda v: None if v is None else float(v)
    if t == "DateTime" or t.startswith("DateTime("):
        m = re.match(r"^DateTime\('([^']+)'\)$", t)
        tz: dt.tzinfo = zoneinfo.ZoneInfo(m.group(1)) if m else dt.UTC
        return lambda v: None if v is None else _parse_datetime(v, tz)
    if t == "Date":
        return lambda v: None if v is None else dt.date.fromisoformat(v)
    return lambda v: v


class ChdbBackend(SampleStore):
    backend_name = "chdb"

    def __init__(self, path: str, database: str = "abplat") -> None:
        self.path = os.path.realpath(path)
        self.database = check_ident(database, "chDB database")
        _chdb_owner(self.path)  # fail now, not at the first query, if the path is unusable
        self.ensure_database()

    def prepare_for_writes(self) -> None:
        """Load what this process's first sample insert would load (module docstring): convert
        a one-row batch of every samples column to Arrow and read it through ``Python(tbl)``,
        as an insert does, without writing anything. Once per process. A failure costs only the
        warm-up (the writer works all the same; an insert that fails the same way says so)."""
        global _warmed
        with _warm_guard:
            if _warmed:
                return
            owner = _chdb_owner(self.path)
            try:
                one = colmod.validate_columns(
                    {c.name: [_WARM_VALUES[c.kind]] for c in colmod.COLUMNS}, "warm-up"
                )
                tbl = _to_arrow(one)  # noqa: F841 - read by name by chDB's Python(tbl)
                with owner.lock:
                    owner.session.query("SELECT count() FROM Python(tbl)", "CSV")
            except Exception:
                log.warning("%s: warming the Arrow insert path failed", self.describe(), exc_info=True)
                return
            _warmed = True

    def describe(self) -> str:
        return f"{self.backend_name} {self.path} database {self.database}"

    def _session_query(self, sql: str, fmt: str, use_db: bool = True) -> Any:
        owner = _chdb_owner(self.path)
        with owner.lock:
            try:
                # The session is shared by every ChdbBackend of this process: switch database
                # under the lock so USE and the query are atomic.
                if use_db and owner.current_db != self.database:
                    owner.session.query(f"USE {self.database}")
                    owner.current_db = self.database
                return owner.session.query(sql, fmt)
            except Exception as e:
                raise StoreError(f"{self.describe()}: {e}") from e

    def ensure_database(self) -> None:
        sql = f"CREATE DATABASE IF NOT EXISTS {self.database}"
        self._session_query(sql, fmt="CSV", use_db=False)

    def _command(self, sql: str) -> None:
        self._session_query(sql, fmt="CSV")

    def _select(
        self, sql: str, settings: QuerySettings | None = None
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        chosen = query_settings(settings)
        if chosen:
            res = self._select_with(sql, chosen)
        else:
            res = self._session_query(sql, fmt="JSONCompact")
        raw = res.bytes()
        if not raw.strip():
            return [], []
        doc = json.loads(raw)
        meta = doc["meta"]
        convs = [_json_converter(m["type"]) for m in meta]
        names = [m["name"] for m in meta]
        rows = [tuple(conv(v) for conv, v in zip(convs, r, strict=True)) for r in doc["data"]]
        return names, rows

    def _select_with(self, sql: str, chosen: dict[str, int]) -> Any:
        """The query with session settings set for it alone: SET before, back to DEFAULT after,
        under the session lock (the session is shared by every thread of the process)."""
        owner = _chdb_owner(self.path)
        with owner.lock:
            try:
                for name, value in chosen.items():
                    self._session_query(f"SET {name} = {value}", fmt="CSV", use_db=False)
                return self._session_query(sql, fmt="JSONCompact")
            except StoreError as e:
                if "max_execution_time" in chosen and "TIMEOUT_EXCEEDED" in str(e):
                    raise QueryTimeout(
                        f"{self.describe()}: query stopped after max_execution_time = "
                        f"{chosen['max_execution_time']} s"
                    ) from e
                raise
            finally:
                for name in chosen:
                    self._session_query(f"SET {name} = DEFAULT", fmt="CSV", use_db=False)

    def _insert_columns(self, table: str, cols: dict[str, np.ndarray]) -> None:
        tbl = _to_arrow(cols)  # noqa: F841 - read by name by chDB's Python(tbl)
        names = ", ".join(cols)
        # Arrow in, columnar all the way: chDB's fastest insert path (bench/bench_insert.py).
        owner = _chdb_owner(self.path)
        with owner.lock:
            try:
                if owner.current_db != self.database:
                    owner.session.query(f"USE {self.database}")
                    owner.current_db = self.database
                # chDB's Python(tbl) resolves `tbl` among this frame's locals.
                owner.session.query(f"INSERT INTO {table} ({names}) SELECT {names} FROM Python(tbl)")
            except Exception as e:
                raise StoreError(f"{self.describe()}: insert into {table} failed: {e}") from e


def _to_arrow(cols: dict[str, np.ndarray]) -> Any:
    """Validated columns -> an Arrow table; NaN in a nullable float column becomes NULL."""
    import pyarrow as pa

    types = {
        "str": pa.string(),
        "u8": pa.uint8(),
        "u16": pa.uint16(),
        "u32": pa.uint32(),
        "u64": pa.uint64(),
        "i64": pa.int64(),
        "f64": pa.float64(),
        "nf64": pa.float64(),
        "nu64": pa.uint64(),
        "datetime": pa.uint32(),  # unix seconds; INSERT ... SELECT casts to DateTime('UTC')
    }
    out = {}
    for name, arr in cols.items():
        kind = colmod.BY_NAME[name].kind
        if kind == "au32":  # an object array of uint32 arrays: offsets and the values, no copy per row
            parts = arr.tolist()
            offsets = np.zeros(len(parts) + 1, dtype=np.int64)
            np.cumsum(np.fromiter(map(len, parts), dtype=np.int64, count=len(parts)), out=offsets[1:])
            values = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)
            out[name] = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa.uint32()))
            continue
        out[name] = pa.array(arr, type=types[kind], from_pandas=kind == "nf64")
    return pa.table(out)
