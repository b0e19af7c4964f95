"""The flush loop of samples rows (samples/flush.py), the one the replay's sink and the live
recorder both write through: batches by size and by age; a put() that never blocks, and a full
queue that refuses and counts; the one rule for an invalid row; a failed write that stops the
loop (no spill_to) or is spilled and retried (spill_to), every spooled row stored exactly once
when the store is back; close() that writes or spills what is queued. Every accepted row is
accounted for: accepted = stored + spooled + invalid + queued. The tests with a store run on chDB
and on the real ClickHouse server."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import pytest

from samples.columns import validate_samples
from samples.flush import Built, FlushCounts, FlushHooks, FlushLoop, InvalidRows
from samples.spool import SpoolingWriter
from samples.store import StoreError
from tests.samples.conftest import hang_inserts, physical, sample_row, switch_off, wait_until


def accounted(counts: FlushCounts, accepted: int) -> bool:
    return counts.stored + counts.spooled + counts.invalid + counts.queued == accepted


class Batches:
    """A write that keeps each batch it is given (validated as the store's writer does); while
    ``gate`` is clear a write waits for it (a hung store)."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, rows) -> str:
        self.entered.set()
        self.gate.wait()
        validate_samples(rows, "SpoolingWriter.write")
        self.batches.append([r["seq"] for r in rows])
        return "stored"


class Heard(FlushHooks):
    """Keeps what the loop tells its owner."""

    def __init__(self) -> None:
        self.wrote: list[tuple[list[int], str]] = []
        self.refused: list[InvalidRows] = []

    def written(self, rows, where) -> None:
        self.wrote.append(([r["seq"] for r in rows], where))

    def invalid(self, error) -> None:
        self.refused.append(error)


# ---- batching ------------------------------------------------------------------------------------


def test_a_batch_leaves_when_it_has_batch_rows_rows_without_waiting_for_its_age():
    write = Batches()
    loop = FlushLoop(batch_rows=3, max_age_s=3600.0, max_batch_rows=3)
    loop.start(write)
    for seq in range(7):
        assert loop.put(sample_row(seq)) is True
    wait_until(lambda: len(write.batches) == 2, "two full batches written")
    time.sleep(0.1)
    assert write.batches == [[0, 1, 2], [3, 4, 5]]  # the 7th waits for two more, or its age
    assert loop.counts().queued == 1
    assert loop.close() is True
    assert write.batches == [[0, 1, 2], [3, 4, 5], [6]]  # close() writes what waits
    assert loop.counts() == FlushCounts(
        stored=7, spooled=0, invalid=0, queued=0, refused_full=0, refused_closed=0, batches=3
    )


def test_a_batch_leaves_after_max_age_s_however_few_rows_it_has():
    write = Batches()
    loop = FlushLoop(batch_rows=1000, max_age_s=0.05)
    loop.start(write)
    loop.put(sample_row(0))
    loop.put(sample_row(1))
    wait_until(lambda: write.batches == [[0, 1]], "the two rows written by age, before close()")
    assert loop.close() is True


def test_max_batch_rows_caps_a_batch_and_without_it_a_batch_takes_every_row_waiting():
    for cap, expected in ((4, [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9]]), (None, [[0], list(range(1, 10))])):
        write = Batches()
        write.gate.clear()
        loop = FlushLoop(batch_rows=1, max_age_s=3600.0, max_batch_rows=cap)
        loop.start(write)
        loop.put(sample_row(0))
        assert write.entered.wait(10)  # row 0's write holds the thread: the rest wait together
        for seq in range(1, 10):
            loop.put(sample_row(seq))
        write.gate.set()
        assert loop.close() is True
        assert write.batches == expected


# ---- the request path ----------------------------------------------------------------------------


def test_a_full_queue_refuses_put_at_once_and_counts_it_and_so_does_a_closed_one():
    write = Batches()
    write.gate.clear()  # the store hangs: the first batch stays in memory, taken
    loop = FlushLoop(batch_rows=2, max_age_s=3600.0, capacity=5)
    loop.start(write)
    assert loop.put(sample_row(0)) and loop.put(sample_row(1))
    assert write.entered.wait(10)
    began = time.monotonic()
    taken = [loop.put(sample_row(seq)) for seq in range(2, 9)]
    assert time.monotonic() - began < 0.5  # never waits on the hung store
    assert taken == [True, True, True, False, False, False, False]  # 2 taken + 3 queued = capacity
    counts = loop.counts()
    assert (counts.queued, counts.refused_full, counts.refused_closed) == (5, 4, 0)
    write.gate.set()
    assert loop.close() is True
    assert loop.put(sample_row(9)) is False  # after close: refused, counted apart
    counts = loop.counts()
    assert (counts.stored, counts.queued, counts.refused_full, counts.refused_closed) == (5, 0, 4, 1)
    assert [seq for batch in write.batches for seq in batch] == [0, 1, 2, 3, 4]
    assert accounted(counts, accepted=5)


def test_put_before_start_queues_and_start_writes_it():
    write = Batches()
    loop = FlushLoop(batch_rows=10, max_age_s=3600.0)
    assert loop.put(sample_row(0)) is True
    assert loop.counts().queued == 1
    loop.start(write)
    assert loop.close() is True and write.batches == [[0]]


# ---- the invalid-row rule ------------------------------------------------------------------------


@pytest.mark.parametrize("spill", [False, True])
def test_an_invalid_row_is_counted_and_named_never_retried_and_the_batch_s_valid_rows_are_written(
    spill, store, tmp_path
):
    writer = SpoolingWriter(store, str(tmp_path / "spool"))
    calls: list[int] = []

    def write(rows):
        calls.append(len(rows))
        return writer.write(rows)

    heard = Heard()
    loop = FlushLoop(batch_rows=5, max_age_s=3600.0, capacity=100 if spill else None, max_batch_rows=5)
    loop.start(write, spill_to=writer if spill else None, hooks=heard)
    bad = {1: {"ttft_ms": math.inf}, 3: {"itl_gaps_us": [1, -2]}}
    for seq in range(5):  # one batch
        loop.put(sample_row(seq, **bad.get(seq, {})))
    for seq in range(5, 10):  # the loop goes on: the next batch is written
        loop.put(sample_row(seq))
    assert loop.close() is True
    assert calls == [5, 3, 5]  # the refused batch once, its 3 valid rows, the next batch
    [error] = heard.refused
    assert [row["seq"] for row in error.rows] == [1, 3] and loop.first_invalid is error
    assert "2 of 5 rows invalid, not written (the other 3 were)" in str(error)
    assert "request 'r7-1' (seq 1, variant 'awq'): column ttft_ms (Nullable(Float64)) cannot hold inf" in str(
        error
    )
    assert heard.wrote == [([0, 2, 4], "store"), ([5, 6, 7, 8, 9], "store")]
    counts = loop.counts()
    assert (counts.stored, counts.invalid, counts.queued) == (8, 2, 0) and accounted(counts, accepted=10)
    assert seqs(store) == [0, 2, 4, 5, 6, 7, 8, 9]


def test_a_batch_the_writer_refuses_though_each_row_passes_the_validator_is_refused_whole():
    from samples.columns import SampleError

    def write(rows):
        raise SampleError("the writer says no")

    loop = FlushLoop(batch_rows=2, max_age_s=3600.0)
    loop.start(write)
    loop.put(sample_row(0))
    loop.put(sample_row(1))
    assert loop.close() is True
    assert loop.counts().invalid == 2 and loop.first_invalid is not None
    assert "2 of 2 rows invalid" in str(loop.first_invalid) and "the writer says no" in str(
        loop.first_invalid
    )


def test_items_the_owner_cannot_build_are_counted_invalid_and_items_left_are_written_later():
    class Odd(FlushHooks):
        """Odd seqs cannot become a row; the first batch leaves its last item for later."""

        def __init__(self) -> None:
            self.first = True

        def rows(self, items):
            keep, left = (items[:-1], items[-1:]) if self.first else (items, [])
            self.first = False
            rows = [row for row in keep if row["seq"] % 2 == 0]
            return Built([rows], invalid=len(keep) - len(rows), left=left)

    write = Batches()
    loop = FlushLoop(batch_rows=4, max_age_s=3600.0)
    loop.start(write, hooks=Odd())
    for seq in range(4):
        loop.put(sample_row(seq))
    assert loop.close() is True
    assert write.batches == [[0, 2]]  # seq 3, given back, came again: odd, so invalid too
    counts = loop.counts()
    assert (counts.stored, counts.invalid, counts.queued) == (2, 2, 0) and accounted(counts, accepted=4)


# ---- a failed write ------------------------------------------------------------------------------


def test_without_spill_to_a_failed_write_stops_the_loop_and_its_rows_stay_counted_in_memory():
    calls: list[int] = []

    def write(rows):
        calls.append(len(rows))
        if len(calls) == 2:
            raise OSError("No space left on device")
        return "stored"

    loop = FlushLoop(batch_rows=2, max_age_s=3600.0)
    loop.start(write)
    for seq in range(2):
        loop.put(sample_row(seq))
    wait_until(lambda: loop.counts().stored == 2, "the first batch written")
    for seq in range(2, 6):
        loop.put(sample_row(seq))
    assert loop.wait_stopped(10)  # stopped at the failure, not retrying
    assert isinstance(loop.failure, OSError)
    assert loop.close() is False
    counts = loop.counts()
    assert calls == [2, 4] and (counts.stored, counts.queued) == (2, 4) and accounted(counts, accepted=6)


def seqs(store) -> list[int]:
    return [s for (s,) in store.query("SELECT seq FROM samples WHERE run_id = 7 ORDER BY seq")]


def test_with_spill_to_the_store_down_spools_and_the_loop_s_retry_stores_every_row_exactly_once(
    store, tmp_path, monkeypatch
):
    down = switch_off(store, monkeypatch)
    writer = SpoolingWriter(store, str(tmp_path / "spool"), pause_s=0.05)
    heard = Heard()
    loop = FlushLoop(batch_rows=5, max_age_s=0.02, capacity=1000)
    loop.start(writer.write, spill_to=writer, hooks=heard)
    for seq in range(10):
        loop.put(sample_row(seq))
    wait_until(lambda: loop.counts().stored == 10, "the first 10 stored")
    down.set()
    for seq in range(10, 30):
        loop.put(sample_row(seq))
    wait_until(lambda: loop.counts().spooled == 20, "the 20 spooled while the store is down")
    assert writer.spool.pending_files()
    down.clear()  # back: the loop's retry flushes the spool; new rows go to the store
    for seq in range(30, 40):
        loop.put(sample_row(seq))
    wait_until(lambda: not writer.spool.pending_files() and len(seqs(store)) == 40, "all stored")
    assert loop.close() is True
    assert seqs(store) == list(range(40)) and physical(store, 7) == (40, 40)  # none lost, none twice
    counts = loop.counts()
    assert counts.stored + counts.spooled == 40 and counts.spooled >= 20 and accounted(counts, accepted=40)
    assert sum(len(rows) for rows, where in heard.wrote if where == "spool") == counts.spooled


def test_with_spill_to_a_batch_the_store_refuses_is_spilled_and_the_writer_paused(
    store, tmp_path, monkeypatch
):
    refusing = switch_off(store, monkeypatch, error=StoreError)
    refusing.set()
    writer = SpoolingWriter(store, str(tmp_path / "spool"), pause_s=3600.0)
    loop = FlushLoop(batch_rows=3, max_age_s=3600.0, capacity=100)
    loop.start(writer.write, spill_to=writer)
    for seq in range(6):
        loop.put(sample_row(seq))
    wait_until(lambda: loop.counts().spooled == 6, "both batches spooled")
    assert writer.paused()  # the second batch went straight to the spool, no store call
    assert loop.close() is True and loop.failure is None
    refusing.clear()
    writer.flush()  # what a human does once the store takes rows again
    assert seqs(store) == list(range(6)) and physical(store, 7) == (6, 6)


def test_with_spill_to_a_batch_the_spool_cannot_take_either_is_tried_again_not_lost(
    store, tmp_path, monkeypatch
):
    writer = SpoolingWriter(store, str(tmp_path / "spool"), pause_s=0.01)
    real_spill, real_write = writer.spill, writer.write
    failures = {"left": 3}

    def failing(real):
        def call(rows):
            if failures["left"] > 0:
                failures["left"] -= 1
                raise OSError("No space left on device: the spool's disk")
            return real(rows)

        return call

    monkeypatch.setattr(writer, "spill", failing(real_spill))
    monkeypatch.setattr(writer, "write", failing(real_write))
    loop = FlushLoop(batch_rows=4, max_age_s=3600.0, capacity=100)
    loop.start(writer.write, spill_to=writer)
    for seq in range(4):
        loop.put(sample_row(seq))
    assert loop.close() is True  # closing: the loop keeps trying until the batch is written
    counts = loop.counts()
    assert failures["left"] == 0 and counts.stored + counts.spooled == 4 and counts.queued == 0
    writer.flush()
    assert seqs(store) == [0, 1, 2, 3] and physical(store, 7) == (4, 4)


# ---- close ---------------------------------------------------------------------------------------


def test_close_writes_every_queued_row():
    write = Batches()
    loop = FlushLoop(batch_rows=1000, max_age_s=3600.0)  # nothing leaves before close()
    loop.start(write)
    for seq in range(123):
        loop.put(sample_row(seq))
    assert loop.counts().queued == 123
    assert loop.close() is True
    assert write.batches == [list(range(123))] and loop.counts().queued == 0


def test_with_spill_to_close_spills_what_is_left_after_half_its_timeout(store, tmp_path, monkeypatch):
    entered, gate = hang_inserts(store, monkeypatch)
    writer = SpoolingWriter(store, str(tmp_path / "spool"))
    loop = FlushLoop(batch_rows=5, max_age_s=3600.0, capacity=1000)
    loop.start(writer.write, spill_to=writer)
    for seq in range(5):
        loop.put(sample_row(seq))
    assert entered.wait(10)  # the first batch is in an insert that does not return
    for seq in range(5, 12):
        loop.put(sample_row(seq))
    assert loop.close(timeout=0.2) is False  # still inside the store call: logged, goes on
    gate.set()
    assert loop.wait_stopped(10)
    counts = loop.counts()
    assert (counts.stored, counts.spooled, counts.queued) == (5, 7, 0)  # the rest went to the spool
    writer.flush()
    assert seqs(store) == list(range(12)) and physical(store, 7) == (12, 12)


# ---- starting ------------------------------------------------------------------------------------


def test_start_raises_what_the_owner_s_starting_raised_and_may_be_called_again():
    class Once(FlushHooks):
        def __init__(self) -> None:
            self.tries = 0

        def starting(self) -> None:
            self.tries += 1
            if self.tries == 1:
                raise RuntimeError("the database is down")

    hooks, write = Once(), Batches()
    loop = FlushLoop(batch_rows=10, max_age_s=3600.0)
    with pytest.raises(RuntimeError, match="the database is down"):
        loop.start(write, hooks=hooks)
    loop.put(sample_row(0))
    loop.start(write, hooks=hooks)
    assert loop.close() is True and write.batches == [[0]] and hooks.tries == 2
