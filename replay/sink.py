"""The replay's sample sink: the replay's event loop hands rows over without waiting on storage.

Rows (samples.columns.SampleRow, from samples.rows.row_from) go through a samples.flush.FlushLoop:
batched (by size or age; a batch takes every row waiting) and written by its thread through
``write(rows)`` (the sample store's spooling writer, or a wrapper of it), so a slow insert never
delays a scheduled send. ``close()`` drains everything. The sink retries nothing itself: the
spooling writer is the one retry policy for the store (an outage spools, a pause, then a ping
and a budgeted flush: samples.spool.SpoolingWriter), and the loop has no spill of its own here
(no ``spill_to``): a write that still raises (the spool's disk failing, a store that refuses
rows) stops the loop, surfaces in ``put()`` and ``close()``, so the shard fails loudly, keeping
the rows it could not write counted, and its task's redelivery sends them again rather than
dropping them.

Rows are validated a batch at a time, columnar, by the writer (samples.columns.validate_samples
in SpoolingWriter.write), not one by one where they are made (samples.rows.row_from checks only
its context values). An invalid row follows the loop's rule (samples.flush: the batch's valid
rows are written, the invalid ones counted and named in samples.flush.InvalidRows); the replay
then fails the shard: put() raises from then on, close() raises after writing what it holds,
naming each bad row's request id, seq and variant, the column and the value. No row is dropped
silently.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from samples.flush import FlushLoop

log = logging.getLogger(__name__)


class BatchSink:
    def __init__(
        self, write: Callable[[Sequence[Any]], object], *, batch_size: int = 2000, max_age_s: float = 0.5
    ):
        # No bound: a shard's rows are few next to a gateway's, and put() must never refuse one.
        self.loop = FlushLoop(batch_rows=batch_size, max_age_s=max_age_s, log=log, name="abplat-sample-sink")
        # In the creator's context: its log lines carry the shard's fields (telemetry/logs.py).
        self.loop.start(write)

    @property
    def error(self) -> BaseException | None:
        """What fails the shard: the write that stopped the loop, or the first invalid rows."""
        return self.loop.failure or self.loop.first_invalid

    @property
    def written(self) -> int:
        return self.loop.counts().written

    @property
    def batches(self) -> int:
        return self.loop.counts().batches

    def put(self, row: Any) -> None:
        error = self.error
        if error is not None:
            raise RuntimeError(f"sample writer failed: {error}") from error
        if not self.loop.put(row):
            raise RuntimeError("sample sink: put() after close()")

    def close(self) -> int:
        """Write everything still buffered; raise if any row could not be written."""
        self.loop.close()
        error = self.error
        if error is not None:
            counts = self.loop.counts()
            raise RuntimeError(
                f"sample writer failed with {counts.queued + counts.invalid} rows unwritten: {error}"
            ) from error
        return self.written
