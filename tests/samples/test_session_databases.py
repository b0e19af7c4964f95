"""The session's shared sample-store databases (tests/sample_dbs.py): emptied between tests, the
migrations bookkeeping kept, and rebuilt when a test changed more than rows. Each test here runs
its own SessionDatabases (its own database names), never the session's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from samples import schema
from tests.sample_dbs import KINDS, SessionDatabases, open_store
from tests.samples.conftest import sample_row
from tests.samples.truncate import truncate_for_tests

TABLES = {
    schema.SAMPLES_TABLE,
    schema.MIGRATIONS_TABLE,
    schema.RUNS_TABLE,
    schema.SERVER_METRICS_TABLE,
    schema.ROLLUP_BUILDS_TABLE,
    schema.ROLLUP_VALUES_TABLE,
    schema.ROLLUP_GAPS_TABLE,
    *schema.ROLLUP_TABLES,
}


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    if request.param == "server":
        request.getfixturevalue("clickhouse_server")
    return request.param


@pytest.fixture
def dbs(chdb_dir) -> Iterator[SessionDatabases]:
    own = SessionDatabases(chdb_dir)
    yield own
    own.drop_all()


def on(kind: str, name: str, chdb_dir: str):
    return open_store(kind, name, chdb_dir)


def databases(kind: str, chdb_dir: str) -> set[str]:
    admin = on(kind, "default", chdb_dir)
    try:
        return {n for (n,) in admin.query("SELECT name FROM system.databases")}
    finally:
        admin.close()


def write_everywhere(store) -> None:
    store.insert_samples([sample_row(i) for i in range(3)])
    store.record_run(7, "ttft-opt", "split", "done")
    store.insert_server_metrics(
        [
            dict(
                experiment="e",
                variant="v",
                run_id=7,
                metric="m",
                sample="m",
                labels="",
                le="",
                scraped_ms=1,
                value=1.0,
            )
        ]
    )
    store.execute(f"INSERT INTO {schema.ROLLUP_VALUES_TABLE} SELECT 1, 'v', 'ttft_ms', 0, 1.5")


def counts(store) -> dict[str, int]:
    return {t: int(store.query(f"SELECT count() FROM {t}")[0][0]) for t in sorted(TABLES)}


def test_the_next_test_gets_the_same_database_empty_with_its_migrations(dbs, kind, chdb_dir):
    name = dbs.acquire(kind, "first")
    store = on(kind, name, chdb_dir)
    assert store.migration_status() == [
        {"version": m.version, "name": m.name, "applied": True, "checksum_ok": True}
        for m in schema.MIGRATIONS
    ]
    write_everywhere(store)
    assert counts(store)[schema.SAMPLES_TABLE] == 3
    assert dbs.acquire(kind, "second") == name
    assert counts(store) == {t: len(schema.MIGRATIONS) if t == schema.MIGRATIONS_TABLE else 0 for t in TABLES}
    assert store.migrate() == [] and dbs.rebuilds == []
    store.close()


def test_the_name_is_unique_per_test_process_and_names_the_xdist_worker(dbs, chdb_dir, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw7")
    name = dbs.acquire("chdb", "first")
    assert name.startswith("abplat_test_session_gw7_")
    other = SessionDatabases(chdb_dir)
    try:
        assert other.acquire("chdb", "elsewhere") != name
    finally:
        other.drop_all()


@pytest.mark.parametrize(
    "change, why",
    [
        ("ALTER TABLE samples ADD COLUMN extra UInt8", "altered: samples"),
        ("ALTER TABLE rollup_cells DROP COLUMN n_itl_unrecorded", "altered: rollup_cells"),
        ("CREATE TABLE leftover (a UInt8) ENGINE = MergeTree ORDER BY a", "altered: leftover"),
        ("DROP TABLE runs", "altered: runs"),
        (
            f"INSERT INTO {schema.MIGRATIONS_TABLE} SELECT 99, 'future', 'x', now()",
            "migrations table changed",
        ),
        (f"TRUNCATE TABLE {schema.MIGRATIONS_TABLE}", "migrations table changed"),
        (f"DROP TABLE {schema.MIGRATIONS_TABLE}", "could not be read"),
        ("DROP DATABASE {db}", "could not be read"),
    ],
)
def test_a_test_that_changes_more_than_rows_gets_the_database_rebuilt(dbs, kind, chdb_dir, change, why):
    name = dbs.acquire(kind, "culprit")
    store = on(kind, name, chdb_dir)
    store.insert_samples([sample_row(1)])
    store.execute(change.format(db=name))
    store.close()
    again = dbs.acquire(kind, "next")
    assert again != name  # a new name: nothing still pointing at the old database reaches it
    assert name not in databases(kind, chdb_dir)
    [(user, reason)] = dbs.rebuilds
    assert user == "culprit" and reason.startswith(f"{kind}: ") and why in reason
    fresh = on(kind, again, chdb_dir)
    assert fresh.migrate() == []
    assert counts(fresh) == {t: len(schema.MIGRATIONS) if t == schema.MIGRATIONS_TABLE else 0 for t in TABLES}
    fresh.close()


def test_the_session_end_drops_every_database(chdb_dir, kind):
    own = SessionDatabases(chdb_dir)
    name = own.acquire(kind, "only")
    assert name in databases(kind, chdb_dir)
    own.drop_all()
    assert name not in databases(kind, chdb_dir)


def test_truncate_for_tests_accepts_the_session_database(dbs, kind, chdb_dir):
    store = on(kind, dbs.acquire(kind, "t"), chdb_dir)
    store.insert_samples([sample_row(1)])
    truncate_for_tests(store)  # the name holds "test"
    assert store.count(7) == 0
