"""A background writer: the replay's event loop hands rows over without waiting on storage.

Rows (samples.columns.SampleRow, from replay.rows.row_from) are batched (by size or age) and
written by one thread through ``write(rows)`` (the sample store's spooling writer), so a slow insert never delays a scheduled send. ``close()``
drains everything; a write that raises is retried a bounded number of times and then
surfaces in ``close()`` so the shard fails loudly rather than dropping samples.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)


class BatchSink:
    def __init__(self, write: Callable[[Sequence[Any]], object], *,
                 batch_size: int = 2000, max_age_s: float = 0.5, retries: int = 3):  # fmt: skip
        self._write = write
        self.batch_size, self.max_age_s, self.retries = batch_size, max_age_s, retries
        self._rows: list[Any] = []
        self._cond = threading.Condition()
        self._closing = False
        self._error: BaseException | None = None
        self.written = 0
        self.batches = 0
        # In the creator's context: its log lines carry the shard's fields (telemetry/logs.py).
        self._thread = threading.Thread(
            target=contextvars.copy_context().run, args=(self._run,), name="abplat-sample-sink", daemon=True
        )
        self._thread.start()

    def put(self, row: Any) -> None:
        with self._cond:
            if self._error is not None:
                raise RuntimeError(f"sample writer failed: {self._error}") from self._error
            self._rows.append(row)
            if len(self._rows) >= self.batch_size:
                self._cond.notify()

    def _take(self) -> list[Any]:
        with self._cond:
            deadline = time.monotonic() + self.max_age_s
            while not self._closing and len(self._rows) < self.batch_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            rows, self._rows = self._rows, []
            return rows

    def _run(self) -> None:
        while True:
            rows = self._take()
            if rows:
                for attempt in range(1, self.retries + 1):
                    try:
                        self._write(rows)
                        self.written += len(rows)
                        self.batches += 1
                        break
                    except Exception as exc:  # surfaced to the shard in close()/put()
                        log.warning("writing %d samples failed (attempt %d): %s", len(rows), attempt, exc)
                        if attempt == self.retries:
                            with self._cond:
                                self._error = exc
                                # Keep the rows: close() reports them as not written.
                                self._rows = rows + self._rows
                            return
                        time.sleep(0.2 * attempt)
            with self._cond:
                if self._closing and not self._rows:
                    return

    def close(self) -> int:
        """Write everything still buffered; raise if any batch could not be written."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(
                f"sample writer failed with {len(self._rows)} rows unwritten: {self._error}"
            ) from self._error
        return self.written
