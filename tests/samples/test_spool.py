"""Samples survive a store outage: spooled on disk, flushed in order, never duplicated."""

from __future__ import annotations

import os

import pytest

from samples.schema import SAMPLES_FROM
from samples.spool import SpoolingWriter
from samples.store import StoreUnavailable


def _spy_inserts(store):
    """Record the seqs of every batch the store is asked to insert, as rows (a spool flush) or as
    columns the writer validated already (SpoolingWriter.write)."""
    calls: list[list[int]] = []
    real_rows, real_cols = store.insert_samples, store.insert_columns

    def spy_rows(rows):
        calls.append([r["seq"] for r in rows])
        return real_rows(rows)

    def spy_cols(cols):
        calls.append([int(s) for s in cols["seq"]])
        return real_cols(cols)

    store.insert_samples, store.insert_columns = spy_rows, spy_cols
    return calls


def test_samples_are_spooled_while_the_server_is_down_and_flushed_in_order(
    make_store, flaky_server, make_rows, tmp_path
):
    proxy, url = flaky_server
    store = make_store("server", url=url, tries=2, backoff_s=(0.05,), connect_timeout=1.0)
    store.migrate()
    now = [0.0]
    writer = SpoolingWriter(store, str(tmp_path / "spool"), pause_s=5.0, clock=lambda: now[0])
    assert writer.write(make_rows(10, start=0)) == "stored"

    proxy.down()
    assert writer.write(make_rows(10, start=10)) == "spooled"
    assert writer.paused()
    calls = _spy_inserts(store)
    assert writer.write(make_rows(10, start=20)) == "spooled"
    assert calls == []  # paused: spooled without asking the store
    assert writer.pending(7) == 20 and not writer.durable(7)
    with pytest.raises(StoreUnavailable, match="scripts/clickhouse.sh start"):
        writer.flush()  # an explicit flush always tries
    assert writer.pending(7) == 20  # a failed flush keeps everything

    proxy.up()
    assert writer.write(make_rows(10, start=30)) == "spooled"  # still in the pause the flush began
    now[0] += 5.0
    calls.clear()
    assert writer.write(make_rows(10, start=40)) == "stored"
    # the spooled batches went first, oldest first, then the new one
    assert [c[0] for c in calls] == [10, 20, 30, 40]
    assert writer.durable(7) and writer.pending() == 0 and not writer.spilling()
    assert store.count(7) == 50
    assert store.query("SELECT count() FROM samples WHERE run_id = 7") == [(50,)]


def test_a_batch_spooled_after_an_insert_that_landed_is_not_stored_twice(store, make_rows, tmp_path):
    rows = make_rows(20)
    writer = SpoolingWriter(store, str(tmp_path / "spool"))
    # The insert reached the store but its reply was lost, so the writer spooled it too.
    store.insert_samples(rows[:15])
    writer.spool.append(rows)
    report = writer.flush()
    assert (report.inserted, report.skipped_stored, report.files) == (5, 15, 1)
    # physically one copy each: the flush filtered, not just FINAL
    assert store.query("SELECT count() FROM samples") == [(20,)]
    assert writer.durable(7)


@pytest.mark.parametrize("crash", ["mid_line", "before_rename"])
def test_a_spool_file_torn_by_a_crash_gives_up_its_complete_rows_and_is_quarantined(
    store, make_rows, tmp_path, crash
):
    writer = SpoolingWriter(store, str(tmp_path / "spool"))
    name = writer.spool.append(make_rows(10))
    path = os.path.join(writer.spool.dir, name)
    data = open(path, "rb").read()
    lines = data.split(b"\n")
    # header + 4 complete rows, then half of the 5th row: what a crash mid-write leaves
    cut = sum(len(x) + 1 for x in lines[:5]) + len(lines[5]) // 2
    with open(path, "r+b") as f:
        f.truncate(cut)
    if crash == "before_rename":
        os.rename(path, path + ".tmp")

    assert not writer.durable(7)
    report = writer.flush()
    assert report.salvaged == 4 and report.inserted == 4
    assert len(report.torn_files) == 1 and os.path.exists(report.torn_files[0])
    assert store.recorded_request_ids(7) == {f"r7-{i}" for i in range(4)}
    assert writer.durable(7)
    # the next batch gets a fresh sequence number, never the quarantined one
    assert writer.spool.append(make_rows(1, start=50)) != name


def test_a_torn_file_whose_header_is_unreadable_blocks_every_run_until_flushed(store, make_rows, tmp_path):
    writer = SpoolingWriter(store, str(tmp_path / "spool"))
    name = writer.spool.append(make_rows(3))
    path = os.path.join(writer.spool.dir, name)
    with open(path, "r+b") as f:
        f.truncate(5)
    assert not writer.durable(7) and not writer.durable(12345)
    report = writer.flush()
    assert report.torn_files and report.salvaged == 0
    assert writer.durable(12345)


def test_rows_the_store_would_reject_are_refused_not_spooled(store, make_rows, tmp_path):
    writer = SpoolingWriter(store, str(tmp_path / "spool"))
    rows = make_rows(2)
    rows[1]["mode"] = 3
    with pytest.raises(ValueError, match="SpoolingWriter.write row 1: column mode"):
        writer.write(rows)
    assert writer.pending() == 0 and store.count(7) == 0


def test_flush_of_an_empty_spool_does_nothing(store, tmp_path):
    report = SpoolingWriter(store, str(tmp_path / "spool")).flush()
    assert (report.files, report.inserted) == (0, 0)


def test_the_spool_writes_rows_as_arrays_and_still_flushes_format_1_files(store, make_rows, tmp_path):
    import json

    from samples.columns import COLUMN_NAMES, SampleRow

    writer = SpoolingWriter(store, str(tmp_path / "spool"))
    name = writer.spool.append([SampleRow.of(r) for r in make_rows(3)])
    lines = open(os.path.join(writer.spool.dir, name), encoding="utf-8").read().splitlines()
    head = json.loads(lines[0])
    assert head["spool"] == 3 and head["columns"] == list(COLUMN_NAMES)
    assert json.loads(lines[1]) == [make_rows(1)[0][c] for c in COLUMN_NAMES]
    # a file an older writer left: header format 1, one JSON object per row
    old = os.path.join(writer.spool.dir, "000000000002.jsonl")
    with open(old, "w", encoding="utf-8") as f:
        f.write(json.dumps({"spool": 1, "seq": 2, "rows": 2, "runs": [7]}) + "\n")
        for r in make_rows(2, start=3):
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    assert writer.pending(7) == 5
    report = writer.flush()
    assert (report.files, report.inserted, report.torn_files) == (2, 5, [])
    assert store.recorded_request_ids(7) == {f"r7-{i}" for i in range(5)}


# ---- the gaps column, and spool files written before it ----------------------------------------


def _stored_gaps(store) -> dict[str, list[int]]:
    return dict(store.query("SELECT request_id, itl_gaps_us FROM samples FINAL WHERE run_id = 7"))


def test_gaps_round_trip_through_the_spool(store, make_rows, tmp_path):
    from samples.columns import SampleRow

    rows = make_rows(3)
    rows[1]["itl_gaps_us"] = []
    rows[2]["itl_gaps_us"] = [1, 2**32 - 1, 0]
    writer = SpoolingWriter(store, str(tmp_path / "spool"))
    writer.spool.append([SampleRow.of(r) for r in rows])
    _header, read, complete = writer.spool.read(writer.spool.pending_files()[0])
    assert complete and [r["itl_gaps_us"] for r in read] == [r["itl_gaps_us"] for r in rows]
    assert writer.flush().inserted == 3
    assert _stored_gaps(store) == {r["request_id"]: r["itl_gaps_us"] for r in rows}


def test_spool_files_written_before_the_gaps_flush_as_rows_without_gaps(store, make_rows, tmp_path):
    import json

    from samples.columns import COLUMN_NAMES
    from samples.spool import FORMAT_2_COLUMNS

    # format 2 is older than every added column (the gaps, gateway_ms, the answers' fingerprints
    # and texts)
    added = ("itl_gaps_us", "gateway_ms", "output_fp", "token_fps", "answer_text")
    assert len(FORMAT_2_COLUMNS) == len(COLUMN_NAMES) - len(added)
    assert not set(added) & set(FORMAT_2_COLUMNS)
    writer = SpoolingWriter(store, str(tmp_path / "spool"))
    older = make_rows(4)
    for r in older:
        for name in added:
            del r[name]  # what code before the gaps column wrote
    with open(os.path.join(writer.spool.dir, "000000000001.jsonl"), "w", encoding="utf-8") as f:
        f.write(json.dumps({"spool": 2, "seq": 1, "rows": 2, "runs": [7], "counts": {"7": 2}}) + "\n")
        for r in older[:2]:
            f.write(json.dumps([r[c] for c in FORMAT_2_COLUMNS], ensure_ascii=False) + "\n")
    with open(os.path.join(writer.spool.dir, "000000000002.jsonl"), "w", encoding="utf-8") as f:
        f.write(json.dumps({"spool": 1, "seq": 2, "rows": 2, "runs": [7]}) + "\n")
        for r in older[2:]:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    assert writer.pending(7) == 4
    report = writer.flush()
    assert (report.files, report.inserted, report.torn_files, report.lost) == (2, 4, [], 0)
    assert _stored_gaps(store) == {r["request_id"]: [] for r in older}
    assert store.query("SELECT DISTINCT output_fp, length(token_fps), answer_text FROM samples") == [
        (0, 0, "")
    ]


def test_spool_files_written_before_gateway_ms_flush_as_rows_without_gateway_time(store, make_rows, tmp_path):
    """Format 3 as code before migration 7 wrote it: its header names the columns of that time. A
    live row of then held the gateway's time in schedule_lag_ms; it is stored as it was spooled
    (the report reads a live row's schedule_lag_ms as the gateway's, analysis.definitions)."""
    import json

    from samples.columns import COLUMN_NAMES

    writer = SpoolingWriter(store, str(tmp_path / "spool"))
    older = make_rows(2) + make_rows(2, start=2, mode="live", schedule_lag_ms=0.5)
    then = [c for c in COLUMN_NAMES if c != "gateway_ms"]
    with open(os.path.join(writer.spool.dir, "000000000001.jsonl"), "w", encoding="utf-8") as f:
        head = {"spool": 3, "seq": 1, "rows": 4, "runs": [7], "counts": {"7": 4}, "columns": then}
        f.write(json.dumps(head) + "\n")
        for r in older:
            f.write(json.dumps([r[c] for c in then], ensure_ascii=False) + "\n")
    _header, read, complete = writer.spool.read("000000000001.jsonl")
    assert complete and [r["gateway_ms"] for r in read] == [0.0] * 4
    report = writer.flush()
    assert (report.files, report.inserted, report.torn_files, report.lost) == (1, 4, [], 0)
    got = store.query(
        f"SELECT request_id, mode, schedule_lag_ms, gateway_ms FROM {SAMPLES_FROM} "
        "WHERE run_id = 7 ORDER BY seq"
    )
    assert got == [
        ("r7-0", "split", 0.75, 0.0),
        ("r7-1", "split", 0.75, 0.0),
        ("r7-2", "live", 0.5, 0.0),
        ("r7-3", "live", 0.5, 0.0),
    ]
    assert writer.pending(7) == 0


def test_a_spool_file_of_newer_columns_is_quarantined_and_counted(store, make_rows, tmp_path):
    import json

    from samples.columns import COLUMN_NAMES

    writer = SpoolingWriter(store, str(tmp_path / "spool"))
    row = make_rows(1)[0]
    with open(os.path.join(writer.spool.dir, "000000000001.jsonl"), "w", encoding="utf-8") as f:
        cols = [*COLUMN_NAMES, "from_the_future"]
        f.write(
            json.dumps({"spool": 3, "seq": 1, "rows": 1, "runs": [7], "counts": {"7": 1}, "columns": cols})
        )
        f.write("\n" + json.dumps([*(row[c] for c in COLUMN_NAMES), 1]) + "\n")
    report = writer.flush()
    assert (report.inserted, report.lost, len(report.torn_files)) == (0, 1, 1)
