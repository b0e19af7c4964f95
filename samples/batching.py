"""Batches of samples handed from the thread that measures to the thread that writes.

The one queue in front of the sample writer (samples.spool.SpoolingWriter), inside the flush
loop (samples/flush.py) that the replay's sample sink (replay/sink.py) and the live gateway's
recorder (gateway/recording.py) write through:

- ``put(item)`` on the measuring side (an event loop) never blocks and never raises: a queue
  that is full (``capacity`` items in memory) or closed refuses the item and counts it; the
  caller says what a refusal means (the gateway counts a dropped sample, the replay has no bound).
- ``take(limit)`` on the writing thread waits up to ``max_age_s`` for ``batch_rows`` items (less
  once closed) and hands over at most ``limit`` (all by default), oldest first.
- Items taken stay in memory until the writer says ``done(n)`` (written, or given up on) or
  ``give_back(items)`` (not handled: back to the front, in order), so ``capacity`` bounds the
  memory in use, not the queue alone, and ``in_memory()`` counts what a crash would take.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from typing import Any


class BatchQueue:
    def __init__(self, *, batch_rows: int, max_age_s: float, capacity: int | None = None) -> None:
        if batch_rows < 1 or max_age_s <= 0 or (capacity is not None and capacity < batch_rows):
            raise ValueError(
                f"BatchQueue: need batch_rows >= 1 (got {batch_rows}), max_age_s > 0 (got {max_age_s}) "
                f"and capacity >= batch_rows (got {capacity})"
            )
        self.batch_rows, self.max_age_s, self.capacity = batch_rows, max_age_s, capacity
        self._items: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self._taken = 0  # handed to the writer, not done yet
        self._closed = False
        self._refused_full = 0
        self._refused_closed = 0

    # ---- the measuring side --------------------------------------------------------------------

    def put(self, item: Any) -> bool:
        """Queue one item; False when refused (full or closed: counted, see refused())."""
        with self._cond:
            if self._closed:
                self._refused_closed += 1
                return False
            if self.capacity is not None and len(self._items) + self._taken >= self.capacity:
                self._refused_full += 1
                return False
            self._items.append(item)
            if len(self._items) == self.batch_rows:
                self._cond.notify()
            return True

    def close(self) -> None:
        """Refuse new items; wake the writer so it takes what is left without waiting."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ---- the writing thread -------------------------------------------------------------------

    def take(self, limit: int | None = None) -> tuple[list[Any], bool]:
        """The next batch (module docstring) and whether close() was called."""
        with self._cond:
            deadline = time.monotonic() + self.max_age_s
            while len(self._items) < self.batch_rows and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            n = len(self._items) if limit is None else min(len(self._items), limit)
            items = [self._items.popleft() for _ in range(n)]
            self._taken += n
            return items, self._closed

    def done(self, n: int) -> None:
        """``n`` taken items are handled (written, or given up on): their memory is free."""
        with self._cond:
            if n < 0 or n > self._taken:
                raise ValueError(f"BatchQueue.done({n}): only {self._taken} items are taken")
            self._taken -= n

    def give_back(self, items: Sequence[Any]) -> None:
        """Taken items not handled: back to the front of the queue, in their order."""
        with self._cond:
            if len(items) > self._taken:
                raise ValueError(f"BatchQueue.give_back: {len(items)} items, only {self._taken} taken")
            self._items.extendleft(reversed(items))
            self._taken -= len(items)

    # ---- counts ---------------------------------------------------------------------------------

    def in_memory(self) -> int:
        """Items queued or taken and not done."""
        with self._cond:
            return len(self._items) + self._taken

    def waiting(self) -> int:
        """Items queued, not taken yet."""
        with self._cond:
            return len(self._items)

    def refused(self, reset: bool = False) -> tuple[int, int]:
        """(refused because full, refused because closed) since the last reset."""
        with self._cond:
            got = (self._refused_full, self._refused_closed)
            if reset:
                self._refused_full = self._refused_closed = 0
            return got

    @property
    def closed(self) -> bool:
        return self._closed
