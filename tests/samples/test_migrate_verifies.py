"""Issue 17: migrate() verifies what schema_migrations claims, on both backends.

A database whose schema_migrations lists migrations 1 and 2 while a table they created is gone
(dropped by hand, a restored backup, a half-copied directory) made every insert fail while
migrate() reported "nothing to do". Now a missing table is re-created (every statement is
CREATE ... IF NOT EXISTS) and a table that exists with other columns is an error naming the table,
what differs and the command that fixes it.
"""

from __future__ import annotations

import pytest

from samples import columns, schema
from samples.store import SchemaMismatch

KINDS = ("chdb", "server")
ALL = [m.version for m in schema.MIGRATIONS]


@pytest.mark.parametrize("kind", KINDS)
def test_a_recorded_migration_whose_table_is_gone_is_repaired(make_store, make_rows, kind):
    store = make_store(kind)
    assert store.migrate() == ALL
    store.execute(f"DROP TABLE {schema.SAMPLES_TABLE}")
    store.execute(f"DROP TABLE {schema.ROLLUP_HIST_TABLE}")
    assert [m["applied"] for m in store.migration_status()] == [True] * len(ALL)  # the record still says so
    assert store.migrate() == [1, 2]  # both re-applied: their tables were missing
    assert store.insert_samples(make_rows(3)) == 3
    assert store.count(7) == 3
    assert store.query(f"SELECT count() FROM {schema.ROLLUP_HIST_TABLE}") == [(0,)]
    # not recorded twice
    assert store.query(f"SELECT count() FROM {schema.MIGRATIONS_TABLE}") == [(len(ALL),)]
    assert store.migrate() == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_recorded_table_with_other_columns_is_an_error_naming_the_fix(make_store, kind):
    store = make_store(kind)
    store.migrate()
    store.execute(f"DROP TABLE {schema.SAMPLES_TABLE}")
    store.execute(
        f"CREATE TABLE {schema.SAMPLES_TABLE} (experiment String, seq UInt64) ENGINE = MergeTree ORDER BY seq"
    )
    with pytest.raises(SchemaMismatch) as err:
        store.migrate()
    msg = str(err.value)
    assert f"table {store.database}.samples" in msg
    assert "migration 1 ('create samples')" in msg
    assert "missing column(s) ['variant', 'run_id'" in msg
    assert "seq: UInt32 expected, UInt64 found" in msg
    assert f"DROP TABLE {store.database}.samples" in msg and "manage.py clickhouse_migrate" in msg


def test_the_check_reads_every_declared_table_and_column():
    declared = schema.declared_tables(schema.MIGRATIONS[0])
    assert list(declared) == [schema.SAMPLES_TABLE]
    assert declared[schema.SAMPLES_TABLE] == [(c.name, c.ch_type) for c in columns.COLUMNS]
    rollups = schema.declared_tables(schema.MIGRATIONS[1])
    assert set(rollups) == {schema.ROLLUP_BUILDS_TABLE, schema.ROLLUP_VALUES_TABLE, *schema.ROLLUP_TABLES}


@pytest.mark.parametrize("kind", KINDS)
def test_the_run_catalog_table_is_verified_like_the_others(make_store, kind):
    store = make_store(kind)
    store.migrate()
    store.record_run(5, "exp", "split", "done")
    store.execute(f"DROP TABLE {schema.RUNS_TABLE}")
    assert store.migrate() == [3]  # re-created: the catalog was gone
    assert store.runs("exp") == []
    store.record_run(5, "exp", "split", "done")
    assert [r["status"] for r in store.runs("exp")] == ["done"]
    store.execute(f"DROP TABLE {schema.RUNS_TABLE}")
    store.execute(
        f"CREATE TABLE {schema.RUNS_TABLE} (run_id UInt32, experiment String) ENGINE = MergeTree ORDER BY run_id"
    )
    with pytest.raises(SchemaMismatch) as err:
        store.migrate()
    msg = str(err.value)
    assert f"table {store.database}.runs" in msg and "migration 3 ('run catalog')" in msg
    assert "run_id: UInt64 expected, UInt32 found" in msg and "missing column(s) ['mode'" in msg
    assert "experiment: LowCardinality(String) expected, String found" in msg


def test_the_run_catalog_declares_its_columns():
    assert schema.declared_tables(schema.MIGRATIONS[2]) == {
        schema.RUNS_TABLE: [
            ("run_id", "UInt64"), ("experiment", "LowCardinality(String)"), ("mode", "LowCardinality(String)"),
            ("source", "LowCardinality(String)"), ("status", "LowCardinality(String)"),
            ("started_ms", "UInt64"), ("finished_ms", "UInt64"), ("version", "UInt64"),
        ]
    }  # fmt: skip
