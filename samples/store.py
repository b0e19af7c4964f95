"""The sample store's interface: what every backend offers, and the errors it raises.

Backends (samples/backends/clickhouse.py: a ClickHouse server; samples/backends/chdb.py: chDB
in-process) implement four hooks (ensure_database, _command, _select, _insert_columns); every
thing above them is shared here: migrations and their verification, parameter binding
(samples.sql), validation of inserted samples (samples.columns, the one validator), deduplicated
reads and value normalization, so a query returns the same Python values on either
(DateTime -> aware UTC datetime, UInt64 -> int, Nullable -> None, UUID -> str).
samples.factory picks the backend.

Errors: StoreUnavailable is transient (the caller spools and retries later); every other
StoreError is permanent and is raised at once.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from samples import cluster as clustermod
from samples import columns as colmod
from samples import schema
from samples.sql import bind
from telemetry import metrics

log = logging.getLogger(__name__)

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# What to run after fixing a schema by hand (the management command of this app).
MIGRATE_COMMAND = ".venv/bin/python manage.py clickhouse_migrate"
# What brings a store up to date: Django's migrate applies the sample store's migrations too
# (samples/management/commands/migrate.py); clickhouse_migrate applies only those.
MIGRATE_ALL_COMMAND = "python manage.py migrate"
# Errors that mean "something the code expects is not in the store": unknown identifier
# (a column), unknown table, unknown database (same codes on 18.16 and chDB), and a cluster's
# shard without its local table (samples.backends.cluster). Only these are worth asking whether
# the store lacks migrations (SampleStore._explained).
_MISSING_SCHEMA = re.compile(r"Code: (47|60|81)\b|There is no table")


# Added to the version of a terminal status in the run catalog (record_run): above any
# time.time_ns() of this era (~1.7e18) and still inside UInt64 with it.
_TERMINAL_RANK = 1 << 62


class StoreError(Exception):
    """Permanent failure: bad SQL, bad data, schema trouble. Retrying will not help."""


class StoreUnavailable(StoreError):
    """Transient failure (server down, network, timeout): spool the samples and retry later."""


class QueryTimeout(StoreError):
    """A read ran past the max_execution_time it was given (query(settings=...)): permanent for
    that query; ask for less (narrower filters) or allow more time."""


class StoreLocked(StoreError):
    """chDB's data directory is owned by another process."""


class SchemaMismatch(StoreError):
    """The database's schema is not what the code's migrations make: an applied migration
    differs from the code's, or a table it created is missing columns or has other types."""


class NotMigrated(StoreError):
    """The store lacks migrations this code needs (never migrated, or migrated by older code):
    the message names what is missing and the command that applies it."""


class InvalidSamples(StoreError, colmod.SampleError):
    """Samples the table cannot hold (samples.columns' validator said why); nothing was sent.
    Both a StoreError (permanent) and a ValueError (bad input)."""


QuerySettings = Mapping[str, int]


def query_settings(settings: QuerySettings | None) -> dict[str, int]:
    """Per-query ClickHouse settings as the backends send them: plain names, whole numbers
    (the server's max_execution_time takes whole seconds: 0.5 would mean "no limit")."""
    out: dict[str, int] = {}
    for name, value in (settings or {}).items():
        if not _IDENT.match(name) or isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise StoreError(f"query setting {name}={value!r}: a plain name and a whole number >= 0")
        out[name] = value
    return out


def check_ident(name: str, what: str) -> str:
    """`name` if it is a plain SQL identifier (database, table), else StoreError: identifiers
    are spliced into SQL text, never bound."""
    if not _IDENT.match(name or ""):
        raise StoreError(f"{what} {name!r} is not a plain identifier ([A-Za-z_][A-Za-z0-9_]*)")
    return name


# server_metrics' columns in table order; recorded_ms (last) is set by insert_server_metrics.
SERVER_METRIC_COLUMNS = (
    "experiment", "variant", "run_id", "metric", "sample", "labels", "le", "scraped_ms", "value", "recorded_ms",
)  # fmt: skip
SERVER_METRICS_CHUNK = 500


def _server_metric_tuple(i: int, row: Mapping[str, Any]) -> tuple[Any, ...]:
    """One server_metrics row as the tuple insert_server_metrics binds, or ValueError naming the
    row and column."""
    if not isinstance(row, Mapping):
        raise ValueError(f"insert_server_metrics: row {i} is not a mapping of column -> value")
    out: list[Any] = []
    for name in SERVER_METRIC_COLUMNS[:-1]:
        if name not in row:
            raise ValueError(f"insert_server_metrics: row {i} has no {name!r}")
        v = row[name]
        if name in ("run_id", "scraped_ms"):
            ok = isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 64
            rule = "a non-negative integer"
        elif name == "value":
            ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            v = float(v) if ok else v
            rule = "a finite number"
        else:
            ok = isinstance(v, str) and (bool(v) or name in ("labels", "le"))
            rule = "a string" if name in ("labels", "le") else "a non-empty string"
        if not ok:
            raise ValueError(f"insert_server_metrics: row {i} column {name!r} must be {rule}, got {v!r}")
        out.append(v)
    return tuple(out)


class SampleStore:
    """Backend-independent API. Subclasses implement the three hooks at the bottom."""

    database: str
    backend_name: str = "?"
    # Set on the servers of a ClickHouse cluster (samples.backends.cluster): migrations make
    # every table as <table>_local plus a Distributed <table> over them (samples.cluster).
    cluster: str = ""
    # check_schema() passed (or migrate() ran) in this process: not asked again.
    _schema_ok: bool = False
    # What check_schema raises: the factory substitutes a subclass its callers report cleanly.
    not_migrated_error: type[NotMigrated] = NotMigrated
    # How many queries a reader (the SLA report) may run at once through this store, one per
    # thread. 1: run them one after another (chDB serializes its session anyway).
    parallel_queries: int = 1

    # ---- schema -------------------------------------------------------------------------
    def migrate(self) -> list[int]:
        """Apply pending migrations in order; return the versions applied by this call.

        Migrations already recorded are verified first: every table a recorded migration
        creates must exist with (at least) its declared columns and types. A missing table is
        re-created by running that migration again (its statements are all CREATE ... IF NOT
        EXISTS; the version is then in the returned list, not recorded twice). A table with
        other columns or types raises SchemaMismatch naming the table, what differs and the
        commands that fix it.
        """
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
        # The record is a claim, not a proof: a table dropped by hand (or a copied directory
        # without it) left "applied" migrations whose tables are gone, and every insert failed
        # while migrate() had nothing to do. Verify, and re-run what is missing.
        repaired = self._verify_applied(applied)
        done: list[int] = list(repaired)
        for m in schema.MIGRATIONS:
            if m.version in applied:
                continue
            self._run_migration(m)
            # INSERT ... SELECT rather than inline VALUES: clickhouse-driver would wait for a
            # data block after an INSERT ... VALUES statement.
            self._command(
                bind(
                    f"INSERT INTO {schema.MIGRATIONS_TABLE} (version, name, checksum, applied_at) "
                    "SELECT %(v)s, %(n)s, %(c)s, toDateTime(%(t)s, 'UTC')",
                    {"v": m.version, "n": m.name, "c": m.checksum, "t": int(time.time())},
                )
            )
            done.append(m.version)
        self._schema_ok = True
        return done

    def _run_migration(self, m: schema.Migration) -> None:
        """Run a migration's statements (their cluster form on a cluster's server). An ADD COLUMN
        runs only when its table lacks the column: 18.16 has no ADD COLUMN IF NOT EXISTS, and a
        migration interrupted before its record must be safe to run again."""
        found: dict[str, list[tuple[str, str]]] | None = None
        for stmt in self._migration_statements(m):
            add = schema.added_column(stmt)
            if add is not None:
                found = self._table_columns() if found is None else found
                if add.name in dict(found.get(add.table, [])):
                    continue
            self._command(stmt)
            if stmt.lstrip().upper().startswith("CREATE"):
                found = None  # a new table: read the columns again before the next ADD COLUMN

    def _migration_statements(self, m: schema.Migration) -> tuple[str, ...]:
        """What this server runs for a migration: its statements, or on a cluster's server
        their cluster form (local table + Distributed table, samples.cluster)."""
        if not self.cluster:
            return m.statements
        try:
            return clustermod.migration_statements(m, self.cluster, self.database)
        except clustermod.ClusterSchemaError as e:
            raise SchemaMismatch(f"{self.describe()}: migration {m.version} ({m.name!r}): {e}") from None

    def check_schema(self) -> None:
        """NotMigrated (self.not_migrated_error) unless every migration of this code is recorded
        as applied: one query, then cached for this store object (the process's, through
        samples.factory). Migrations recorded by newer code are fine (a rolling deploy).
        What starts work that needs the tables asks first (workers.runs.create_run)."""
        if self._schema_ok:
            return
        missing = self._missing_migrations()
        if missing:
            raise self.not_migrated_error(self._not_migrated_text(missing))
        self._schema_ok = True

    def _missing_migrations(self) -> str:
        """What this store lacks of the code's migrations, for a message; "" when nothing."""
        pending = set(self._pending_versions())
        return ", ".join(f"{m.version:04d} {m.name!r}" for m in schema.MIGRATIONS if m.version in pending)

    def _not_migrated_text(self, missing: str) -> str:
        return (
            f"the sample store ({self.describe()}) is not migrated: it lacks {missing}. Run "
            f"`{MIGRATE_ALL_COMMAND}` (it applies the sample store's migrations too; "
            "`python manage.py clickhouse_migrate` applies only those)."
        )

    def _explained(self, hook: Any, *args: Any) -> Any:
        """hook(*args), its failure explained: when it failed for a missing table, column or
        database (_MISSING_SCHEMA) and the store lacks migrations, NotMigrated naming the command
        that applies them, with the raw error as its cause. Costs nothing until something fails."""
        try:
            return hook(*args)
        except (StoreUnavailable, QueryTimeout, NotMigrated):
            raise
        except StoreError as e:
            if not _MISSING_SCHEMA.search(str(e)):
                raise
            try:
                missing = self._missing_migrations()
            except StoreError:
                missing = ""
            if not missing:
                raise
            self._schema_ok = False
            raise self.not_migrated_error(self._not_migrated_text(missing)) from e

    def _pending_versions(self) -> list[int]:
        """Versions of this code's migrations not recorded in the store (every one when the
        database or its migrations table does not exist)."""
        try:
            _, rows = self._select(
                bind(
                    "SELECT count() FROM system.tables WHERE database = %(db)s AND name = %(t)s",
                    {"db": self.database, "t": schema.MIGRATIONS_TABLE},
                )
            )
            applied = self._applied() if rows and int(rows[0][0]) else {}
        except StoreUnavailable:
            raise
        except StoreError:  # the database itself is missing: nothing is applied
            applied = {}
        return [m.version for m in schema.MIGRATIONS if m.version not in applied]

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

    def _verify_applied(self, applied: Mapping[int, Any]) -> list[int]:
        """Re-run recorded migrations whose tables are missing; raise SchemaMismatch on a table
        whose columns differ. Returns the versions re-run."""
        found = self._table_columns()
        rerun: list[int] = []
        for m in schema.MIGRATIONS:
            if m.version not in applied:
                continue
            declared = self._physical_tables(m)
            added = self._physical_tables(m, schema.added_columns(m))
            lacking = sorted(t for t in declared if t not in found) + sorted(
                f"{t}.{c}" for t, cols in added.items() for c, _ in cols if c not in dict(found.get(t, []))
            )
            if lacking:
                log.warning(
                    "%s: migration %d (%r) is recorded but %s are missing; re-running it",
                    self.describe(),
                    m.version,
                    m.name,
                    lacking,
                )
                self._run_migration(m)
                rerun.append(m.version)
                found = self._table_columns()
            for table, want in [*declared.items(), *added.items()]:
                self._check_table(m, table, want, found.get(table, []))
            self._check_engines(m, schema.declared_tables(m))
        return rerun

    def _physical_tables(
        self, m: schema.Migration, declared: Mapping[str, list[tuple[str, str]]] | None = None
    ) -> dict[str, list[tuple[str, str]]]:
        """{table: columns} a migration makes on this server: its declared tables (or the
        columns it adds, given as ``declared``), and on a cluster's server each one's `_local`
        table as well (same columns)."""
        declared = schema.declared_tables(m) if declared is None else dict(declared)
        if not self.cluster:
            return declared
        out: dict[str, list[tuple[str, str]]] = {}
        for table, cols in declared.items():
            out[clustermod.local_name(table)] = cols
            out[table] = cols
        return out

    def _check_engines(self, m: schema.Migration, declared: Mapping[str, Any]) -> None:
        """A database migrated for one server is not a cluster's, nor the other way round: the
        tables the code reads must be Distributed exactly when a cluster is configured."""
        if not declared:  # a migration that only alters tables
            return
        _, rows = self._select(
            bind(
                "SELECT name, engine FROM system.tables WHERE database = %(db)s AND name IN %(t)s",
                {"db": self.database, "t": tuple(declared)},
            )
        )
        for table, engine in rows:
            if (engine == "Distributed") != bool(self.cluster):
                setting = (
                    f"ABPLAT_CLICKHOUSE_CLUSTER={self.cluster} expects a Distributed table"
                    if self.cluster
                    else "no ABPLAT_CLICKHOUSE_CLUSTER is set, which expects the table itself"
                )
                raise SchemaMismatch(
                    f"{self.describe()}: table {self.database}.{table} is a {engine} table (migration "
                    f"{m.version}, {m.name!r}) but {setting}: this database was migrated "
                    f"{'for one server' if self.cluster else 'for a cluster'}. Point the store at "
                    "another database (or set the cluster setting as it was when this one was made)."
                )

    def _table_columns(self) -> dict[str, list[tuple[str, str]]]:
        """{table: [(column, type), ...]} of this database, in column order."""
        _, rows = self._select(
            bind(
                "SELECT table, name, type FROM system.columns WHERE database = %(db)s",
                {"db": self.database},
            )
        )
        out: dict[str, list[tuple[str, str]]] = {}
        for table, name, ch_type in rows:
            out.setdefault(table, []).append((name, ch_type))
        return out

    def _check_table(
        self, m: schema.Migration, table: str, want: list[tuple[str, str]], have: list[tuple[str, str]]
    ) -> None:
        have_types = dict(have)
        missing = [n for n, _t in want if n not in have_types]
        wrong = [f"{n}: {t} expected, {have_types[n]} found" for n, t in want if have_types.get(n, t) != t]
        if not (missing or wrong):
            return
        what = "; ".join(
            ([f"missing column(s) {missing}"] if missing else []) + ([", ".join(wrong)] if wrong else [])
        )
        raise SchemaMismatch(
            f"{self.describe()}: table {self.database}.{table} does not match migration {m.version} "
            f"({m.name!r}) recorded in {schema.MIGRATIONS_TABLE}: {what}. It was not made by this "
            f"code's migrations. Fix: point the store at another database, or, if its data may go, "
            f"run `DROP TABLE {self.database}.{table}` (clickhouse-client, or store.execute) and then "
            f"`{MIGRATE_COMMAND}`, which re-creates it."
        )

    def _applied(self) -> dict[int, tuple[str, str]]:
        # Concurrent migrators may both record a version: any one row per version will do.
        _, rows = self._select(
            f"SELECT version, any(name), any(checksum) FROM {schema.MIGRATIONS_TABLE} "
            "GROUP BY version ORDER BY version"
        )
        return {int(v): (n, c) for v, n, c in rows}

    # ---- writes -------------------------------------------------------------------------
    def insert_samples(self, rows: Sequence[colmod.SampleRow] | Sequence[Mapping[str, Any]]) -> int:
        """Insert rows as one columnar batch; returns rows inserted. Rows are SampleRows (what
        samples.rows.row_from builds; plain tuples of the values in column order too) or
        mappings of every column. Validated columnar (samples.columns.validate_samples); a bad
        value raises InvalidSamples naming the row and column, and nothing is sent."""
        if not rows:
            return 0
        try:
            cols = colmod.validate_samples(rows, "insert_samples")
        except colmod.SampleError as e:
            raise InvalidSamples(str(e), row=e.row) from None
        return self._insert_batch(cols)

    def insert_columns(self, cols: Mapping[str, Any]) -> int:
        """Insert one columnar batch {column: list or numpy array}; returns rows inserted.

        For bulk loads (synthetic data, imports): the same validator as insert_samples, on the
        given columns (skipped for a samples.columns.ValidColumns, which passed it already).
        Every column of the table must be given, all of one length. Nullable
        columns take None, or NaN (NaN cannot be a measurement: non-nullable floats must be
        finite). A bad value raises InvalidSamples naming the column and the first bad row.
        """
        if isinstance(cols, colmod.ValidColumns):  # validated already (SpoolingWriter.write)
            return self._insert_batch(cols)
        try:
            checked = colmod.validate_columns(cols, "insert_columns")
        except colmod.SampleError as e:
            raise InvalidSamples(str(e), row=e.row) from None
        return self._insert_batch(checked)

    def _insert_batch(self, cols: dict[str, np.ndarray]) -> int:
        n = len(next(iter(cols.values()))) if cols else 0
        if n:
            # abplat_store_* (telemetry/metrics.py): rows, seconds per batch, errors by kind.
            started = time.perf_counter()
            try:
                self._explained(self._insert_columns, schema.SAMPLES_TABLE, cols)
            except StoreUnavailable:
                metrics.STORE_INSERT_ERRORS.labels(self.backend_name, "unavailable").inc()
                raise
            except Exception:
                metrics.STORE_INSERT_ERRORS.labels(self.backend_name, "permanent").inc()
                raise
            metrics.STORE_INSERT_SECONDS.labels(self.backend_name).observe(time.perf_counter() - started)
            metrics.STORE_INSERTED_ROWS.labels(self.backend_name).inc(n)
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
        # OPTIMIZE merges the parts of one table on one server: on a cluster's server, its local
        # table (the rows of one request all land on one shard, samples.cluster).
        table = clustermod.local_name(schema.SAMPLES_TABLE) if self.cluster else schema.SAMPLES_TABLE

        def dup_partitions() -> dict[int, int]:
            rows = self.query(
                f"SELECT toYYYYMM(sent_at) AS p, count() - uniqExact({key}) AS d "
                f"FROM {table} WHERE {where} GROUP BY p HAVING d > 0",
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
                self.execute(f"OPTIMIZE TABLE {table} PARTITION {p} FINAL")
            pending = dup_partitions()
        if pending:
            raise StoreError(
                f"{self.describe()}: deduplicate({run_id}) left duplicates in partitions {pending} "
                "after OPTIMIZE FINAL (merges busy?); run it again"
            )
        rows = self.query(f"SELECT count() - uniqExact({key}) FROM {table} WHERE {where}", params)
        if int(rows[0][0]):
            raise StoreError(
                f"{self.describe()}: deduplicate({run_id}): {rows[0][0]} duplicate recordings sit "
                "in different monthly partitions, which OPTIMIZE cannot merge; delete the older "
                "copies with ALTER TABLE samples DELETE"
            )
        return sum(before.values())

    # ---- the run catalog ------------------------------------------------------------------
    def record_run(
        self,
        run_id: int,
        experiment: str,
        mode: str,
        status: str,
        *,
        source: str = "replay",
        started_ms: int = 0,
        finished_ms: int = 0,
    ) -> None:
        """Record a run's status in the run catalog (schema.RUNS_TABLE); idempotent.

        The latest call wins (version: wall-clock nanoseconds), except that a terminal status
        (done, cancelled, failed) always outranks 'running': a delayed retry of the 'running'
        record never reopens a finished run. started_ms/finished_ms of 0 mean "unknown" and keep
        what an earlier call recorded (runs() takes the largest). Raises ValueError on a bad
        argument (nothing is written) and StoreUnavailable when the store is down.
        """
        if isinstance(run_id, bool) or not isinstance(run_id, int) or run_id < 0:
            raise ValueError(f"record_run: run_id must be a non-negative integer, got {run_id!r}")
        if not isinstance(experiment, str) or not experiment:
            raise ValueError(f"record_run: experiment must be a non-empty key, got {experiment!r}")
        if mode not in colmod.MODES:
            raise ValueError(f"record_run: mode must be one of {colmod.MODES}, got {mode!r}")
        if status not in schema.RUN_STATUSES:
            raise ValueError(f"record_run: status must be one of {schema.RUN_STATUSES}, got {status!r}")
        if not isinstance(source, str) or not source:
            raise ValueError(f"record_run: source must be a non-empty name, got {source!r}")
        for name, value in (("started_ms", started_ms), ("finished_ms", finished_ms)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"record_run: {name} must be a non-negative integer (unix ms), got {value!r}"
                )
        version = time.time_ns() + (_TERMINAL_RANK if status != "running" else 0)
        self.execute(
            f"INSERT INTO {schema.RUNS_TABLE} "
            "(run_id, experiment, mode, source, status, started_ms, finished_ms, version) "
            "SELECT %(run_id)s, %(experiment)s, %(mode)s, %(source)s, %(status)s, "
            "%(started_ms)s, %(finished_ms)s, %(version)s",
            {"run_id": run_id, "experiment": experiment, "mode": mode, "source": source,
             "status": status, "started_ms": started_ms, "finished_ms": finished_ms,
             "version": version},
        )  # fmt: skip

    def runs(self, experiment: str) -> list[dict[str, Any]]:
        """The run catalog of an experiment, one dict per run (its latest record), in run order:
        {run_id, experiment, mode, source, status, started_ms, finished_ms, version}.
        started_ms/finished_ms are the largest recorded (0: never recorded)."""
        rows = self.query(
            "SELECT run_id, argMax(mode, version), argMax(source, version), argMax(status, version), "
            "max(started_ms), max(finished_ms), max(version) "
            f"FROM {schema.RUNS_TABLE} WHERE experiment = %(experiment)s GROUP BY run_id ORDER BY run_id",
            {"experiment": experiment},
        )
        return [
            {"run_id": int(r), "experiment": experiment, "mode": m, "source": src, "status": st,
             "started_ms": int(t0), "finished_ms": int(t1), "version": int(ver)}
            for r, m, src, st, t0, t1, ver in rows
        ]  # fmt: skip

    # ---- server metrics: the variants' own series, scraped during a replay ----------------
    def insert_server_metrics(self, rows: Sequence[Mapping[str, Any]]) -> int:
        """Insert scraped series (schema.SERVER_METRICS_TABLE); returns rows inserted.

        Each row maps every column but recorded_ms (set here): experiment, variant, run_id,
        metric, sample, labels, le, scraped_ms, value. A bad value raises ValueError naming the
        row and column, and nothing is sent. Retrying a batch after an ambiguous failure is
        safe: the same rows have the same key, and readers collapse it (schema's comment)."""
        if not rows:
            return 0
        self.check_schema()
        checked = [_server_metric_tuple(i, row) for i, row in enumerate(rows)]
        recorded = int(time.time() * 1000)
        names = ", ".join(SERVER_METRIC_COLUMNS)
        picks = ", ".join(f"tupleElement(r, {i + 1})" for i in range(len(SERVER_METRIC_COLUMNS) - 1))
        # INSERT ... SELECT over an array literal: both backends run it as one statement, and
        # clickhouse-driver would wait for a data block after INSERT ... VALUES. Chunked to stay
        # well inside max_query_size (256 KiB by default).
        for start in range(0, len(checked), SERVER_METRICS_CHUNK):
            self.execute(
                f"INSERT INTO {schema.SERVER_METRICS_TABLE} ({names}) "
                f"SELECT {picks}, %(recorded)s FROM (SELECT arrayJoin(%(rows)s) AS r)",
                {"rows": checked[start : start + SERVER_METRICS_CHUNK], "recorded": recorded},
            )
        return len(checked)

    # ---- reads --------------------------------------------------------------------------
    def query(
        self, sql: str, params: Mapping[str, Any] | None = None, *, settings: QuerySettings | None = None
    ) -> list[tuple[Any, ...]]:
        """Rows of a SELECT. Params use %(name)s. Analytics read the samples table without FINAL
        (the dedup contract, see deduplicate); schema.SAMPLES_FROM (with FINAL) is for exact
        reads of a few rows that may still hold duplicate recordings (checks, tests).
        ``settings``: ClickHouse settings for this query only, e.g. {"max_execution_time": 60}
        (whole seconds; past it the query stops and QueryTimeout is raised).
        A store that lacks migrations raises NotMigrated naming the command to run (_explained)."""
        return self._explained(self._select, bind(sql, params), settings)[1]

    def query_columns(
        self, sql: str, params: Mapping[str, Any] | None = None, *, settings: QuerySettings | None = None
    ) -> dict[str, list[Any]]:
        names, rows = self._explained(self._select, bind(sql, params), settings)
        if len(set(names)) != len(names):
            raise StoreError(f"query_columns: duplicate column names {names}; alias them")
        return {n: [r[i] for r in rows] for i, n in enumerate(names)}

    def execute(self, sql: str, params: Mapping[str, Any] | None = None) -> None:
        """A statement without result rows (DDL, ALTER, OPTIMIZE)."""
        self._explained(self._command, bind(sql, params))

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

    def prepare_for_writes(self) -> None:
        """Load now what this process's first sample insert would load, so a writer's first
        batch does not stall its caller (a replay's event loop) mid-schedule. Called once by the
        spooling writer when it is made, before any clock starts; a backend with nothing to load
        does nothing. Reading processes (the web app, reports) never pay for it."""

    def truncate_for_tests(self) -> None:
        if "test" not in self.database:
            raise StoreError(
                f"truncate_for_tests refuses database {self.database!r}: name must contain 'test'"
            )
        tables = (
            schema.SAMPLES_TABLE,
            schema.ROLLUP_BUILDS_TABLE,
            *schema.ROLLUP_BUILD_TABLES,
            *schema.ROLLUP_TABLES,
            schema.RUNS_TABLE,
            schema.SERVER_METRICS_TABLE,
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

    def _select(
        self, sql: str, settings: QuerySettings | None = None
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        """(column names, rows) of a SELECT run with ``settings`` (checked by query_settings)."""
        raise NotImplementedError

    def _insert_columns(self, table: str, cols: dict[str, np.ndarray]) -> None:
        """Insert validated columns (samples.columns.validate_columns' arrays, COLUMNS order)."""
        raise NotImplementedError
