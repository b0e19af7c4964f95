"""StoreMigrations: applying samples.schema's migrations to a store, and verifying them.

A migration recorded as applied is checked against the database before anything new is applied:
its tables must exist with its columns and types, and with the engine this store expects (a
cluster's Distributed tables, or one server's own). A missing table is made again, a table that
differs raises SchemaMismatch naming the fix. What a migration is (its statements, checksum and
declared tables) is samples.schema's; the cluster form of its statements, samples.cluster's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from samples import cluster as clustermod
from samples import schema
from samples.sql import bind
from samples.store_base import StoreBase
from samples.store_errors import SchemaMismatch, StoreError, StoreUnavailable

log = logging.getLogger(__name__)

# What to run after fixing a schema by hand (the management command of this app).
MIGRATE_COMMAND = ".venv/bin/python manage.py clickhouse_migrate"


class StoreMigrations(StoreBase):
    """migrate() and migration_status(), on any backend."""

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
