"""The one retry policy of sample writing (samples.spool.SpoolingWriter): after a store failure
writes spool without a store call for pause_s; then a ping before any flush; a flush of at most
flush_budget_s (or until its caller has other work), with new batches spooled behind the rest
until the spool is empty; nothing lost, nothing stored twice, the store sees samples in order.
The clock is the writer's, moved by hand."""

from __future__ import annotations

import threading

import pytest

from samples.spool import SpoolingWriter
from samples.store import StoreError, StoreUnavailable


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def switchable(store, tick: Clock | None = None):
    """(down, calls): while ``down`` is set the store's pings, inserts and key lookups raise
    StoreUnavailable; ``calls`` lists each call by name. With ``tick``, every insert moves the
    clock one second (a flush's files take time)."""
    down, calls = threading.Event(), []
    names = ("ping", "insert_columns", "insert_samples", "existing_keys")
    real = {n: getattr(store, n) for n in names}

    def wrap(name):
        def call(*a, **k):
            calls.append(name)
            if down.is_set():
                raise StoreUnavailable("the store is down (test)")
            if tick is not None and name.startswith("insert"):
                tick.now += 1.0
            return real[name](*a, **k)

        return call

    for n in names:
        setattr(store, n, wrap(n))
    return down, calls


def seqs(store) -> list[int]:
    return [s for (s,) in store.query("SELECT seq FROM samples WHERE run_id = 7 ORDER BY seq")]


def test_after_a_failure_writes_spool_without_a_store_call_until_the_pause_ends(store, make_rows, tmp_path):
    clock = Clock()
    writer = SpoolingWriter(store, str(tmp_path / "spool"), pause_s=5.0, clock=clock)
    down, calls = switchable(store)
    down.set()
    assert writer.write(make_rows(3, start=0)) == "spooled"
    assert writer.paused() and writer.spilling()
    calls.clear()
    clock.now = 4.9
    assert writer.write(make_rows(3, start=3)) == "spooled"
    assert calls == []  # no connect timeout per batch during an outage
    clock.now = 5.0
    assert not writer.paused()
    assert writer.write(make_rows(3, start=6)) == "spooled"  # tried: a ping, still down
    assert calls == ["ping"] and writer.paused()  # one ping, not a flush's inserts
    down.clear()
    clock.now = 10.0
    assert writer.write(make_rows(3, start=9)) == "stored"
    assert seqs(store) == list(range(12)) and writer.pending() == 0


def test_retry_pings_first_and_pauses_again_when_the_store_is_still_away(store, make_rows, tmp_path):
    clock = Clock()
    writer = SpoolingWriter(store, str(tmp_path / "spool"), pause_s=2.0, clock=clock)
    writer.spill(make_rows(4))
    down, calls = switchable(store)
    down.set()
    assert writer.retry() is None
    assert calls == ["ping"] and writer.paused() and writer.pending() == 4
    down.clear()
    report = writer.retry()  # an explicit retry does not wait for the pause
    assert report is not None and report.inserted == 4 and not writer.spilling()
    assert writer.retry().files == 0  # an empty spool: nothing to do, the store is up


def test_a_flush_stops_at_its_budget_and_new_batches_queue_behind_the_spool(store, make_rows, tmp_path):
    clock = Clock()
    writer = SpoolingWriter(store, str(tmp_path / "spool"), pause_s=5.0, flush_budget_s=2.0, clock=clock)
    for i in range(5):
        writer.spill(make_rows(2, start=2 * i))  # 5 files of a long outage
    switchable(store, tick=clock)  # each insert takes a second
    report = writer.retry()
    assert report.files == 2 and writer.draining and writer.spilling() and not writer.paused()
    assert writer.write(make_rows(2, start=10)) == "spooled"  # behind the rest: order kept
    assert writer.pending() == 4
    while writer.draining:
        writer.retry()
    assert writer.pending() == 0 and not writer.spilling()
    assert writer.write(make_rows(2, start=12)) == "stored"
    assert seqs(store) == list(range(14))


def test_a_flush_stops_after_a_file_when_its_caller_has_other_work(store, make_rows, tmp_path):
    writer = SpoolingWriter(store, str(tmp_path / "spool"), flush_budget_s=3600.0, clock=Clock())
    for i in range(3):
        writer.spill(make_rows(2, start=2 * i))
    report = writer.retry(stop=lambda: True)
    assert report.files == 1 and writer.draining and writer.pending() == 4


def test_a_store_that_refuses_a_spooled_batch_pauses_and_keeps_it(store, make_rows, tmp_path):
    clock = Clock()
    writer = SpoolingWriter(store, str(tmp_path / "spool"), pause_s=5.0, clock=clock)
    writer.spill(make_rows(3))

    def refuse(rows):
        raise StoreError("Code: 60, table samples does not exist (test)")

    store.insert_samples = refuse
    with pytest.raises(StoreError, match="does not exist"):
        writer.retry()
    assert writer.paused() and writer.pending() == 3  # kept for a human, tried again later


def test_pause_and_budget_must_not_be_negative(store, tmp_path):
    with pytest.raises(ValueError, match="pause_s"):
        SpoolingWriter(store, str(tmp_path / "spool"), pause_s=-1.0)
