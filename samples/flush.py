"""The flush loop of samples rows: the measuring side queues, one thread writes in batches.

The replay's sample sink (replay/sink.py) and the live gateway's recorder (gateway/recording.py)
both write their rows through a FlushLoop:

- ``put(item)`` on the measuring side (an event loop, the gateway's request path) never blocks
  and never raises: the item joins a samples.batching.BatchQueue. A queue that is full
  (``capacity`` items in memory) or closed refuses it, counts it (FlushCounts.refused_full,
  .refused_closed) and put() says False; the owner says what a refusal means.
- ``start(write, ...)`` starts one thread. It takes a batch (``batch_rows`` items, or what waits
  after ``max_age_s``; at most ``max_batch_rows``), turns the items into rows (FlushHooks.rows:
  the items themselves for an owner that queues rows) and writes the batches in order through
  ``write``: the sample store's spooling writer (samples.spool.SpoolingWriter.write, which
  stores a batch, or spools it while the store is down, and owns the store's retry policy), or
  a wrapper of it. ``write`` returns "spooled" for a batch it spooled, anything else for a
  stored one.
- ``close(timeout)`` refuses new items and writes every queued one; True once all are written.

An invalid row (the one rule): a batch the writer refuses as invalid (samples.columns.SampleError)
is never retried as it is. The loop checks its rows one at a time with the writer's validator,
writes the valid ones, and sets the invalid ones aside: counted (FlushCounts.invalid), logged,
kept in ``first_invalid`` (the first InvalidRows, naming each bad row's request, column and
value) and told to FlushHooks.invalid. A row the owner could not build at all (FlushHooks.rows:
Built.invalid) is counted the same way. No row is silently dropped.

A write that raises otherwise (a store that refuses rows for good, the spool's disk failing):
- Without ``spill_to`` the loop stops at once: ``failure`` keeps the error, the batch stays
  counted in memory (FlushCounts.queued) and nothing is written after it. For an owner with a
  retry of its own: a replay's shard fails loudly and its task's redelivery sends the rows again.
- With ``spill_to`` (the spooling writer itself: the live gateway, which has nobody to retry for
  it) the loop never stops. A batch the store refused is spilled to the spool (kept there for a
  human) and the writer paused; a batch the spool cannot take either is tried again after the
  writer's pause, while new items keep queueing (bounded by ``capacity``). The loop also spills
  (SpoolingWriter.spill, no store call) while the writer is spilling (paused after a failure,
  or draining its spool) or the queue is at its high-water mark (half the capacity: the store
  is slow), taking up to SPILL_BATCHES batches at a time (fewer fsyncs), so the queue drains at
  the local disk's speed whatever the store does; and it retries the spool (SpoolingWriter.retry)
  once the writer's pause is over or while it drains, stopping a flush early when the queue is
  at its high-water mark. After half of close()'s timeout, what is left goes straight to the spool.

Counts (``counts()``): every item put() accepted is stored, spooled, invalid, or still in memory
(``queued``: waiting, or taken and not written yet): accepted = stored + spooled + invalid + queued.
"""

from __future__ import annotations

import collections
import contextvars
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from samples.batching import BatchQueue
from samples.columns import SampleError, validate_samples

if TYPE_CHECKING:
    from samples.spool import SpoolingWriter

log = logging.getLogger(__name__)

# While the loop spills, a batch takes up to this many batches' worth of items: one spool file
# (one fsync) for many rows while the queue drains at the disk's speed.
SPILL_BATCHES = 20
START_TIMEOUT_S = 30.0


class InvalidRows(SampleError):
    """Rows of a batch the writer refused as invalid; the batch's other rows were written."""

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


@dataclasses.dataclass(frozen=True)
class Built:
    """What FlushHooks.rows made of a batch of items."""

    batches: list[list[Any]]  # rows to write, in order (one item, one row)
    invalid: int = 0  # items that could not become a row: the hook said why; counted as invalid
    left: Sequence[Any] = ()  # the batch's last items, not handled now: back to the queue's front


class FlushHooks:
    """What a FlushLoop's owner does on the loop's thread. Every method does nothing (rows: the
    items are the rows) unless the owner's subclass says otherwise."""

    def starting(self) -> None:
        """Before start() returns (start() waits for it); raising ends the thread, and start()
        raises the error."""

    def started(self) -> None:
        """After start() returned, before the first batch."""

    def rows(self, items: list[Any]) -> Built:
        """The rows of a batch of items, in order."""
        return Built([items])

    def written(self, rows: list[Any], where: str) -> None:
        """``rows`` were written: ``where`` is "store" or "spool"."""

    def invalid(self, error: InvalidRows) -> None:
        """The writer refused ``error.rows`` as invalid: they will not be written."""

    def tick(self) -> None:
        """After each pass (a batch taken and written, or the wait for one over)."""

    def drained(self) -> None:
        """close() was called and every item was written."""

    def stopped(self) -> None:
        """Last on the thread, whatever ended it."""


@dataclasses.dataclass(frozen=True)
class FlushCounts:
    """A FlushLoop's rows so far (module docstring: accepted = stored + spooled + invalid + queued)."""

    stored: int
    spooled: int
    invalid: int
    queued: int  # in memory: waiting, or taken and not written yet
    refused_full: int  # put() refused: the queue held ``capacity`` items
    refused_closed: int  # put() refused: after close()
    batches: int  # writes that succeeded

    @property
    def written(self) -> int:
        return self.stored + self.spooled


class FlushLoop:
    """One thread writing queued samples rows in batches (module docstring). ``log`` is the
    owner's logger: the loop's lines carry its name."""

    def __init__(
        self,
        *,
        batch_rows: int,
        max_age_s: float,
        capacity: int | None = None,
        max_batch_rows: int | None = None,
        log: logging.Logger = log,
        name: str = "abplat-sample-flush",
    ) -> None:
        if max_batch_rows is not None and max_batch_rows < 1:
            raise ValueError(f"FlushLoop: max_batch_rows must be >= 1 (got {max_batch_rows})")
        self._queue = BatchQueue(batch_rows=batch_rows, max_age_s=max_age_s, capacity=capacity)
        self.batch_rows, self.max_batch_rows = batch_rows, max_batch_rows
        # with spill_to: at this depth the store is too slow for the queue, so the loop spills
        self.high_water = max(batch_rows, capacity // 2) if capacity is not None else None
        self.name = name
        self._log = log
        self._write: Callable[[Sequence[Any]], object] | None = None
        self._spill_to: SpoolingWriter | None = None
        self._hooks = FlushHooks()
        self._held: collections.deque[list[Any]] = collections.deque()  # rows built, not written yet
        self._stored = self._spooled = self._invalid = self._batches = 0
        self.failure: BaseException | None = None  # the write that stopped the loop (no spill_to)
        self.first_invalid: InvalidRows | None = None
        self._close_by = float("inf")  # monotonic: from then on, with spill_to, spill what is left
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._drained = threading.Event()

    # ---- the measuring side ----------------------------------------------------------------------

    def put(self, item: Any) -> bool:
        """Queue one item; False when refused (full or closed), counted. Never blocks or raises."""
        return self._queue.put(item)

    # ---- the owner's side --------------------------------------------------------------------------

    def start(
        self,
        write: Callable[[Sequence[Any]], object],
        *,
        spill_to: SpoolingWriter | None = None,
        hooks: FlushHooks | None = None,
        timeout: float = START_TIMEOUT_S,
    ) -> None:
        """Start the thread, writing through ``write`` (module docstring), and wait for
        ``hooks.starting()``; raise what it raised (start() may then be called again). The
        thread runs in the caller's context (its log lines carry the caller's fields,
        telemetry/logs.py). A second call while the thread runs does nothing."""
        if self._thread is not None:
            return
        self._write, self._spill_to = write, spill_to
        self._hooks = hooks if hooks is not None else FlushHooks()
        self._started.clear()
        self._start_error = None
        self._thread = threading.Thread(
            target=contextvars.copy_context().run, args=(self._run,), name=self.name, daemon=True
        )
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError(f"{self.name}: starting took over {timeout:g} s")
        if self._start_error is not None:
            self._thread = None
            raise self._start_error

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new items and write every queued one. True when all were written within
        ``timeout`` (None: however long it takes); False when the loop stopped at a failed write
        (``failure``), or (logged) when its thread is still writing after ``timeout``: it goes
        on, to the spool, as long as the process lives."""
        if timeout is not None:
            self._close_by = time.monotonic() + timeout / 2
        self._queue.close()
        if self._thread is None:
            return not self._queue.waiting()
        self._thread.join(timeout)
        if self._thread.is_alive() and not self._drained.is_set():
            self._log.error("%d samples not written yet after %g s; still trying", self.queued(), timeout)
            return False
        return self._drained.is_set()

    def wait_stopped(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end (after close(), or at a failed write); True once it has."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def queued(self) -> int:
        """Items in memory: waiting, or taken and not written yet."""
        return self._queue.in_memory()

    def counts(self) -> FlushCounts:
        full, closed = self._queue.refused()
        return FlushCounts(
            stored=self._stored,
            spooled=self._spooled,
            invalid=self._invalid,
            queued=self._queue.in_memory(),
            refused_full=full,
            refused_closed=closed,
            batches=self._batches,
        )

    def retry_spool(self) -> None:
        """On the loop's thread, with spill_to: flush the spool through the writer's retry (a ping,
        then at most its flush budget), stopping after a file once the queue is at its high-water
        mark (this thread must keep taking what arrives meanwhile). A failure is logged: the
        writer paused, the next retry is due after its pause."""
        if self._spill_to is None:
            return
        high_water = self.high_water
        try:
            self._spill_to.retry(stop=None if high_water is None else lambda: self.queued() >= high_water)
        except Exception:
            self._log.exception("flushing the spool failed")

    # ---- the thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            try:
                self._hooks.starting()
            except BaseException as exc:
                self._start_error = exc
                return
            finally:
                self._started.set()
            self._hooks.started()
            while True:
                items, closing = self._take()
                if items:
                    self._build(items)
                if not self._write_held(closing):
                    return  # stopped at a failed write (no spill_to): counted, in memory
                if self._retry_due():
                    self.retry_spool()
                self._hooks.tick()
                if closing and not items and not self._held and not self._queue.waiting():
                    break
            self._drained.set()
            self._hooks.drained()
        except BaseException:  # pragma: no cover - the thread must say why it stopped
            self._log.exception("the flush thread stopped; samples stay queued")
            raise
        finally:
            self._hooks.stopped()

    def _take(self) -> tuple[list[Any], bool]:
        """The next batch and whether close() was called; larger while the loop spills."""
        limit = self.batch_rows * SPILL_BATCHES if self._spilling() else self.max_batch_rows
        return self._queue.take(limit=limit)

    def _build(self, items: list[Any]) -> None:
        built = self._hooks.rows(items)
        if built.left:
            self._queue.give_back(built.left)
        if built.invalid:
            self._invalid += built.invalid
            self._queue.done(built.invalid)
        self._held.extend(batch for batch in built.batches if batch)

    def _spilling(self) -> bool:
        """With spill_to: batches go to the spool now (the writer spills, or the queue is deep)."""
        writer = self._spill_to
        if writer is None:
            return False
        deep = self.high_water is not None and self._queue.in_memory() >= self.high_water
        return writer.spilling() or deep

    def _retry_due(self) -> bool:
        """With spill_to: the writer drains its spool, or its pause after a failure is over and
        the spool holds batches: time to try the store again."""
        writer = self._spill_to
        if writer is None:
            return False
        return writer.draining or (not writer.paused() and bool(writer.spool.pending_files()))

    def _write_held(self, closing: bool) -> bool:
        """Write the built batches in order (module docstring). False: the loop stops (a write
        failed, no spill_to); the batches stay held, counted in memory."""
        assert self._write is not None
        while self._held:
            batch = self._held[0]
            spill = self._spilling() or (
                closing and self._spill_to is not None and time.monotonic() >= self._close_by
            )
            try:
                if spill:
                    assert self._spill_to is not None
                    self._spill_to.spill(batch)
                    where = "spool"
                else:
                    where = "spool" if self._write(batch) == "spooled" else "store"
            except SampleError as refused:  # permanent: writing the same rows again cannot help
                self._set_aside_invalid(batch, refused)
                continue
            except Exception as exc:
                if self._spill_to is None:
                    self._log.error("writing %d samples failed: %s", len(batch), exc)
                    self.failure = self.failure or exc
                    return False
                if not spill and self._spill_refused(exc, batch):
                    where = "spool"
                else:
                    pause_s = self._spill_to.pause_s
                    self._log.error(
                        "%d samples could not be written (%s); retrying in %g s", len(batch), exc, pause_s
                    )
                    self._spill_to.pause()
                    time.sleep(min(pause_s, 1.0))  # the disk failing: no busy loop of errors
                    if not closing:
                        return True
                    continue
            self._held.popleft()
            self._queue.done(len(batch))
            if where == "store":
                self._stored += len(batch)
            else:
                self._spooled += len(batch)
            self._batches += 1
            self._hooks.written(batch, where)
        return True

    def _spill_refused(self, exc: BaseException, batch: list[Any]) -> bool:
        """The store refused a batch with an error that is not "unavailable" (not migrated, a
        permanent error): keep it in the spool for a human, and spool until the next retry.
        False: the spool refused it too."""
        assert self._spill_to is not None
        self._log.error(
            "the store refused %d samples (%s: %s); spooling them", len(batch), type(exc).__name__, exc
        )
        self._spill_to.pause()
        try:
            self._spill_to.spill(batch)
        except Exception:
            self._log.exception("spooling %d samples failed too", len(batch))
            return False
        return True

    def _set_aside_invalid(self, batch: list[Any], refused: SampleError) -> None:
        """The writer refused ``batch`` as invalid (``refused``): the invalid rows are counted and
        reported, never retried; the valid ones stay at the front, written next."""
        good, bad = [], []
        for row in batch:  # the writer's validator, one row at a time: every bad row, not the first
            try:
                validate_samples([row], "row")
            except SampleError as err:
                bad.append((row, str(err).split(": ", 1)[-1]))  # "column ... cannot hold ...: why"
            else:
                good.append(row)
        if not bad:  # the writer refused what the validator takes: refuse the batch, say why
            good, bad = [], [(row, str(refused)) for row in batch]
        error = InvalidRows(bad, len(batch))
        self._log.error("sample writer: %s", error)
        self._invalid += len(bad)
        self._queue.done(len(bad))
        self.first_invalid = self.first_invalid or error
        if good:
            self._held[0] = good
        else:
            self._held.popleft()
        self._hooks.invalid(error)
