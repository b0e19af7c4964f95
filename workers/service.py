"""The replay service: ``submit`` validates and records the replay a ReplayRequest asks for
(workers.runs.create_run), starts it, and hands back a ReplayHandle to wait for its end or
cancel it.

Where the run goes is the service's business, not the caller's: with a broker its first task
is queued for the workers; with eager Celery (no broker, the embedded default) it runs in a
thread of this process, which owns the embedded sample store. Either way it starts once the
caller's transaction commits (at once outside one), so a caller that must name the run before
it sends (a capacity step) records both in one transaction.
"""

from __future__ import annotations

import logging
import threading
import time

from django.conf import settings
from django.db import connections, transaction
from django.utils import timezone

from replay.arrivals import Arrival
from workers.models import ReplayRun
from workers.runs import ReplayRequest, cancel_run, create_run, lag_p99_ms
from workers.shard import run_requests
from workers.tasks import start_replay

log = logging.getLogger(__name__)

# With a broker, how often a wait with no deadline reads the run's row (ReplayHandle.wait).
BROKER_LOOK_S = 1.0


class ReplayHandle:
    """A submitted run: wait for its end, cancel it, read what it planned and how it ended.
    ``run`` is its row (with ``run.plan``) as last read; ``failure`` what its thread in this
    process raised, if it did."""

    def __init__(self, run: ReplayRun, *, in_process: bool) -> None:
        self.run = run
        self.in_process = in_process
        self.failure: BaseException | None = None
        self._ended = threading.Event()  # its thread here returned, or its row was read final

    @property
    def run_id(self) -> int:
        return self.run.pk

    def ended(self) -> bool:
        """Read the run's row: True once it is final, or once its thread in this process has
        returned (a run whose sample store is down stays flushing after that: nothing more
        happens to it here)."""
        self.run.refresh_from_db()
        if self.run.is_final and not self.in_process:
            self._ended.set()
        return self.run.is_final or self._ended.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the run ends or ``timeout`` seconds pass (None: until it ends); True once
        it has ended, its row then read afresh.

        Eager Celery: the run's thread sets the handle's event as it returns, so the wait wakes
        at that moment, whatever is left of the timeout. With a broker the run ends in a worker
        process, which cannot set an event of this one: there the wait reads the run's row when
        the timeout has passed, or every BROKER_LOOK_S without one. A caller that looks at the
        run periodically anyway (a capacity step) passes its look interval as the timeout."""
        if self.in_process:
            return self._ended.wait(timeout) and self.ended()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = BROKER_LOOK_S if deadline is None else deadline - time.monotonic()
            self._ended.wait(max(0.0, min(left, BROKER_LOOK_S)))
            if self.ended():
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def run_here(self) -> None:
        """Run the replay in this thread (eager Celery), then close the thread's database
        connections and set the handle's event. A run that fails before it starts sending ends
        failed, saying so (one that dies while sending is ended by the periodic check,
        workers.runs.reap_abandoned); the exception is kept as ``failure``."""
        try:
            start_replay(self.run_id)
        except BaseException as exc:  # noqa: BLE001 - kept on the handle, and on the run if queued
            log.exception("run %s: failed in this process", self.run_id)
            self.failure = exc
            ReplayRun.objects.filter(pk=self.run_id, status=ReplayRun.Status.QUEUED).update(
                status=ReplayRun.Status.FAILED,
                error=f"failed to start: {exc}"[:4000],
                finished_at=timezone.now(),
            )
        finally:
            connections.close_all()  # this thread's own connections
            self._ended.set()

    def cancel(self, actor=None) -> bool:
        """Cancel the run (workers.runs.cancel_run); False when it had already ended."""
        return cancel_run(self.run, actor)

    def send_order(self, after_s: float = 0.0) -> list[int]:
        """The seqs of the run's requests planned to be sent at or after ``after_s`` seconds, in
        planned send order: its own schedule, as its shards compute it (workers.shard). A closed
        loop sends every request in the trace's order. Reads the source once: the run's shards
        in this process reuse the parse."""
        loaded = run_requests(self.run)
        offsets = Arrival(**self.run.arrival).offsets([r.offset_s for r in loaded.requests])
        if offsets is None:
            return [r.seq for r in loaded.requests]
        planned = sorted(zip(offsets, (r.seq for r in loaded.requests), strict=True))
        return [seq for offset, seq in planned if offset >= after_s]

    def lag_p99_ms(self) -> float | None:
        """The run's schedule lag p99 (workers.runs.lag_p99_ms), as its row last read says."""
        return lag_p99_ms(self.run)


def submit(request: ReplayRequest, *, detached: bool = False) -> ReplayHandle:
    """Validate and record the replay ``request`` asks for (workers.runs.create_run: a
    ReplayError and nothing recorded when it cannot start) and start it once the current
    transaction commits: queued for the workers with a broker, else in a thread of this process
    (``start_in_background``). ``detached``: nobody in this process waits for the run (a web
    request answering at once): its thread is then a daemon, never holding the process open."""
    run = create_run(request)
    handle = ReplayHandle(run, in_process=settings.CELERY_TASK_ALWAYS_EAGER)
    if handle.in_process:
        start_in_background(handle, daemon=detached)
    else:
        transaction.on_commit(lambda: start_replay.delay(run.pk))
    return handle


def start_in_background(handle: ReplayHandle, *, daemon: bool) -> None:
    """Eager Celery: once this transaction commits, run the replay in a thread of this process
    (ReplayHandle.run_here)."""
    transaction.on_commit(
        lambda: threading.Thread(
            target=handle.run_here, name=f"abplat-replay-{handle.run_id}", daemon=daemon
        ).start()
    )
