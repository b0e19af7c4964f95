"""One migrated sample-store database per test session and backend, emptied between tests.

Migrating a database runs some twenty statements (CREATE DATABASE, thirteen CREATE TABLE and
ALTER TABLE of samples.schema.MIGRATIONS, a record per migration, the checks of
SampleStore.migrate): a fresh database per test cost 0.1-0.3 s on each backend. Instead each
backend (chDB, the ClickHouse server) gets one database, migrated the first time a test asks for
it; before every test that asks, one query reads what the database holds:

- every table's CREATE statement (system.tables.create_table_query: columns, engine, keys),
- the migrations table's rows (the migrations bookkeeping, which emptying keeps),
- the rows of every table's active parts (system.parts), which tells the tables written to.

Same tables and CREATE statements and migration rows as just after migrating: the tables holding
rows are emptied with TRUNCATE (18.16 and chDB both have it, and it removes the parts at once);
the migrations table is never emptied. A rollout step's index of kept sums (a table the code
creates as it runs, samples.schema.ROLLOUT_SUMS_INDEX_PREFIX) is dropped, as data. Anything else (a table dropped, created or altered, a
migration row added, the database gone) and the database is dropped and replaced by a freshly
migrated one under a new name, so no store object, factory cache entry or chDB session still
pointing at the old one can reach the new one. The test that held the database last is named in
the session's summary (pytest_terminal_summary in the root conftest): a test that means to change
the schema should take a database of its own (make_store, fresh_store in tests/samples/conftest).

Each test gets a store object of its own on the shared database, so a test that replaces a
method on its store (a spy, a store that is "down") leaves nothing behind.

Names are unique per test process (pytest-xdist's worker name, then a random part) and the
databases are dropped when the session ends.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field

from samples import schema
from samples.backends.chdb import ChdbBackend
from samples.backends.clickhouse import ClickHouseServerBackend
from samples.store import SampleStore, StoreError, StoreUnavailable
from tests.plugin import SERVER_URL, server_url_for

KINDS = ("chdb", "server")

# One round trip: ('t', table, CREATE statement, 0), ('p', table, '', rows in its active parts),
# ('m', version, name and checksum, 0). Fails when the database or its migrations table is gone.
_STATE_SQL = """
SELECT 't' AS what, name AS a, create_table_query AS b, toUInt64(0) AS n
FROM system.tables WHERE database = %(db)s
UNION ALL
SELECT 'p', table, '', sum(rows) FROM system.parts WHERE database = %(db)s AND active GROUP BY table
UNION ALL
SELECT 'm', toString(version), concat(name, ' ', checksum), toUInt64(0) FROM {db}.{migrations}
"""


def open_store(kind: str, database: str, chdb_dir: str, server_url: str = SERVER_URL, **kw) -> SampleStore:
    """A store object of `kind` on `database` (the chDB directory of this process, or the server
    of `server_url`); `kw` go to the server backend (tries, timeouts)."""
    if kind == "chdb":
        return ChdbBackend(chdb_dir, database)
    if kind == "server":
        return ClickHouseServerBackend(server_url_for(database, server_url), **kw)
    raise ValueError(f"store kind must be one of {KINDS}, got {kind!r}")


@dataclass
class _State:
    tables: tuple[tuple[str, str], ...]
    migrations: tuple[tuple[str, str], ...]
    written: tuple[str, ...]


@dataclass
class _Database:
    kind: str
    name: str
    admin: SampleStore  # on the backend's "default" database: survives a test dropping ours
    snapshot: _State
    last_user: str = ""


@dataclass
class SessionDatabases:
    """The session's migrated database of each kind (built when first asked for)."""

    chdb_dir: str
    server_url: str = SERVER_URL
    # (test that held the database last, why it was rebuilt after it), in session order
    rebuilds: list[tuple[str, str]] = field(default_factory=list)
    _dbs: dict[str, _Database] = field(default_factory=dict)

    def acquire(self, kind: str, user: str) -> str:
        """The name of the session's database of `kind`, migrated and empty, for test `user`."""
        db = self._dbs.get(kind)
        if db is None:
            db = self._dbs[kind] = self._build(kind)
        else:
            reason = self._reset(db)
            if reason:
                self.rebuilds.append((db.last_user, f"{kind}: {reason}"))
                self._drop(db)
                db = self._dbs[kind] = self._build(kind)
        db.last_user = user
        return db.name

    def drop_all(self) -> None:
        for db in self._dbs.values():
            self._drop(db)
            db.admin.close()
        self._dbs.clear()

    # ---- internals ------------------------------------------------------------------------
    def _new_name(self) -> str:
        # "test" in the name: tests/samples/truncate.py's truncate_for_tests works on it
        worker = os.environ.get("PYTEST_XDIST_WORKER", "") or "main"
        return f"abplat_test_session_{worker}_{uuid.uuid4().hex[:10]}"

    def _build(self, kind: str) -> _Database:
        name = self._new_name()
        store = open_store(kind, name, self.chdb_dir, self.server_url)
        try:
            store.ensure_database()
            store.migrate()
        finally:
            store.close()
        old = self._dbs.get(kind)
        admin = old.admin if old is not None else open_store(kind, "default", self.chdb_dir, self.server_url)
        state = self._state(admin, name)
        return _Database(kind, name, admin, state)

    @staticmethod
    def _state(admin: SampleStore, database: str) -> _State:
        sql = _STATE_SQL.format(db=database, migrations=schema.MIGRATIONS_TABLE)
        rows = admin.query(sql, {"db": database})
        return _State(
            tables=tuple(sorted((a, b) for what, a, b, _n in rows if what == "t")),
            migrations=tuple(sorted((a, b) for what, a, b, _n in rows if what == "m")),
            written=tuple(
                sorted(a for what, a, _b, n in rows if what == "p" and n and a != schema.MIGRATIONS_TABLE)
            ),
        )

    def _reset(self, db: _Database) -> str:
        """Empty the tables the last test wrote to; or, when it changed more than rows, say what
        changed (the database is then rebuilt)."""
        try:
            now = self._state(db.admin, db.name)
        except StoreUnavailable:
            raise
        except StoreError as e:  # the database or its migrations table is gone
            cause = e.__cause__ or e  # NotMigrated (of the admin's database) wraps the raw error
            return f"its state could not be read ({str(cause).splitlines()[0][:200]})"
        if now.migrations != db.snapshot.migrations:
            return "the migrations table changed"
        # a rollout step's index of kept sums is data the code makes tables for (samples.schema):
        # dropped like rows are emptied
        for table, _create in now.tables:
            if table.startswith(schema.ROLLOUT_SUMS_INDEX_PREFIX):
                db.admin.execute(f"DROP TABLE IF EXISTS {db.name}.{table}")
        tables = tuple(t for t in now.tables if not t[0].startswith(schema.ROLLOUT_SUMS_INDEX_PREFIX))
        if tables != db.snapshot.tables:
            before, after = dict(db.snapshot.tables), dict(tables)
            changed = sorted(t for t in before.keys() | after.keys() if before.get(t) != after.get(t))
            return f"tables created, dropped or altered: {', '.join(changed)}"
        for table in now.written:
            db.admin.execute(f"TRUNCATE TABLE {db.name}.{table}")
        return ""

    @staticmethod
    def _drop(db: _Database) -> None:
        try:
            db.admin.execute(f"DROP DATABASE IF EXISTS {db.name}")
        except StoreError:  # a test that broke the server must not hide its own failure
            pass
