"""The host's live recorder (gateway/recorder_process.py), in this process as function calls:
what it made durable is kept as an offset per queue file; a crash between a store write and the
offset's write duplicates nothing; a dead writer's file is drained and its run closed; with no
recorder the samples wait in the file; with the store down they go to the spool. Every test
runs on chDB and on the real ClickHouse server."""

from __future__ import annotations

import os

import pytest

from gateway import record_queue as rq
from gateway.models import LiveRun
from gateway.recorder_process import QueueRecorder
from gateway.recording import LiveRecorder
from tests.gateway.test_recording import record, stored
from tests.samples.conftest import physical, switch_off

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.engine]


@pytest.fixture(params=["chdb", "server"])
def store(request, shared_store):
    return shared_store(request.param)


def gateway_side(tmp_path) -> LiveRecorder:
    """A gateway process's recorder with no recorder of its own: it only appends to its file."""
    rec = LiveRecorder(worker="gw-test:1", spool_dir=str(tmp_path / "spool"), in_process=False, spawn=False)
    rec.start()
    return rec


def host_recorder(store, tmp_path, **kw) -> QueueRecorder:
    kw.setdefault("batch_rows", 10)
    kw.setdefault("flush_ms", 20.0)
    kw.setdefault("retry_s", 0.05)
    kw.setdefault("heartbeat_s", 0.05)
    return QueueRecorder(str(tmp_path / "spool"), store=store, **kw)


def test_the_recorder_keeps_its_offset_per_file_and_a_second_pass_writes_only_the_new_rows(store, tmp_path):
    gw = gateway_side(tmp_path)
    ids = [record(gw, i) for i in range(30)]
    assert gw.counts()["queued"] == 30  # nobody read them yet
    assert host_recorder(store, tmp_path).drain() is True
    state = rq.read_state(gw.dir, gw.run_id)
    assert state["offset"] == os.path.getsize(gw._queue.path) and state["seq"] == 30
    assert gw.counts() | {} == {**gw.counts(), "stored": 30, "queued": 0, "recorded": 30}

    ids += [record(gw, i) for i in range(30, 50)]
    assert host_recorder(store, tmp_path).drain() is True  # a second recorder: from the offset
    rows = stored(store, gw.run_id)
    assert [r["request_id"] for r in rows] == ids and [r["seq"] for r in rows] == list(range(1, 51))
    assert physical(store, gw.run_id) == (50, 50)
    assert rq.read_state(gw.dir, gw.run_id)["seq"] == 50


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the kill, on purpose
def test_a_recorder_killed_between_the_store_write_and_the_offset_write_duplicates_nothing(
    store, tmp_path, monkeypatch
):
    gw = gateway_side(tmp_path)
    ids = [record(gw, i) for i in range(25)]

    class Killed(BaseException):
        """The recorder dies here (as a SIGKILL would): nothing after it runs."""

    def die(*_a, **_k):
        raise Killed

    crashed = host_recorder(store, tmp_path, batch_rows=100)
    assert crashed.acquire()
    crashed.start()
    monkeypatch.setattr(rq, "write_state", die)  # the batch is stored, its offset never written
    crashed.read_once()
    assert crashed.loop.wait_stopped(60)  # its thread died at the offset's write
    crashed.release()  # the process is gone: its lock with it
    assert physical(store, gw.run_id) == (25, 25) and rq.read_state(gw.dir, gw.run_id) is None
    monkeypatch.undo()

    ids += [record(gw, i) for i in range(25, 40)]
    again = host_recorder(store, tmp_path)
    assert again.drain() is True  # reads the 25 again: spooled, and the flush skips them
    assert again.dirty
    assert [r["request_id"] for r in stored(store, gw.run_id)] == ids
    assert physical(store, gw.run_id) == (40, 40)
    assert again.writer.pending() == 0


def test_a_dead_writer_s_file_is_drained_its_run_closed_with_exact_counts_and_the_file_removed(
    store, tmp_path
):
    gw = gateway_side(tmp_path)
    ids = [record(gw, i) for i in range(17)]
    record(gw, 17, config_revision="three")  # rejected by the recorder: never a seq
    path = gw._queue.path
    gw._queue.close_fd()  # the process died: no closing record, its flock released
    assert host_recorder(store, tmp_path).drain() is True
    assert not os.path.exists(path) and rq.read_state(gw.dir, gw.run_id) is None
    run = LiveRun.for_run_id(gw.run_id)
    assert run.status == LiveRun.Status.CLOSED
    assert (run.recorded, run.stored, run.spooled, run.rejected, run.dropped) == (17, 17, 0, 1, 0)
    assert [r["request_id"] for r in stored(store, gw.run_id)] == ids
    assert [(r["run_id"], r["status"]) for r in store.runs("ttft-opt")] == [(gw.run_id, "done")]


def test_with_no_recorder_the_samples_wait_in_the_file_and_a_later_one_catches_up(store, tmp_path):
    gw = gateway_side(tmp_path)
    ids = [record(gw, i) for i in range(40)]
    assert not rq.recorder_running(gw.dir)
    assert gw.counts() == {
        "stored": 0,
        "spooled": 0,
        "rejected": 0,
        "queued": 40,
        "recorded": 40,
        "dropped": 0,
    }
    assert gw.close(timeout=0.05) is False  # nobody drains it: it says so, the file stays
    assert os.path.exists(gw._queue.path) and stored(store, gw.run_id) == []
    assert host_recorder(store, tmp_path).drain() is True
    assert [r["request_id"] for r in stored(store, gw.run_id)] == ids
    run = LiveRun.for_run_id(gw.run_id)
    assert (run.status, run.recorded, run.stored) == (LiveRun.Status.CLOSED, 40, 40)


def test_with_the_store_down_the_recorder_spools_and_a_later_pass_stores_each_sample_once(
    store, tmp_path, monkeypatch
):
    down = switch_off(store, monkeypatch)
    down.set()
    gw = gateway_side(tmp_path)
    ids = [record(gw, i) for i in range(30)]
    first = host_recorder(store, tmp_path)
    assert first.drain() is True
    assert gw.counts()["spooled"] == 30 and gw.counts()["queued"] == 0
    assert LiveRun.for_run_id(gw.run_id).spool_rows == 30
    down.clear()
    assert gw.close() is False  # no recorder running: the closing record waits in the file
    second = host_recorder(store, tmp_path)
    assert second.drain() is True  # flushes the spool at its start, then closes the run
    assert [r["request_id"] for r in stored(store, gw.run_id)] == ids
    assert physical(store, gw.run_id) == (30, 30)
    run = LiveRun.for_run_id(gw.run_id)
    assert (run.status, run.recorded, run.spooled, run.spool_rows) == (LiveRun.Status.CLOSED, 30, 30, 0)


def test_one_recorder_per_spool_directory(tmp_path, store):
    first, second = host_recorder(store, tmp_path), host_recorder(store, tmp_path)
    assert first.acquire() and not second.acquire()
    assert rq.recorder_running(first.dir) and rq.recorder_pid(first.dir) == os.getpid()
    first.release()
    assert second.acquire()
    second.release()
