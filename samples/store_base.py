"""StoreBase: what every sample-store backend implements, and the SQL on top of it.

Backends (samples/backends/clickhouse.py: a ClickHouse server; samples/backends/chdb.py: chDB
in-process) implement four hooks (ensure_database, _command, _select, _insert_columns). Above
them, here: parameter binding (samples.sql) for query, query_columns and execute, and whether
the store lacks migrations (check_schema), so that a query failing for a missing table or column
says which command applies them (_explained). Values come back the same on either backend
(DateTime -> aware UTC datetime, UInt64 -> int, Nullable -> None, UUID -> str).

The parts of samples.store.SampleStore (samples/store_*.py) each extend this class, and use
nothing of the store but what it declares.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from samples import schema
from samples.sql import bind
from samples.store_errors import NotMigrated, QueryTimeout, StoreError, StoreUnavailable

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# What brings a store up to date: Django's migrate applies the sample store's migrations too
# (experiments/management/commands/migrate.py); clickhouse_migrate applies only those.
MIGRATE_ALL_COMMAND = "python manage.py migrate"
# Errors that mean "something the code expects is not in the store": unknown identifier
# (a column), unknown table, unknown database (same codes on 18.16 and chDB), and a cluster's
# shard without its local table (samples.backends.cluster). Only these are worth asking whether
# the store lacks migrations (StoreBase._explained).
_MISSING_SCHEMA = re.compile(r"Code: (47|60|81)\b|There is no table")


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


class StoreBase:
    """The backend hooks (at the bottom, for subclasses to implement) and what every part of the
    store uses: query, query_columns, execute, check_schema, describe."""

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

    # ---- SQL ----------------------------------------------------------------------------
    def query(
        self, sql: str, params: Mapping[str, Any] | None = None, *, settings: QuerySettings | None = None
    ) -> list[tuple[Any, ...]]:
        """Rows of a SELECT. Params use %(name)s. Analytics read the samples table without FINAL
        (the dedup contract, SampleWrites.deduplicate); schema.SAMPLES_FROM (with FINAL) is for exact
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

    def unit_shards(self) -> list[tuple[str, StoreBase, str]]:
        """Where a query that groups the samples by unit (a user, or a request without one:
        analysis.units.CLUSTER_KEY) runs whole, as (name, store, samples table) parts: every
        unit's rows are in exactly one part, so the parts' per-unit sums add up. The one place
        that decides "per shard or through the Distributed table" (the cluster backend, when its
        samples are sharded by the unit: samples.cluster.sharded_by_unit); here, one server or
        chDB, the store itself."""
        return [(self.describe(), self, schema.SAMPLES_TABLE)]

    # ---- is the store migrated? ----------------------------------------------------------
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

    def _applied(self) -> dict[int, tuple[str, str]]:
        # Concurrent migrators may both record a version: any one row per version will do.
        _, rows = self._select(
            f"SELECT version, any(name), any(checksum) FROM {schema.MIGRATIONS_TABLE} "
            "GROUP BY version ORDER BY version"
        )
        return {int(v): (n, c) for v, n, c in rows}

    # ---- operations ---------------------------------------------------------------------
    def ping(self) -> None:
        """Raise StoreUnavailable unless the store answers a trivial query now (for /healthz)."""
        self._select("SELECT 1")

    def prepare_for_writes(self) -> None:
        """Load now what this process's first sample insert would load, so a writer's first
        batch does not stall its caller (a replay's event loop) mid-schedule. Called once by the
        spooling writer when it is made, before any clock starts; a backend with nothing to load
        does nothing. Reading processes (the web app, reports) never pay for it."""

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
