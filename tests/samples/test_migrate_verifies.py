"""migrate() verifies what schema_migrations claims, on both backends.

A database whose schema_migrations lists migrations 1 and 2 while a table they created is gone
(dropped by hand, a restored backup, a half-copied directory) made every insert fail while
migrate() reported "nothing to do". Now a missing table is re-created (every statement is
CREATE ... IF NOT EXISTS) and a table that exists with other columns is an error naming the table,
what differs and the command that fixes it.
"""

from __future__ import annotations

import pytest

from samples import columns, schema
from samples.sql import quote
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
    # both re-applied: their tables were missing; then 5, 7, 8 and 9, whose columns the new tables lack
    assert store.migrate() == [1, 2, 5, 7, 8, 9]
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
    assert declared[schema.SAMPLES_TABLE] == [
        (c.name, c.ch_type) for c in columns.COLUMNS if c.name not in columns.ADDED_DEFAULTS
    ]
    rollups = schema.declared_tables(schema.MIGRATIONS[1])
    later = schema.declared_tables(schema.MIGRATIONS[10])  # failures and the chart's levels
    assert set(later) == {schema.ROLLUP_FAILURES_TABLE, schema.ROLLUP_SERIES_LEVELS_TABLE}
    assert set(rollups) | set(later) == {
        schema.ROLLUP_BUILDS_TABLE,
        schema.ROLLUP_VALUES_TABLE,
        *schema.ROLLUP_TABLES,
    }


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
            ("run_id", "UInt64"),
            ("experiment", "LowCardinality(String)"),
            ("mode", "LowCardinality(String)"),
            ("source", "LowCardinality(String)"),
            ("status", "LowCardinality(String)"),
            ("started_ms", "UInt64"),
            ("finished_ms", "UInt64"),
            ("version", "UInt64"),
        ]
    }


# ---- migration 5: columns added by ALTER TABLE, verified like tables --------------------------


def test_migration_5_adds_columns_and_a_table():
    m5 = schema.MIGRATIONS[4]
    assert schema.added_columns(m5) == {
        schema.SAMPLES_TABLE: [("itl_gaps_us", "Array(UInt32)")],
        schema.ROLLUP_CELLS_TABLE: [("n_itl_requests", "UInt64"), ("n_itl_unrecorded", "UInt64")],
    }
    assert list(schema.declared_tables(m5)) == [schema.ROLLUP_GAPS_TABLE]
    assert schema.added_column("ALTER TABLE t DELETE WHERE 1") is None


def _migrated_before_gaps(store, monkeypatch) -> None:
    """The store as migrations 1-4 left it, before the gaps column: a sample without gaps."""
    with monkeypatch.context() as m:
        m.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:4])
        assert store.migrate() == [1, 2, 3, 4]
    store.execute(
        "INSERT INTO samples (experiment, variant, run_id, seq, request_id, outcome, itl_mean_ms, chunks, "
        "recorded_ms, sent_at) SELECT 'e', 'v', 1, 0, 'r1-0', 'ok', 4.5, 30, 1, toDateTime(1732900000, 'UTC')"
    )


@pytest.mark.parametrize("kind", KINDS)
def test_a_database_of_older_code_gets_the_gaps_and_its_rows_read_as_none(
    make_store, make_rows, monkeypatch, kind
):
    store = make_store(kind)
    _migrated_before_gaps(store, monkeypatch)
    assert store.migrate() == [m.version for m in schema.MIGRATIONS[4:]]  # 5 and every later one
    assert store.query("SELECT itl_gaps_us, length(itl_gaps_us) FROM samples") == [([], 0)]
    assert store.insert_samples(make_rows(2)) == 2
    got = store.query("SELECT seq, itl_gaps_us FROM samples WHERE run_id = 7 ORDER BY seq")
    assert got == [(0, make_rows(1)[0]["itl_gaps_us"]), (1, make_rows(1)[0]["itl_gaps_us"])]
    assert store.migrate() == []


@pytest.mark.parametrize("kind", KINDS)
def test_migration_5_interrupted_after_its_first_alter_runs_again(make_store, monkeypatch, kind):
    # 18.16 has no ADD COLUMN IF NOT EXISTS: the migrator skips a column that is already there
    store = make_store(kind)
    _migrated_before_gaps(store, monkeypatch)
    store.execute(schema.ADD_ITL_GAPS)  # ... and then the process died, before the record
    assert store.migrate() == [m.version for m in schema.MIGRATIONS[4:]]  # 5 and every later one
    cols = dict(
        store.query(
            f"SELECT name, type FROM system.columns WHERE database = '{store.database}' "
            "AND table = 'rollup_cells'"
        )
    )
    assert cols["n_itl_requests"] == cols["n_itl_unrecorded"] == "UInt64"


@pytest.mark.parametrize("kind", KINDS)
def test_a_recorded_column_that_is_gone_is_added_again_and_one_of_another_type_is_an_error(make_store, kind):
    store = make_store(kind)
    store.migrate()
    store.execute("ALTER TABLE samples DROP COLUMN itl_gaps_us")
    assert store.migrate() == [5]
    names = [
        n
        for (n,) in store.query(
            f"SELECT name FROM system.columns WHERE database = '{store.database}' AND table = 'samples'"
        )
    ]
    assert names == list(columns.COLUMN_NAMES)  # back at its place, after itl_max_ms
    store.execute("ALTER TABLE samples DROP COLUMN itl_gaps_us")
    store.execute("ALTER TABLE samples ADD COLUMN itl_gaps_us Array(Float32)")
    with pytest.raises(SchemaMismatch) as err:
        store.migrate()
    msg = str(err.value)
    assert f"table {store.database}.samples" in msg and "migration 5 ('inter-token gaps')" in msg
    assert "itl_gaps_us: Array(UInt32) expected, Array(Float32) found" in msg


def test_migration_6_adds_the_per_unit_moments_table():
    m6 = schema.MIGRATIONS[5]
    assert list(schema.declared_tables(m6)) == [schema.ROLLUP_MOMENTS_TABLE]
    assert schema.ROLLUP_MOMENTS_TABLE in schema.ROLLUP_BUILD_TABLES  # deleted with its build


# ---- migration 7: the gateway's own time, a column of live samples -----------------------------


def test_migration_7_adds_the_gateway_column_and_its_rollup_sum():
    m7 = schema.MIGRATIONS[6]
    assert (m7.version, m7.name) == (7, "gateway time")
    assert schema.added_columns(m7) == {
        schema.SAMPLES_TABLE: [("gateway_ms", "Float64")],
        schema.ROLLUP_CELLS_TABLE: [("s_gateway", "Float64")],
    }
    assert schema.declared_tables(m7) == {}
    assert columns.ADDED_DEFAULTS["gateway_ms"] == 0.0  # what a row spooled before it holds there
    cells = [n for n, _t in schema.table_columns(schema.ROLLUP_CELLS_TABLE)]
    assert cells.index("s_gateway") == cells.index("s_schedule_lag") + 1


def _migrated_before_gateway(store, monkeypatch) -> None:
    """The store as migrations 1-6 left it, before gateway_ms: a replay's sample and a live one,
    whose gateway time older code recorded as schedule_lag_ms."""
    with monkeypatch.context() as m:
        m.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:6])
        assert store.migrate() == [1, 2, 3, 4, 5, 6]
    store.execute(
        "INSERT INTO samples (experiment, variant, run_id, seq, request_id, mode, schedule_lag_ms, outcome, "
        "ttft_ms, recorded_ms, sent_at) SELECT 'e', 'v', 1, 0, 'r1-0', 'split', 1.5, 'ok', 40.0, 1, "
        "toDateTime(1732900000, 'UTC')"
    )
    store.execute(
        "INSERT INTO samples (experiment, variant, run_id, seq, request_id, mode, schedule_lag_ms, outcome, "
        "ttft_ms, recorded_ms, sent_at) SELECT 'e', 'v', 1000000000001, 1, 'gw-1', 'live', 0.5, 'ok', 30.0, 1, "
        "toDateTime(1732900000, 'UTC')"
    )


@pytest.mark.parametrize("kind", KINDS)
def test_a_store_of_older_code_gets_gateway_ms_and_keeps_its_rows(make_store, make_rows, monkeypatch, kind):
    store = make_store(kind)
    _migrated_before_gateway(store, monkeypatch)
    assert store.migrate() == [m.version for m in schema.MIGRATIONS[6:]]  # 7 and every later one
    # the rows recorded before are all there, as they were, with no gateway time of their own
    assert store.query(
        "SELECT request_id, mode, schedule_lag_ms, gateway_ms, ttft_ms FROM samples ORDER BY seq"
    ) == [("r1-0", "split", 1.5, 0.0, 40.0), ("gw-1", "live", 0.5, 0.0, 30.0)]
    # ... and no answer fingerprints (migration 8): nothing to compare, as the report reads it
    assert store.query("SELECT output_fp, length(token_fps) FROM samples") == [(0, 0), (0, 0)]
    names = [
        n
        for (n,) in store.query(
            f"SELECT name FROM system.columns WHERE database = '{store.database}' AND table = 'samples'"
        )
    ]
    assert names == list(columns.COLUMN_NAMES)  # gateway_ms right after schedule_lag_ms
    live = make_rows(2, mode="live", run_id=10**12 + 2, schedule_lag_ms=0.0, gateway_ms=2.25)
    assert store.insert_samples(live) == 2
    assert store.query(
        "SELECT seq, schedule_lag_ms, gateway_ms FROM samples WHERE run_id = %(r)s ORDER BY seq",
        {"r": 10**12 + 2},
    ) == [(0, 0.0, 2.25), (1, 0.0, 2.25)]
    assert store.query("SELECT count() FROM samples") == [(4,)]
    assert store.migrate() == []


@pytest.mark.parametrize("kind", KINDS)
def test_migration_7_interrupted_after_its_first_alter_runs_again(make_store, monkeypatch, kind):
    store = make_store(kind)
    _migrated_before_gateway(store, monkeypatch)
    store.execute(schema.ADD_GATEWAY_MS)  # ... and then the process died, before the record
    assert store.migrate() == [m.version for m in schema.MIGRATIONS[6:]]
    cols = dict(
        store.query(
            f"SELECT name, type FROM system.columns WHERE database = '{store.database}' "
            "AND table = 'rollup_cells'"
        )
    )
    assert cols["s_gateway"] == "Float64"
    assert store.query("SELECT count(), sum(gateway_ms) FROM samples") == [(2, 0.0)]


# ---- migration 9: answers' texts, where the experiment's document allows them ------------------


def test_migration_9_adds_the_answer_text_after_the_fingerprints():
    m9 = schema.MIGRATIONS[8]
    assert (m9.version, m9.name) == (9, "answer texts")
    assert schema.added_columns(m9) == {schema.SAMPLES_TABLE: [("answer_text", "String")]}
    assert schema.declared_tables(m9) == {}
    assert columns.ADDED_DEFAULTS["answer_text"] == ""  # what a row spooled before it holds there
    names = [n for n, _t in schema.table_columns(schema.SAMPLES_TABLE)]
    assert names.index("answer_text") == names.index("token_fps") + 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_fresh_store_takes_answer_texts_as_they_were_written(make_store, make_rows, kind):
    store = make_store(kind)
    assert store.migrate() == ALL and 9 in ALL
    rows = make_rows(2) + make_rows(1, start=2, answer_text="")
    assert store.insert_samples(rows) == 3
    got = store.query("SELECT seq, answer_text FROM samples ORDER BY seq")
    assert got == [(0, rows[0]["answer_text"]), (1, rows[1]["answer_text"]), (2, "")]
    assert "日本語" in got[0][1] and "\x00" in got[0][1]


@pytest.mark.parametrize("kind", KINDS)
def test_a_store_at_migration_8_gets_answer_texts_and_keeps_its_rows(
    make_store, make_rows, monkeypatch, kind
):
    store = make_store(kind)
    with monkeypatch.context() as m:
        m.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:8])
        assert store.migrate() == ALL[:8]
    # rows of code before migration 9: every column of theirs, fingerprints included
    older = make_rows(3)
    names = [n for n in columns.COLUMN_NAMES if n != "answer_text"]
    for r in older:  # INSERT ... SELECT: the server's driver takes no VALUES in the statement
        values = ", ".join(quote(list(r[n]) if n in ("itl_gaps_us", "token_fps") else r[n]) for n in names)
        store.execute(f"INSERT INTO samples ({', '.join(names)}) SELECT {values}")
    assert store.migrate() == [m.version for m in schema.MIGRATIONS[8:]]  # 9 and every later one
    names_now = [
        n
        for (n,) in store.query(
            f"SELECT name FROM system.columns WHERE database = '{store.database}' AND table = 'samples'"
        )
    ]
    assert names_now == list(columns.COLUMN_NAMES)  # answer_text right after token_fps
    # the rows recorded before are all there, fingerprints as they were, and no text
    assert store.query("SELECT seq, output_fp, token_fps, answer_text FROM samples ORDER BY seq") == [
        (r["seq"], r["output_fp"], r["token_fps"], "") for r in older
    ]
    newer = make_rows(2, start=3)
    assert store.insert_samples(newer) == 2
    assert store.query("SELECT answer_text FROM samples WHERE seq >= 3 ORDER BY seq") == [
        (r["answer_text"],) for r in newer
    ]
    assert store.migrate() == []
