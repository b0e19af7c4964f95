"""A background writer: the replay's event loop hands rows over without waiting on storage.

Rows (samples.columns.SampleRow, from samples.rows.row_from) are batched (by size or age) and
written by one thread through ``write(rows)`` (the sample store's spooling writer), so a slow
insert never delays a scheduled send. ``close()`` drains everything. The sink retries nothing
itself: the spooling writer is the one retry policy for the store (an outage spools, a pause,
then a ping and a budgeted flush: samples.spool.SpoolingWriter); a write that still raises (the
spool's disk failing, a store that refuses rows) stops the sink and surfaces in ``put()`` and
``close()``, so the shard fails loudly, keeping the rows it could not write counted, and its
task's redelivery sends them again rather than dropping them.

Rows are validated a batch at a time, columnar, by the writer (samples.columns.validate_samples
in SpoolingWriter.write), not one by one where they are made (samples.rows.row_from checks only
its context values). A batch the writer refuses as invalid (SampleError) is not retried: the
sink checks its rows one at a time, writes every valid one, and fails the shard with an error
naming each bad row's request id, seq and variant, the column and the value (put() raises it
from then on, close() raises it after writing what it holds). No row is dropped silently.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from samples.batching import BatchQueue
from samples.columns import SampleError, validate_samples

log = logging.getLogger(__name__)


class InvalidRows(SampleError):
    """Rows of a batch that the writer refused as invalid; the batch's other rows were written."""

    def __init__(self, bad: Sequence[tuple[Any, str]], of: int) -> None:
        def name(row: Any) -> str:
            try:
                return f"request {row['request_id']!r} (seq {row['seq']!r}, variant {row['variant']!r})"
            except (KeyError, IndexError, TypeError):
                return "a row without a request id"

        shown = "; ".join(f"{name(row)}: {err}" for row, err in bad[:3])
        more = f"; and {len(bad) - 3} more" if len(bad) > 3 else ""
        super().__init__(
            f"{len(bad)} of {of} rows invalid, not written (the other {of - len(bad)} were): {shown}{more}"
        )
        self.rows = [row for row, _ in bad]


class BatchSink:
    def __init__(
        self, write: Callable[[Sequence[Any]], object], *, batch_size: int = 2000, max_age_s: float = 0.5
    ):
        self._write = write
        # No bound: a shard's rows are few next to a gateway's, and put() must never refuse one.
        self._queue = BatchQueue(batch_rows=batch_size, max_age_s=max_age_s)
        self._error: BaseException | None = None  # the first write that failed (_stop, _write_valid)
        self.written = 0
        self.batches = 0
        # In the creator's context: its log lines carry the shard's fields (telemetry/logs.py).
        self._thread = threading.Thread(
            target=contextvars.copy_context().run, args=(self._run,), name="abplat-sample-sink", daemon=True
        )
        self._thread.start()

    def put(self, row: Any) -> None:
        if self._error is not None:
            raise RuntimeError(f"sample writer failed: {self._error}") from self._error
        if not self._queue.put(row):
            raise RuntimeError("sample sink: put() after close()")

    def _run(self) -> None:
        while True:
            rows, closing = self._queue.take()
            if rows:
                try:
                    self._write(rows)
                    self.written += len(rows)
                    self.batches += 1
                    self._queue.done(len(rows))
                except SampleError as refused:  # permanent: writing the same rows again cannot help
                    if not self._write_valid(rows, refused):
                        return
                except Exception as exc:
                    self._stop(exc, rows)
                    return
            if closing and not self._queue.waiting():
                return

    def _stop(self, exc: BaseException, rows: list[Any]) -> None:
        """A write raised: keep the error for put() and close(); the rows stay in memory (taken,
        not done) for close() to count as not written."""
        log.error("writing %d samples failed: %s", len(rows), exc)
        self._error = self._error or exc

    def _write_valid(self, rows: list[Any], refused: SampleError) -> bool:
        """The writer refused ``rows`` as invalid (``refused``): write the valid ones, keep the
        error naming the bad ones for put() and close(). False: the valid rows could not be
        written either (the rows stay for close() to count)."""
        good, bad = [], []
        for row in rows:  # the writer's validator, one row at a time: every bad row, not the first
            try:
                validate_samples([row], "row")
            except SampleError as err:
                bad.append((row, str(err).split(": ", 1)[-1]))  # "column ... cannot hold ...: why"
            else:
                good.append(row)
        if not bad:  # the writer refused what the validator takes: refuse the batch, say why
            good, bad = [], [(row, str(refused)) for row in rows]
        error = InvalidRows(bad, len(rows))
        log.error("sample writer: %s", error)
        self._error = self._error or error
        self._queue.done(len(bad))  # given up on: counted by the error, not in memory
        try:
            if good:
                self._write(good)
                self.written += len(good)
                self.batches += 1
                self._queue.done(len(good))
        except Exception as exc:
            self._stop(exc, good)
            return False
        return True

    def close(self) -> int:
        """Write everything still buffered; raise if any batch could not be written."""
        self._queue.close()
        self._thread.join()
        if self._error is not None:
            invalid = len(self._error.rows) if isinstance(self._error, InvalidRows) else 0
            raise RuntimeError(
                f"sample writer failed with {self._queue.in_memory() + invalid} rows unwritten: {self._error}"
            ) from self._error
        return self.written
