"""The one wrapper around the sample store: a ClickHouse server or chDB in-process, same SQL.

Both backends share everything above three hooks (_command, _select, _insert_columns):
migrations, parameter binding (samples.sql), deduplicated reads and value normalization, so a
query returns the same Python values on either (DateTime -> aware UTC datetime, UInt64 -> int,
Nullable -> None, UUID -> str).

Errors: StoreUnavailable is transient (the caller spools and retries later); every other
StoreError is permanent and is raised at once.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import threading
import time
import urllib.parse
import uuid
import zoneinfo
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from samples import columns as colmod
from samples import schema
from samples.sql import bind

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class StoreError(Exception):
    """Permanent failure: bad SQL, bad data, schema trouble. Retrying will not help."""


class StoreUnavailable(StoreError):
    """Transient failure (server down, network, timeout): spool the samples and retry later."""


class StoreLocked(StoreError):
    """chDB's data directory is owned by another process."""


class SchemaMismatch(StoreError):
    """An applied migration differs from the code's migration of the same version."""


def _validate_columns(cols: Mapping[str, Any]) -> dict[str, Any]:
    """insert_columns' checks, a column at a time; returns the columns in table order, nullable
    ones as object arrays holding None (the shape both backends' insert hooks take)."""
    import numpy as np

    if not isinstance(cols, Mapping):
        raise StoreError(f"insert_columns: expected a mapping of column -> values, got {type(cols).__name__}")
    extra = sorted(set(cols) - set(colmod.COLUMN_NAMES))
    missing = [n for n in colmod.COLUMN_NAMES if n not in cols]
    if extra or missing:
        raise StoreError(f"insert_columns: unknown column(s) {extra}, missing column(s) {missing}")
    lengths = {n: len(cols[n]) for n in colmod.COLUMN_NAMES}
    if len(set(lengths.values())) > 1:
        raise StoreError(f"insert_columns: columns differ in length: {lengths}")
    out: dict[str, Any] = {}
    for name in colmod.COLUMN_NAMES:
        col = colmod.BY_NAME[name]
        raw = cols[name]
        arr = raw if isinstance(raw, np.ndarray) else np.asarray(raw, dtype=object)

        def bad(i: Any, why: str, col: Any = col, arr: Any = arr) -> StoreError:
            i = int(i)
            return StoreError(f"insert_columns: column {col.name} ({col.ch_type}) row {i}: {arr[i]!r} {why}")

        if col.kind == "str":
            if arr.dtype != object:
                arr = arr.astype(object)
            if not set(map(type, arr)) <= {str}:
                raise bad(next(i for i, v in enumerate(arr) if type(v) is not str), "is not a str")
        elif col.kind in ("f64", "nf64"):
            if arr.dtype == object:
                if not set(map(type, arr)) <= (
                    {float, int, type(None)} if col.kind == "nf64" else {float, int}
                ):
                    i = next(
                        i
                        for i, v in enumerate(arr)
                        if type(v) not in (float, int, type(None)) or (v is None and col.kind == "f64")
                    )
                    raise bad(i, "is not a number" + (" or None" if col.kind == "nf64" else ""))
                arr = (
                    np.array([np.nan if v is None else v for v in arr], dtype=np.float64)
                    if col.kind == "nf64"
                    else arr.astype(np.float64)
                )
            elif arr.dtype.kind not in "fiu":
                raise StoreError(f"insert_columns: column {name} needs numbers, got dtype {arr.dtype}")
            arr = arr.astype(np.float64, copy=False)
            null = np.isnan(arr)
            inf = np.isinf(arr) | (null if col.kind == "f64" else False)
            if inf.any():
                raise bad(np.flatnonzero(inf)[0], "is not a finite number")
            if col.kind == "nf64":
                obj = arr.astype(object)
                obj[null] = None
                arr = obj
        else:  # integers, nullable UInt64, DateTime as unix seconds
            lo, hi = colmod._INT_RANGES[col.kind]
            nullable = col.kind == "nu64"
            if arr.dtype == object or (nullable and arr.dtype.kind == "f"):
                # NaN -> NULL; a whole float (numpy float arrays of nullable ints) -> int
                values = [
                    None
                    if v is None or (isinstance(v, float) and v != v)
                    else int(v)
                    if isinstance(v, float) and v.is_integer()
                    else v
                    for v in arr
                ]
                if not nullable and None in values:
                    raise bad(values.index(None), "is not an integer")
                kinds = set(map(type, values)) - {type(None)}
                if not kinds <= {int, np.int64, np.uint64}:
                    i = next(
                        i
                        for i, v in enumerate(values)
                        if v is not None and type(v) not in (int, np.int64, np.uint64)
                    )
                    raise bad(i, "is not an integer")
                present = [v for v in values if v is not None]
                if present and (min(present) < lo or max(present) > hi):
                    i = next(i for i, v in enumerate(values) if v is not None and not lo <= v <= hi)
                    raise bad(i, f"is out of range [{lo}, {hi}]")
                arr = np.array(values, dtype=object) if nullable else np.array(values)
            else:
                if arr.dtype.kind not in "iu":
                    raise StoreError(f"insert_columns: column {name} needs integers, got dtype {arr.dtype}")
                if arr.size and (int(arr.min()) < lo or int(arr.max()) > hi):
                    i = np.flatnonzero((arr < lo) | (arr > hi))[0]
                    raise bad(i, f"is out of range [{lo}, {hi}]")
                if nullable:
                    arr = arr.astype(object)
        out[name] = arr
    return out


def _check_ident(name: str, what: str) -> str:
    if not _IDENT.match(name or ""):
        raise StoreError(f"{what} {name!r} is not a plain identifier ([A-Za-z_][A-Za-z0-9_]*)")
    return name


class SampleStore:
    """Backend-independent API. Subclasses implement the three hooks at the bottom."""

    database: str
    backend_name: str = "?"
    # How many queries a reader (the SLA report) may run at once through this store, one per
    # thread. 1: run them one after another (chDB serializes its session anyway).
    parallel_queries: int = 1

    # ---- schema -------------------------------------------------------------------------
    def migrate(self) -> list[int]:
        """Apply pending migrations in order; return the versions applied by this call."""
        self.ensure_database()
        self._command(schema.CREATE_MIGRATIONS_TABLE)
        applied = self._applied()
        for version, (_name, checksum) in applied.items():
            known = {m.version: m for m in schema.MIGRATIONS}.get(version)
            if known is None:
                raise SchemaMismatch(
                    f"{self.backend_name} {self.database}: migration {version} is applied but "
                    f"unknown to this code (newer code migrated this database?)"
                )
            if known.checksum != checksum:
                raise SchemaMismatch(
                    f"{self.backend_name} {self.database}: migration {version} "
                    f"({known.name!r}) was applied with checksum {checksum}, code has "
                    f"{known.checksum}; migrations are immutable, add a new version instead"
                )
        done: list[int] = []
        for m in schema.MIGRATIONS:
            if m.version in applied:
                continue
            for stmt in m.statements:
                self._command(stmt)
            # INSERT ... SELECT rather than inline VALUES: clickhouse-driver would wait for a
            # data block after an INSERT ... VALUES statement.
            self.execute(
                f"INSERT INTO {schema.MIGRATIONS_TABLE} (version, name, checksum, applied_at) "
                "SELECT %(v)s, %(n)s, %(c)s, toDateTime(%(t)s, 'UTC')",
                {"v": m.version, "n": m.name, "c": m.checksum, "t": int(time.time())},
            )
            done.append(m.version)
        return done

    def migration_status(self) -> list[dict[str, Any]]:
        """One entry per known migration: version, name, applied (bool), checksum_ok."""
        try:
            applied = self._applied()
        except StoreUnavailable:
            raise
        except StoreError:
            applied = {}  # no migrations table yet
        return [
            {
                "version": m.version,
                "name": m.name,
                "applied": m.version in applied,
                "checksum_ok": m.version not in applied or applied[m.version][1] == m.checksum,
            }
            for m in schema.MIGRATIONS
        ]

    def _applied(self) -> dict[int, tuple[str, str]]:
        # Concurrent migrators may both record a version: any one row per version will do.
        _, rows = self._select(
            f"SELECT version, any(name), any(checksum) FROM {schema.MIGRATIONS_TABLE} "
            "GROUP BY version ORDER BY version"
        )
        return {int(v): (n, c) for v, n, c in rows}

    # ---- writes -------------------------------------------------------------------------
    def insert_samples(self, rows: Sequence[Mapping[str, Any]]) -> int:
        """Insert rows built by columns.row_from as one columnar batch; returns rows inserted."""
        if not rows:
            return 0
        cols = colmod.validate_rows(rows, "insert_samples")
        self._insert_columns(schema.SAMPLES_TABLE, cols)
        return len(rows)

    def insert_columns(self, cols: Mapping[str, Any]) -> int:
        """Insert one columnar batch {column: list or numpy array}; returns rows inserted.

        For bulk loads (synthetic data, imports): validated a column at a time with numpy, not a
        dict per row. Every column of the table must be given, all of one length. Nullable
        columns take None, or NaN in a float array (NaN cannot be a measurement: non-nullable
        floats must be finite). A bad column raises StoreError naming it and the first bad row.
        """
        return self._insert_batch(_validate_columns(cols))

    def _insert_batch(self, cols: dict[str, Any]) -> int:
        n = len(next(iter(cols.values()))) if cols else 0
        if n:
            self._insert_columns(schema.SAMPLES_TABLE, cols)
        return n

    def deduplicate(self, run_id: int | None = None) -> int:
        """Physically remove duplicate recordings (of one run, or of the whole table).

        Analytics reads do not use FINAL (it cost ~7 s per pass at 10M rows); they rely on
        completed runs holding one row per (experiment, variant, run_id, seq, request_id). This
        is the step that makes that true: it finds the monthly partitions holding duplicates and
        runs OPTIMIZE TABLE samples PARTITION p FINAL on those only (a partition without
        duplicates is not rewritten). Returns the number of duplicate rows removed. Raises
        StoreError if duplicates remain: a pair split across two months cannot be merged.
        """
        if run_id is not None and (isinstance(run_id, bool) or not isinstance(run_id, int) or run_id < 0):
            raise StoreError(f"deduplicate: run_id must be a non-negative integer or None, got {run_id!r}")
        where = "run_id = %(run_id)s" if run_id is not None else "1"
        params = {"run_id": run_id} if run_id is not None else {}
        key = "experiment, variant, run_id, seq, request_id"

        def dup_partitions() -> dict[int, int]:
            rows = self.query(
                f"SELECT toYYYYMM(sent_at) AS p, count() - uniqExact({key}) AS d "
                f"FROM {schema.SAMPLES_TABLE} WHERE {where} GROUP BY p HAVING d > 0",
                params,
            )
            return {int(p): int(d) for p, d in rows}

        before = dup_partitions()
        pending = dict(before)
        # A merge already running on those parts can make OPTIMIZE a silent no-op: retry, bounded.
        for attempt in range(3):
            if not pending:
                break
            if attempt:
                time.sleep(0.5 * attempt)
            for p in sorted(pending):
                self.execute(f"OPTIMIZE TABLE {schema.SAMPLES_TABLE} PARTITION {p} FINAL")
            pending = dup_partitions()
        if pending:
            raise StoreError(
                f"{self.describe()}: deduplicate({run_id}) left duplicates in partitions {pending} "
                "after OPTIMIZE FINAL (merges busy?); run it again"
            )
        rows = self.query(
            f"SELECT count() - uniqExact({key}) FROM {schema.SAMPLES_TABLE} WHERE {where}", params
        )
        if int(rows[0][0]):
            raise StoreError(
                f"{self.describe()}: deduplicate({run_id}): {rows[0][0]} duplicate recordings sit "
                "in different monthly partitions, which OPTIMIZE cannot merge; delete the older "
                "copies with ALTER TABLE samples DELETE"
            )
        return sum(before.values())

    # ---- reads --------------------------------------------------------------------------
    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]:
        """Rows of a SELECT. Params use %(name)s; read samples FROM schema.SAMPLES_FROM."""
        return self._select(bind(sql, params))[1]

    def query_columns(self, sql: str, params: Mapping[str, Any] | None = None) -> dict[str, list[Any]]:
        names, rows = self._select(bind(sql, params))
        if len(set(names)) != len(names):
            raise StoreError(f"query_columns: duplicate column names {names}; alias them")
        return {n: [r[i] for r in rows] for i, n in enumerate(names)}

    def execute(self, sql: str, params: Mapping[str, Any] | None = None) -> None:
        """A statement without result rows (DDL, ALTER, OPTIMIZE)."""
        self._command(bind(sql, params))

    def recorded_request_ids(
        self,
        run_id: int,
        *,
        experiment: str | None = None,
        variant: str | None = None,
        seq_from: int | None = None,
        seq_to: int | None = None,
    ) -> set[str]:
        """request_ids already stored for a run (optionally one variant, seq in [from, to)).

        A resumed shard calls this and skips what it returns, so nothing is sent twice.
        """
        where, params = self._run_filter(run_id, experiment, variant, seq_from, seq_to)
        rows = self.query(
            f"SELECT DISTINCT request_id FROM {schema.SAMPLES_TABLE} WHERE {where}",
            params,
        )
        return {r[0] for r in rows}

    def count(self, run_id: int, *, experiment: str | None = None, variant: str | None = None) -> int:
        """Samples of a run: one per (variant, request_id), however many copies are on disk."""
        where, params = self._run_filter(run_id, experiment, variant, None, None)
        rows = self.query(
            f"SELECT uniqExact(variant, request_id) FROM {schema.SAMPLES_TABLE} WHERE {where}",
            params,
        )
        return int(rows[0][0])

    def counts_by_variant(self, run_id: int) -> dict[str, int]:
        rows = self.query(
            f"SELECT variant, uniqExact(request_id) FROM {schema.SAMPLES_TABLE} "
            "WHERE run_id = %(run_id)s GROUP BY variant ORDER BY variant",
            {"run_id": run_id},
        )
        return {v: int(n) for v, n in rows}

    def existing_keys(self, keys: Iterable[tuple[str, str, int, str]]) -> set[tuple]:
        """Which of these (experiment, variant, run_id, request_id) keys are already stored."""
        keys = set(keys)
        if not keys:
            return set()
        found: set[tuple] = set()
        by_run: dict[int, set[str]] = {}
        for _e, _v, run, rid in keys:
            by_run.setdefault(run, set()).add(rid)
        for run, rids in by_run.items():
            rows = self.query(
                f"SELECT DISTINCT experiment, variant, run_id, request_id "
                f"FROM {schema.SAMPLES_TABLE} WHERE run_id = %(run)s AND request_id IN %(ids)s",
                {"run": run, "ids": rids},
            )
            found.update((e, v, int(r), i) for e, v, r, i in rows)
        return found & keys

    @staticmethod
    def _run_filter(
        run_id: int,
        experiment: str | None,
        variant: str | None,
        seq_from: int | None,
        seq_to: int | None,
    ) -> tuple[str, dict[str, Any]]:
        where = ["run_id = %(run_id)s"]
        params: dict[str, Any] = {"run_id": run_id}
        for name, value, cond in (
            ("experiment", experiment, "experiment = %(experiment)s"),
            ("variant", variant, "variant = %(variant)s"),
            ("seq_from", seq_from, "seq >= %(seq_from)s"),
            ("seq_to", seq_to, "seq < %(seq_to)s"),
        ):
            if value is not None:
                where.append(cond)
                params[name] = value
        return " AND ".join(where), params

    # ---- operations ---------------------------------------------------------------------
    def ping(self) -> None:
        """Raise StoreUnavailable unless the store answers a trivial query now (for /healthz)."""
        self._select("SELECT 1")

    def truncate_for_tests(self) -> None:
        if "test" not in self.database:
            raise StoreError(
                f"truncate_for_tests refuses database {self.database!r}: name must contain 'test'"
            )
        tables = (
            schema.SAMPLES_TABLE,
            schema.ROLLUP_BUILDS_TABLE,
            schema.ROLLUP_VALUES_TABLE,
            *schema.ROLLUP_TABLES,
        )
        for table in tables:
            self._command(f"TRUNCATE TABLE IF EXISTS {table}")

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return f"{self.backend_name} database {self.database}"

    # ---- backend hooks ------------------------------------------------------------------
    def ensure_database(self) -> None:
        raise NotImplementedError

    def _command(self, sql: str) -> None:
        raise NotImplementedError

    def _select(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        raise NotImplementedError

    def _insert_columns(self, table: str, cols: dict[str, list[Any]]) -> None:
        raise NotImplementedError


# ======================================================================================
# ClickHouse server through clickhouse-driver (native protocol)
# ======================================================================================

# ClickHouse error codes worth a retry: the server is busy or the connection broke.
_TRANSIENT_SERVER_CODES = {
    159,  # TIMEOUT_EXCEEDED
    202,  # TOO_MANY_SIMULTANEOUS_QUERIES
    209,  # SOCKET_TIMEOUT
    210,  # NETWORK_ERROR
    252,  # TOO_MANY_PARTS
    319,  # UNKNOWN_STATUS_OF_INSERT
}


def _normalize_value(v: Any) -> Any:
    if isinstance(v, dt.datetime):
        return v.replace(tzinfo=dt.UTC) if v.tzinfo is None else v.astimezone(dt.UTC)
    if isinstance(v, uuid.UUID):
        return str(v)
    if isinstance(v, list):
        return [_normalize_value(x) for x in v]
    return v


class ClickHouseServerBackend(SampleStore):
    backend_name = "clickhouse-server"
    parallel_queries = 4  # a connection per thread (self._local); the server runs them together

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float = 3.0,
        send_receive_timeout: float = 30.0,
        tries: int = 3,
        backoff_s: Sequence[float] = (0.2, 0.5),
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("clickhouse", "clickhouses") or not parts.hostname:
            raise StoreError(
                f"ClickHouse URL {url!r} must look like clickhouse://user:password@host:port/db"
                " (clickhouses:// for TLS)"
            )
        self.database = _check_ident(parts.path.lstrip("/") or "default", "ClickHouse database")
        if tries < 1:
            raise StoreError(f"tries must be >= 1, got {tries}")
        self._conn_kwargs = {
            "host": parts.hostname,
            "port": parts.port or (9440 if parts.scheme == "clickhouses" else 9000),
            "secure": parts.scheme == "clickhouses",
            "user": urllib.parse.unquote(parts.username or "default"),
            "password": urllib.parse.unquote(parts.password or ""),
            "connect_timeout": connect_timeout,
            "send_receive_timeout": send_receive_timeout,
            "sync_request_timeout": min(5.0, send_receive_timeout),
        }
        self.url_safe = f"clickhouse://{parts.hostname}:{parts.port or 9000}/{self.database}"
        self._tries = tries
        self._backoff = tuple(backoff_s)
        self._local = threading.local()  # clickhouse-driver clients are not thread-safe
        self._pid = os.getpid()

    def describe(self) -> str:
        return f"{self.backend_name} {self.url_safe}"

    def _client(self, database: str | None = None) -> Any:
        from clickhouse_driver import Client

        if os.getpid() != self._pid:
            # A forked child must not share the parent's socket: start fresh.
            self._local = threading.local()
            self._pid = os.getpid()
        key = database or self.database
        clients = getattr(self._local, "clients", None)
        if clients is None:
            clients = self._local.clients = {}
        if key not in clients:
            clients[key] = Client(database=key, **self._conn_kwargs)
        return clients[key]

    def close(self) -> None:
        for c in getattr(self._local, "clients", {}).values():
            c.disconnect()
        self._local = threading.local()

    @staticmethod
    def _is_transient(e: BaseException) -> bool:
        from clickhouse_driver import errors

        if isinstance(e, errors.ServerException):
            return e.code in _TRANSIENT_SERVER_CODES
        return isinstance(
            e,
            errors.NetworkError
            | errors.SocketTimeoutError
            | errors.UnexpectedPacketFromServerError
            | EOFError
            | ConnectionError
            | TimeoutError
            | OSError,
        )

    def _run(
        self,
        fn: Callable[[Any], Any],
        what: str,
        database: str | None = None,
        tries: int | None = None,
    ) -> Any:
        tries = tries or self._tries
        last: BaseException | None = None
        for attempt in range(tries):
            client = self._client(database)
            try:
                return fn(client)
            except Exception as e:
                client.disconnect()  # never reuse a connection in an unknown state
                if not self._is_transient(e):
                    # 18.16 appends a server stack trace to every message: keep the message.
                    msg = str(e).split("Stack trace:", 1)[0].strip()
                    raise StoreError(f"{self.describe()}: {what} failed: {msg}") from e
                last = e
                if attempt + 1 < tries:
                    time.sleep(self._backoff[min(attempt, len(self._backoff) - 1)])
        raise StoreUnavailable(
            f"{self.describe()} unavailable after {tries} tries ({what}): {last}. "
            "Is it running? (scripts/clickhouse.sh start)"
        ) from last

    def ping(self) -> None:
        # /healthz wants the truth now, not after backoff: one try.
        self._run(lambda c: c.execute("SELECT 1"), "ping", tries=1)

    def ensure_database(self) -> None:
        self._run(
            lambda c: c.execute(f"CREATE DATABASE IF NOT EXISTS {self.database}"),
            "create database",
            database="default",
        )

    def _command(self, sql: str) -> None:
        self._run(lambda c: c.execute(sql), sql.split("\n", 1)[0][:80])

    def _select(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        rows, types = self._run(lambda c: c.execute(sql, with_column_types=True), "query")
        names = [n for n, _t in types]
        return names, [tuple(_normalize_value(v) for v in r) for r in rows]

    def _insert_columns(self, table: str, cols: dict[str, list[Any]]) -> None:
        arrays = [_to_numpy(colmod.BY_NAME[n].kind, v) for n, v in cols.items()]
        sql = f"INSERT INTO {table} ({', '.join(cols)}) VALUES"
        # numpy columnar is clickhouse-driver's fastest insert path (see bench/bench_insert.py).
        self._run(
            lambda c: c.execute(sql, arrays, columnar=True, settings={"use_numpy": True}),
            f"insert into {table}",
        )


def _to_numpy(kind: str, values: list[Any]) -> Any:
    import numpy as np

    if kind in ("str", "nf64", "nu64"):
        return np.array(values, dtype=object)  # Nullable needs None, which only object holds
    if kind == "datetime":
        return np.array(values, dtype="datetime64[s]")
    dtype = {"u8": np.uint8, "u16": np.uint16, "u32": np.uint32, "u64": np.uint64}.get(kind)
    dtype = dtype or {"i64": np.int64, "f64": np.float64}[kind]
    return np.array(values, dtype=dtype)


# ======================================================================================
# chDB in-process
# ======================================================================================


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


_owner: _ChdbOwner | None = None
_owner_guard = threading.Lock()


def _status_locked(path: str) -> bool:
    import fcntl

    try:
        fd = os.open(os.path.join(path, "status"), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


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
        "process per directory. Stop that process (runserver, celery worker, shell), or set "
        "ABPLAT_CLICKHOUSE_URL to share a ClickHouse server between processes."
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
        self.database = _check_ident(database, "chDB database")
        _chdb_owner(self.path)  # fail now, not at the first query, if the path is unusable
        self.ensure_database()

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

    def _select(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
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

    def _insert_columns(self, table: str, cols: dict[str, list[Any]]) -> None:
        tbl = _to_arrow(cols)  # noqa: F841 - read by name by chDB's Python(tbl)
        names = ", ".join(cols)
        # Arrow in, columnar all the way: chDB's fastest insert path (SERVICES.md ~1.1M rows/s).
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


def _to_arrow(cols: dict[str, list[Any]]) -> Any:
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
    return pa.table({n: pa.array(v, type=types[colmod.BY_NAME[n].kind]) for n, v in cols.items()})
