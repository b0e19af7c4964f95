"""The replay's sample sink with the store's writer: rows are validated a batch at a time where they
are stored (samples.rows.row_from checks only its context values), and a bad row still fails the
shard with an error naming its request and column while every valid row is stored."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest

from replay.runner import ShardRunner, ShardSpec
from replay.sink import BatchSink
from replay.sources import TraceRequest
from samples.flush import InvalidRows
from samples.rows import row_from
from samples.spool import SpoolingWriter
from streaming.result import StreamResult
from tests.samples.test_rows import context, full_result


@pytest.fixture(params=["chdb", "server"])
def store(request, shared_store):
    return shared_store(request.param)  # the session's migrated database, empty (tests/sample_dbs.py)


def stored_seqs(store) -> list[int]:
    return sorted(int(rid.split("-")[1]) for rid in store.recorded_request_ids(7))


def test_a_bad_row_fails_the_shard_naming_its_request_and_column_and_every_other_row_is_stored(
    store, tmp_path
):
    writer = SpoolingWriter(store, str(tmp_path / "spool"))
    sink = BatchSink(writer.write, batch_size=10_000, max_age_s=30)  # one batch, written at close
    bad = {3: {"ttft_ms": math.inf}, 11: {"itl_gaps_us": [1, -2]}}
    for seq in range(20):
        sink.put(row_from(full_result(**bad.get(seq, {})), context(seq)))
    with pytest.raises(RuntimeError) as err:
        sink.close()
    message = str(err.value)
    assert (
        "2 rows unwritten" in message and "2 of 20 rows invalid, not written (the other 18 were)" in message
    )
    assert (
        "request 'r7-3' (seq 3, variant 'awq'): column ttft_ms (Nullable(Float64)) cannot hold inf" in message
    )
    assert (
        "request 'r7-11' (seq 11, variant 'awq'): column itl_gaps_us (Array(UInt32)) cannot hold [1, -2]"
        in (message)
    )
    assert isinstance(err.value.__cause__, InvalidRows)
    assert [row["seq"] for row in err.value.__cause__.rows] == [3, 11]
    assert stored_seqs(store) == [s for s in range(20) if s not in bad]  # none lost, none spooled
    assert writer.pending() == 0 and sink.written == 18


def test_after_a_bad_row_put_refuses_more_and_the_batch_is_not_retried():
    calls = []

    def write(rows):
        calls.append(len(rows))
        from samples.columns import validate_samples

        validate_samples(rows, "SpoolingWriter.write")

    sink = BatchSink(write, batch_size=3, max_age_s=30)
    for seq in range(3):  # a full batch: written now
        sink.put(row_from(full_result(ttft_ms=math.nan if seq == 1 else 21.5), context(seq)))
    deadline = time.monotonic() + 10
    while sink.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match=r"request 'r7-1' \(seq 1, variant 'awq'\): column ttft_ms"):
        sink.put(row_from(full_result(), context(9)))
    with pytest.raises(RuntimeError, match="1 rows unwritten"):
        sink.close()
    assert calls == [3, 2]  # the refused batch once, then its two valid rows; no retries


def test_a_write_that_raises_is_not_retried_by_the_sink_and_its_rows_are_counted_unwritten():
    """The spooling writer is the one retry policy (an outage spools there): what still raises
    stops the sink at once, and close() counts every row it could not write."""
    calls = []
    first_taken = threading.Event()

    def write(rows):
        calls.append(len(rows))
        first_taken.set()
        if len(calls) == 2:
            raise OSError("No space left on device: the spool's disk")

    sink = BatchSink(write, batch_size=2, max_age_s=30)
    for seq in (0, 1):
        sink.put(row_from(full_result(), context(seq)))
    assert first_taken.wait(10)  # the first batch is the writer's: the next two make the second
    for seq in (2, 3):
        sink.put(row_from(full_result(), context(seq)))
    assert sink.loop.wait_stopped(10)  # the sink's thread ends at the failure, without retrying
    with pytest.raises(RuntimeError, match="No space left"):
        sink.put(row_from(full_result(), context(4)))
    with pytest.raises(RuntimeError, match="with 2 rows unwritten: No space left"):
        sink.close()
    assert calls == [2, 2] and sink.written == 2  # the failing batch once, not retried


class _Client:
    """A streaming client returning a fixed result; seq 2's carries a value no column holds."""

    api = "completions"

    async def stream(self, request_id, prompt, max_tokens, extra=None):
        bad = request_id == "r7-2"
        return StreamResult(
            request_id=request_id,
            output_tokens=max_tokens,
            chunks=max_tokens,
            ttft_ms=1.0,
            e2e_ms=-math.inf if bad else 5.0,
            start_ns=time.perf_counter_ns(),
        )

    async def aclose(self):
        pass


def test_a_replay_with_a_bad_row_stores_the_others_and_its_sink_names_the_row(store, tmp_path):
    """As workers/shard.py wires them: runner -> sink.put -> the store's writer; the sink's
    close() is what fails the shard task."""
    reqs = [
        TraceRequest(seq=i, offset_s=0.0, user_id=f"u{i}", prompt_tokens=8, max_tokens=3) for i in range(6)
    ]
    spec = ShardSpec(
        experiment="ttft-opt",
        run_id=7,
        mode="split",
        requests=reqs,
        offsets=[0.0] * 6,
        start_at_unix=time.time(),
        concurrency=8,
        variants=["awq"],
    )
    writer = SpoolingWriter(store, str(tmp_path / "spool"))
    sink = BatchSink(writer.write, max_age_s=30)
    stats = asyncio.run(ShardRunner(spec, {"awq": _Client()}, lambda user: ("awq", 1), sink.put).run())
    assert stats.recorded == 6
    with pytest.raises(
        RuntimeError, match=r"request 'r7-2' \(seq 2, variant 'awq'\): column e2e_ms .* cannot hold -inf"
    ):
        sink.close()
    assert stored_seqs(store) == [0, 1, 3, 4, 5]
