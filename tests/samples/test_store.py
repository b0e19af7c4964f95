"""The sample store on both backends (chDB in-process and the real ClickHouse server)."""

from __future__ import annotations

import datetime as dt

import pytest

from samples import columns, schema
from samples.store import SampleStore, SchemaMismatch, StoreError
from tests.samples.conftest import sample_row
from tests.samples.truncate import truncate_for_tests


@pytest.mark.services
def test_migrate_applies_once_and_is_idempotent(make_store):
    for kind in ("chdb", "server"):
        store = make_store(kind)
        versions = [m.version for m in schema.MIGRATIONS]
        assert store.migrate() == versions == list(range(1, len(versions) + 1))
        assert store.migrate() == []
        assert store.query(f"SELECT count() FROM {schema.MIGRATIONS_TABLE}") == [(len(versions),)]
        assert [m["applied"] for m in store.migration_status()] == [True] * len(versions)


def test_migrated_table_has_exactly_the_declared_columns_and_types(store):
    rows = store.query("DESCRIBE TABLE samples")  # system.columns has no position on 18.16
    assert [r[:2] for r in rows] == [(c.name, c.ch_type) for c in columns.COLUMNS]


def test_status_before_migrating_lists_everything_pending(make_store):
    store = make_store("chdb")
    assert [m["applied"] for m in store.migration_status()] == [False] * len(schema.MIGRATIONS)


@pytest.mark.services
def test_an_edited_applied_migration_is_refused(make_store):
    for kind in ("chdb", "server"):
        store = make_store(kind)
        store.ensure_database()
        store.execute(schema.CREATE_MIGRATIONS_TABLE)
        store.execute(f"INSERT INTO {schema.MIGRATIONS_TABLE} SELECT 1, 'create samples', 'deadbeef', now()")
        with pytest.raises(SchemaMismatch, match="migration 1 .* checksum deadbeef"):
            store.migrate()


def test_a_migration_unknown_to_this_code_is_refused(fresh_store):
    fresh_store.execute(f"INSERT INTO {schema.MIGRATIONS_TABLE} SELECT 99, 'future', 'x', now()")
    with pytest.raises(SchemaMismatch, match="migration 99 is applied but unknown"):
        fresh_store.migrate()


def test_every_column_round_trips_including_none_and_unicode(store):
    full = sample_row(1)
    empty = sample_row(
        2,
        connect_ms=None,
        ttfb_ms=None,
        first_byte_ms=None,
        ttft_event_ms=None,
        ttft_ms=None,
        itl_mean_ms=None,
        itl_p50_ms=None,
        itl_p99_ms=None,
        itl_max_ms=None,
        tpot_ms=None,
        e2e_ms=None,
        server_ttft_ms=None,
        server_first_content_ns=None,
        error="",
        run_id=2**64 - 1,
        config_revision=-5,
        user_id="用户-ü",
    )
    assert store.insert_samples([full, empty]) == 2
    names = ", ".join(columns.COLUMN_NAMES)
    got = store.query_columns(f"SELECT {names} FROM {schema.SAMPLES_FROM} ORDER BY seq")
    for i, want in enumerate((full, empty)):
        row = {n: got[n][i] for n in columns.COLUMN_NAMES}
        expected = dict(want, sent_at=dt.datetime.fromtimestamp(want["sent_at"], dt.UTC))
        assert row == expected


def test_the_same_batch_inserted_twice_reads_back_once(store, make_rows):
    rows = make_rows(50)
    store.insert_samples(rows)
    store.insert_samples(rows)
    assert store.count(7) == 50
    assert store.query(f"SELECT count() FROM {schema.SAMPLES_FROM} WHERE run_id = 7") == [(50,)]
    assert store.recorded_request_ids(7) == {r["request_id"] for r in rows}


def test_a_re_recorded_request_shows_its_latest_recording(store, make_rows):
    first = make_rows(1)
    later = make_rows(1, recorded_ms=first[0]["recorded_ms"] + 1, attempt=2)
    store.insert_samples(later)
    store.insert_samples(first)
    rows = store.query(f"SELECT attempt FROM {schema.SAMPLES_FROM}")
    assert rows == [(2,)]


def test_recorded_request_ids_filters_by_variant_and_seq_range(store, make_rows):
    store.insert_samples(make_rows(10) + make_rows(10, variant="fp16"))
    ids = store.recorded_request_ids(7, variant="fp16", seq_from=3, seq_to=6)
    assert ids == {f"r7-{i}" for i in (3, 4, 5)}
    assert store.recorded_request_ids(8) == set()
    assert store.counts_by_variant(7) == {"awq": 10, "fp16": 10}
    assert store.count(7, variant="awq") == 10


def test_parameters_are_quoted_identically_on_both_backends(store):
    nasty = 'it\'s \\ a "test"\n; DROP TABLE samples --'
    assert store.query("SELECT %(s)s, %(n)s, %(f)s", {"s": nasty, "n": 2**63, "f": 0.1}) == [
        (nasty, 2**63, 0.1)
    ]
    assert store.query("SELECT 1 IN %(ids)s", {"ids": (1, 2)}) == [(1,)]


def test_a_bad_query_is_a_permanent_error_naming_the_backend(store):
    with pytest.raises(StoreError, match=store.backend_name) as err:
        store.query("SELECT no_such_column FROM samples")
    assert type(err.value) is StoreError  # not StoreUnavailable: retrying will not help


def test_insert_rejects_a_malformed_row_before_sending(store, make_rows):
    rows = make_rows(3)
    rows[2]["seq"] = "three"
    with pytest.raises(ValueError, match="insert_samples row 2: column seq"):
        store.insert_samples(rows)
    assert store.count(7) == 0


def test_truncate_for_tests_empties_the_table(store, make_rows):
    store.insert_samples(make_rows(5))
    truncate_for_tests(store)
    assert store.count(7) == 0


def test_truncate_for_tests_refuses_a_database_without_test_in_its_name():
    sent = []

    class Production(SampleStore):
        database = "abplat"

        def _command(self, sql: str) -> None:
            sent.append(sql)

    with pytest.raises(StoreError, match="refuses database 'abplat': name must contain 'test'"):
        truncate_for_tests(Production())
    assert sent == []


def test_ping_answers(store):
    store.ping()


def test_a_closed_port_is_unavailable_with_a_hint_to_start_the_server():
    import socket

    from samples.backends.clickhouse import ClickHouseServerBackend
    from samples.store import StoreUnavailable

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    store = ClickHouseServerBackend(f"clickhouse://default:@127.0.0.1:{port}/x", backoff_s=(0.01,))
    with pytest.raises(StoreUnavailable, match=r"after 1 tries \(ping\).*clickhouse.sh start"):
        store.ping()
    with pytest.raises(StoreUnavailable, match="after 3 tries"):
        store.count(1)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8123/abplat", "clickhouse:///abplat"])
def test_a_malformed_url_names_the_expected_shape(url):
    from samples.backends.clickhouse import ClickHouseServerBackend

    with pytest.raises(StoreError, match="must look like clickhouse://user:password@host:port/db"):
        ClickHouseServerBackend(url)


def test_sample_rows_round_trip_like_dict_rows_with_many_low_cardinality_names(store):
    """What the replay hands over (SampleRows, values in column order) stores exactly what the
    same rows as dicts store; LowCardinality columns with one, a few and over 256 distinct
    names (wider keys) and a NULL in every nullable column among them."""
    dicts = [
        sample_row(i, variant=f"v{i % 300}", worker=f"w{i % 5}", ttft_ms=None if i % 4 else 1.5 + i)
        for i in range(600)
    ]
    dicts[7].update(server_first_content_ns=None, e2e_ms=None)
    assert store.insert_samples([columns.SampleRow.of(r) for r in dicts]) == 600
    names = ", ".join(columns.COLUMN_NAMES)
    got = store.query_columns(f"SELECT {names} FROM {schema.SAMPLES_FROM} ORDER BY seq")
    for i, want in enumerate(dicts):
        row = {n: got[n][i] for n in columns.COLUMN_NAMES}
        assert row == dict(want, sent_at=dt.datetime.fromtimestamp(want["sent_at"], dt.UTC))


def test_a_bad_sample_row_is_named_and_nothing_is_sent(store, make_rows):
    rows = [columns.SampleRow.of(r) for r in make_rows(4)]
    rows[2] = columns.SampleRow.of(dict(rows[2].as_dict(), seq=True))
    with pytest.raises(ValueError, match="insert_samples row 2: column seq .* cannot hold True"):
        store.insert_samples(rows)
    assert store.count(7) == 0


def test_a_batch_whose_nullable_integers_are_all_null_round_trips(store):
    rows = [sample_row(i, server_first_content_ns=None, server_ttft_ms=None) for i in range(3)]
    assert store.insert_samples([columns.SampleRow.of(r) for r in rows]) == 3
    got = store.query(
        f"SELECT server_first_content_ns, server_ttft_ms, seq FROM {schema.SAMPLES_FROM} ORDER BY seq"
    )
    assert got == [(None, None, 0), (None, None, 1), (None, None, 2)]


def test_the_sort_key_inserts_follow_is_the_tables_order_by():
    ddl = schema.CREATE_SAMPLES_TABLE
    assert f"ORDER BY ({', '.join(schema.SAMPLES_SORT_KEY)})" in ddl.splitlines()
    assert schema.MIGRATIONS[0].statements == (ddl,)


def test_rows_in_any_order_are_stored_sorted_and_equal_keys_keep_their_last_recording(store, make_rows):
    import random

    rows = [dict(r, variant=("fp16", "awq", "awq-fa2")[r["seq"] % 3]) for r in make_rows(300)]
    random.Random(5).shuffle(rows)
    # The same request recorded twice in one batch: the later recording (the last row) wins.
    again = dict(rows[10], ttft_ms=999.0)
    store.insert_samples([*rows, again])
    got = store.query(f"SELECT variant, seq, ttft_ms FROM {schema.SAMPLES_FROM} ORDER BY variant, seq")
    assert len(got) == 300
    want = sorted((r["variant"], r["seq"], r["ttft_ms"]) for r in rows if r is not rows[10])
    want = sorted([*want, (again["variant"], again["seq"], 999.0)])
    assert got == want


def test_the_server_block_is_sent_in_key_order_with_request_ids_ranked_only_between_ties():
    """The ClickHouse server skips sorting a block it finds sorted: the backend sends it so.
    The String key (request_id) is ranked only among rows equal in every key before it."""
    from samples.backends.clickhouse import _dictionary, _sort_order

    def order_of(rows):
        cols = columns.validate_rows(rows)
        dictionaries = {
            name: _dictionary(arr)
            for name, arr in cols.items()
            if columns.BY_NAME[name].ch_type.startswith("LowCardinality(")
        }
        return _sort_order(cols, dictionaries, schema.SAMPLES_SORT_KEY)

    keys = [(2, "b", "x"), (1, "b", "y"), (1, "a", "z"), (1, "b", "a"), (1, "b", "y")]
    rows = [sample_row(seq, variant=variant, request_id=rid) for seq, variant, rid in keys]
    order = order_of(rows)
    assert order.tolist() == [2, 3, 1, 4, 0]  # (variant, seq, request_id); equal rows keep their order
    assert order_of([rows[i] for i in order]) is None  # in order already: sent as it is
    assert order_of([sample_row(i, request_id=f"r{9 - i}") for i in range(3)]) is None  # seq decides
