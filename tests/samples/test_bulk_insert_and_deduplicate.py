"""SampleStore.insert_columns (bulk, validated per column) and SampleStore.deduplicate (the step
that lets analytics read without FINAL), on chDB and on the ClickHouse server."""

from __future__ import annotations

import numpy as np
import pytest

from samples import columns, schema
from samples.store import StoreError
from tests.samples.truncate import truncate_for_tests


def _columns(make_rows, n: int = 6, **over) -> dict[str, list]:
    return columns.to_columns(make_rows(n, **over))


def test_insert_columns_matches_insert_samples_row_for_row(store, make_rows):
    rows = make_rows(5)
    names = ", ".join(columns.COLUMN_NAMES)
    read = f"SELECT {names} FROM {schema.SAMPLES_TABLE} ORDER BY seq"
    assert store.insert_columns(columns.to_columns(rows)) == 5
    bulk = store.query(read)
    truncate_for_tests(store)
    store.insert_samples(rows)
    assert bulk == store.query(read)
    assert len(bulk) == 5


def test_insert_columns_takes_numpy_arrays_with_nan_as_null(store, make_rows):
    cols = _columns(make_rows, 4)
    cols["ttft_ms"] = np.array([1.5, np.nan, 3.0, np.nan])
    cols["server_first_content_ns"] = np.array([np.nan, 7.0, np.nan, np.nan])
    cols["seq"] = np.arange(4, dtype=np.uint32)
    store.insert_columns(cols)
    got = store.query(f"SELECT ttft_ms, server_first_content_ns FROM {schema.SAMPLES_TABLE} ORDER BY seq")
    assert got == [(1.5, None), (None, 7), (3.0, None), (None, None)]


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        # one validator, one message shape: where, row, column (type), value, reason
        (
            "ttft_ms",
            float("inf"),
            "row 2: column ttft_ms (Nullable(Float64)) cannot hold inf: not a finite number",
        ),
        ("sent_unix_ms", np.nan, "row 2: column sent_unix_ms (Float64) cannot hold nan: not a finite number"),
        ("in_flight", -1, "row 2: column in_flight (UInt32) cannot hold -1: out of range"),
        ("variant", 3, "row 2: column variant (LowCardinality(String)) cannot hold 3: not a str"),
    ],
)
def test_insert_columns_names_the_bad_column_and_row(store, make_rows, column, value, message):
    cols = _columns(make_rows, 4)
    cols[column][2] = value
    with pytest.raises(StoreError, match=message.replace("(", r"\(").replace(")", r"\)")):
        store.insert_columns(cols)
    assert store.query(f"SELECT count() FROM {schema.SAMPLES_TABLE}") == [(0,)]


def test_insert_columns_rejects_missing_unknown_and_ragged_columns(store, make_rows):
    cols = _columns(make_rows, 3)
    with pytest.raises(
        StoreError, match=r"unknown column\(s\) \['colour'\], missing column\(s\) \['ttft_ms'\]"
    ):
        store.insert_columns({**{k: v for k, v in cols.items() if k != "ttft_ms"}, "colour": [1, 2, 3]})
    with pytest.raises(StoreError, match="columns differ in length"):
        store.insert_columns({**cols, "seq": [0, 1]})


def test_deduplicate_keeps_the_latest_recording_and_only_touches_the_run(store, make_rows):
    store.insert_samples(make_rows(20))
    store.insert_samples(make_rows(5, recorded_ms=1))  # older copies of seq 0..4
    store.insert_samples(make_rows(3, run_id=8))
    store.insert_samples(make_rows(3, run_id=8))  # run 8 duplicated too
    assert store.query(f"SELECT count() FROM {schema.SAMPLES_TABLE} WHERE run_id = 7")[0][0] in (20, 25)
    store.deduplicate(run_id=7)
    rows = store.query(f"SELECT seq, recorded_ms FROM {schema.SAMPLES_TABLE} WHERE run_id = 7 ORDER BY seq")
    assert [s for s, _ in rows] == list(range(20))
    assert all(rec > 1 for _, rec in rows)  # the newer recording won
    assert store.deduplicate() >= 0
    assert store.query(f"SELECT count() FROM {schema.SAMPLES_TABLE} WHERE run_id = 8") == [(3,)]
    assert store.deduplicate(run_id=7) == 0  # nothing left: no partition is rewritten


def test_deduplicate_refuses_a_bad_run_id(store):
    with pytest.raises(StoreError, match="run_id must be a non-negative integer or None, got 'x'"):
        store.deduplicate(run_id="x")
