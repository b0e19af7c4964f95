"""Recording live traffic: each gateway request's sample, written by the host's recorder process.

The same sample row a replay records (samples.rows.row_from), mode ``live``, in the same table:
the rollout controller reads samples by config_revision (rollouts/readings.py), so live
traffic feeds it as a replay's does. One LiveRecorder per gateway process; the recording's CPU
(building rows, serializing, the store's client) is the host's recorder's
(gateway.recorder_process), not the request process's interpreter:

1. ``start()`` registers this process's run (gateway.models: a new LiveRun, so a new run_id, at
   every process start), opens its queue file (gateway.record_queue: <spool>/live-queue/
   <run_id>.queue, flock'ed while the process lives) and makes sure the host has a recorder:
   one holds the spool's recorder lock (an operator's `manage.py gateway_recorder` under a
   supervisor, or one an earlier gateway started), or this process starts one, detached: it is
   then the process that opens the sample store (the embedded chDB included, which one process
   opens). With --with-web on the embedded store (this process's web app reads chDB), or a
   ``store`` given (tests), the recorder is a thread of this process instead: the same files,
   the same guarantees, its CPU here.
2. ``record()`` is called on the request path (the event loop) at the end of each request,
   before the client sees that end (gateway.attempts): one marshal of a plain tuple, one
   ``os.write`` (O_APPEND) to the queue file. It never blocks on the store or the database and
   never raises; a write that failed (the disk full) is counted as ``dropped``. Every 10 s it
   also looks whether the host's recorder still holds its lock, and starts one if not.
3. The recorder tails every queue file of the host, gives each row its seq (its order among the
   file's valid rows: a re-read gives the same keys), builds rows with row_from and writes them
   through samples.flush.FlushLoop and samples.spool.SpoolingWriter (to the store, or to the
   durable spool while the store is down or slow: the replay's retry policy), then records its
   read offset per file (fsync'ed) once the batch is durable.
4. ``close()`` writes the closing record (this process's own counts) and releases the file;
   the recorder drains it, closes the run's books and removes it. close() waits (``timeout``)
   for that. A file whose writer died (SIGKILL) is drained and closed the same way.

Guarantees (tests/gateway/test_recording*.py, test_recorder_process.py, test_two_instances.py):
- No duplicates: a sample's key is (experiment, variant, run_id, request_id) (samples.columns.
  row_key); run_id is new at every process start (the queue file is named by it) and request_id
  is the client-visible X-Request-Id, so ``request_id`` must be unique per (run, variant): the
  gateway makes one per request. A batch whose insert failed ambiguously is spooled and the
  flush skips keys already stored; so are the rows a crashed recorder read again
  (gateway.recorder_process).
- Nothing lost once record() returned: the row is in the queue file's page cache, and survives
  a SIGKILL of the gateway process, of the recorder, or both (not a crash of the host: the
  queue file is not fsync'ed per request). The recorder down: the files grow on local disk and
  it catches up when back; the store down: the spool. A stream cut by a SIGKILL of its gateway
  process never completed and has no sample (nothing runs to record it; the client saw its
  connection cut). Seqs follow the file, so a run's durable samples are seq 1..K.
- Exact counts: on a run, recorded (rows built, each with a seq) = stored + spooled + rows the
  recorder holds in memory, 0 once the run is closed (LiveRun, as of the recorder's last
  heartbeat); this process's counts() adds what waits in its queue file: recorded = stored +
  spooled + queued. Rejected and dropped samples never got a seq. Every spooled row reaches the
  store exactly once when it is back. The run catalog: running while open, done once closed
  with every sample stored (a killed gateway's run too, once drained), failed for a run
  abandoned (a process that died before its queue file existed, or a run of older code).

What a live row holds beyond the measurement: sent_unix_ms is when the gateway wrote the upstream
request (the StreamResult clock's zero, as in a replay); the gateway's own time before it (client
request received -> upstream request written: auth, limits, routing, body rewrite) is
``gateway_ms``, a column of live samples alone (0 in a replay's), and the client's arrival is
``scheduled_offset_ms`` (ms after the run's start). ``schedule_lag_ms``, a replay's lateness
against its plan, is 0: live traffic has no plan. So the client's TTFT is gateway_ms + ttft_ms,
and the report's TTFT split of missed requests shows the gateway's time as its own phase
(analysis.definitions.PHASES: "gateway", beside a replay's "schedule lag"). Live rows recorded
before gateway_ms existed (sample store migration 7) held it in schedule_lag_ms; the report reads
a live row's schedule_lag_ms as the gateway's too, so they split the same. in_flight is 0 (not
measured by the gateway); prompt_tokens is the usage event's when the upstream reported it, else
the gateway's count, flagged prompt_tokens_estimated.

Rows are built by samples.rows.row_from from a SampleContext, as the replay builds its own: the
gateway imports nothing of the replay (an import contract, .importlinter).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any

from gateway import record_queue as rq
from gateway.recorder_process import (
    BATCH_ROWS,
    FLUSH_MS,
    HEARTBEAT_S,
    IDLE_EXIT_S,
    MAX_SEQ,
    RETRY_S,
    QueueRecorder,
)
from samples.spool import FLUSH_BUDGET_S, Spool, SpoolingWriter
from samples.store import SampleStore
from streaming.result import StreamResult

log = logging.getLogger(__name__)

PROBE_S = 10.0  # how often record() looks for the host's recorder (a flock probe, ~10 us)
_now = time.time
_mono = time.monotonic
_record = rq.sample_record


class LiveRecorder:
    """The gateway process's side of the recording (module docstring). ``store`` and
    ``spool_dir`` default to the process's (samples.factory.sample_store, settings.SPOOL_DIR);
    ``in_process`` (default: with a ``store`` given, or --with-web on the embedded store) runs the
    recorder as a thread here; ``spawn`` False never starts a recorder process (one runs under a supervisor).
    The other keywords tune the recorder and are for tests and the bench.

    ``record()``'s signature is the gateway's Recorder protocol (gateway/attempts.py)."""

    def __init__(
        self,
        *,
        worker: str,
        store: SampleStore | None = None,
        spool_dir: str | None = None,
        batch_rows: int = BATCH_ROWS,
        flush_ms: float = FLUSH_MS,
        retry_s: float = RETRY_S,
        heartbeat_s: float = HEARTBEAT_S,
        max_seq: int = MAX_SEQ,
        flush_budget_s: float = FLUSH_BUDGET_S,
        in_process: bool | None = None,
        spawn: bool = True,
    ) -> None:
        if batch_rows < 1 or flush_ms <= 0 or max_seq < 1:
            raise ValueError("LiveRecorder: need batch_rows >= 1, flush_ms > 0, max_seq >= 1")
        self.worker = worker
        self._store, self._spool_dir = store, spool_dir
        self._in_process, self._spawn = in_process, spawn
        self._tuning: dict[str, Any] = dict(
            batch_rows=batch_rows,
            flush_ms=flush_ms,
            retry_s=retry_s,
            heartbeat_s=heartbeat_s,
            max_seq=max_seq,
            flush_budget_s=flush_budget_s,
        )
        self.dir = ""
        self.spool_dir = ""
        self._queue: rq.QueueWriter | None = None
        self._first_run: int | None = None
        self._thread_recorder: QueueRecorder | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._child: subprocess.Popen | None = None
        self._next_probe = float("inf")
        self._last: dict[str, Any] = {}  # the last state of the file read (it goes once drained)
        self._early = 0  # record() before start(): dropped
        self._embedded = False  # the sample store is chDB (its recorder ends when idle at once)

    # ---- the gateway's side ------------------------------------------------------------------

    def start(self) -> None:
        """Register this process's live run (a new run_id), open its queue file and make sure
        the host's recorder runs (module docstring). Raises what the registration raised (the
        database down: the gateway cannot record, so it says so at start). Safe to call from an
        event loop at startup: the database call runs on a thread of its own."""
        if self._queue is not None:
            return
        from django.conf import settings

        self.spool_dir = os.path.abspath(str(self._spool_dir or settings.SPOOL_DIR))
        self.dir = rq.queue_dir(self.spool_dir)
        run_id = _on_a_thread(lambda: _register(Spool(self.spool_dir).id, self.worker))
        self._queue = rq.QueueWriter(self.dir, run_id, self.worker)
        self._first_run = run_id
        self._embedded = not settings.CLICKHOUSE_URL
        in_process = self._in_process
        if in_process is None:
            # With --with-web on the embedded store this process's web app reads chDB, which one
            # process opens: the recorder must be this process too. Otherwise the recorder
            # process is the one that opens the store (chDB or a server).
            with_web = "gateway.asgi_with_web" in sys.modules
            in_process = self._store is not None or (with_web and not settings.CLICKHOUSE_URL)
        if in_process:
            rec = QueueRecorder(self.spool_dir, store=self._store, **self._tuning)
            if rec.acquire():  # else the host's recorder (another process) reads this file
                rec.start()
                self._thread_recorder = rec
                self._thread = threading.Thread(
                    target=rec.run, args=(self._stop,), name="abplat-live-recorder-reader", daemon=True
                )
                self._thread.start()
        elif self._spawn:
            self._ensure_recorder()
            self._next_probe = _mono() + PROBE_S
        log.info("live recorder: recording as live run %s (%s) to %s", run_id, self.worker, self._queue.path)

    def record(
        self,
        result: StreamResult,
        *,
        experiment: str,
        variant: str,
        user_id: str,
        config_revision: int,
        sent_unix_ms: float,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        gateway_ms: float,
        attempt: int = 1,
    ) -> None:
        """Append one request's sample to the queue file (module docstring). Never raises.

        sent_unix_ms: wall-clock ms when the upstream request was written (the StreamResult
        clock's zero); gateway_ms: the gateway's own time before that, from the client's request
        received; request_id: the X-Request-Id the client saw, unique per request; attempt: 2
        for the retry on the control of a variant that failed before its first byte (its own
        sample, under the control's variant key). A bad value is counted as rejected when the
        recorder builds the row, never raised here."""
        queue = self._queue
        if queue is None:
            self._early += 1
            return
        try:
            queue.append(
                _record(
                    _now() * 1000.0,
                    result,
                    experiment,
                    variant,
                    user_id,
                    config_revision,
                    sent_unix_ms,
                    request_id,
                    prompt_tokens,
                    max_tokens,
                    gateway_ms,
                    attempt,
                )
            )
            if _mono() >= self._next_probe:
                self._next_probe = _mono() + PROBE_S
                self._ensure_recorder()
        except Exception:  # pragma: no cover - a bug here must not fail a user's request
            log.exception("live recorder: record() failed")

    def record_shadow(self, row: dict[str, Any]) -> None:
        """Append one shadow's row (gateway/shadow.py: a fidelity_shadows row but recorded_ms) to
        the queue file: the host's recorder writes it to the store, or to its spool while the
        store is down (gateway/shadow_store.py). Never raises; not a sample (counts() leaves it out)."""
        queue = self._queue
        if queue is None:
            return
        try:
            queue.append_shadow(_now() * 1000.0, row)
        except Exception:  # pragma: no cover - a bug here must not reach the event loop
            log.exception("live recorder: record_shadow() failed")

    def close(self, timeout: float = 10.0) -> bool:
        """Write the closing record, release the queue file and wait (``timeout``) for the
        recorder to drain it and close the run. True once it has; False (logged) when the
        recorder has not yet: the samples wait in the file, and a recorder drains it later."""
        queue = self._queue
        if queue is None:
            return self._first_run is None
        self._next_probe = float("inf")
        queue.close()
        deadline = _mono() + timeout
        if self._thread is not None:  # this process's recorder: it drains what it read, and stops
            self._read_state()
            self._stop.set()
            self._thread.join(timeout)
        elif self._spawn and not self._in_process:
            self._ensure_recorder()
        while os.path.exists(queue.path) and _mono() < deadline:
            self._read_state()  # the runs it went to (a run that used every seq goes on as another)
            time.sleep(0.01)
        done = not os.path.exists(queue.path)
        if done and self._thread is None and self._embedded:
            # the recorder ends once no queue file is left, and with it its hold on chDB: the
            # next process to open it (a --with-web gateway, a report) must not find it held
            while rq.recorder_running(self.dir) and not rq.queue_files(self.dir)[0] and _mono() < deadline:
                time.sleep(0.01)
        if done:
            spool_id = Spool(self.spool_dir).id
            self._last = _on_a_thread(lambda: _final_counts(queue.run_id, self.worker, spool_id))
        else:
            log.error(
                "live recorder: live run %s not drained after %g s; its samples wait in %s for the "
                "host's recorder",
                queue.run_id,
                timeout,
                queue.path,
            )
        return done

    def _ensure_recorder(self) -> None:
        """Start the host's recorder, detached, unless one holds the lock (module docstring, 1)."""
        if self._child is not None:
            self._child.poll()  # reaps one that ended
        if rq.recorder_running(self.dir):
            return
        from django.conf import settings

        manage = os.path.join(str(settings.BASE_DIR), "manage.py")
        with open(os.path.join(self.dir, "recorder.log"), "ab") as out:
            self._child = subprocess.Popen(
                [sys.executable, manage, "gateway_recorder", "--spool-dir", self.spool_dir]
                + ["--idle-exit", "0" if self._embedded else str(IDLE_EXIT_S)],
                cwd=str(settings.BASE_DIR),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # not stopped with the gateway's process group
            )
        log.info("live recorder: started the host's recorder (pid %s) on %s", self._child.pid, self.dir)

    # ---- for the dashboards, tests and /metrics -------------------------------------------------

    @property
    def writer(self) -> SpoolingWriter | None:
        """The recorder's spooling writer when it runs in this process (else None)."""
        return self._thread_recorder.writer if self._thread_recorder is not None else None

    @property
    def run_id(self) -> int | None:
        """The run_id new samples get (None before start())."""
        if self._first_run is None:
            return None
        runs = self._read_state().get("runs") or [self._first_run]
        return int(runs[-1])

    def _read_state(self) -> dict[str, Any]:
        """The queue file's state as the recorder last wrote it (or the final counts)."""
        if not self._last.get("final") and self._first_run is not None:
            state = rq.read_state(self.dir, self._first_run)
            if state is not None:
                self._last = state
        return self._last

    def queued(self) -> int:
        """Samples written to the queue file and not yet durable (stored or spooled)."""
        return self.counts()["queued"]

    def counts(self) -> dict[str, int]:
        """This process's counters over its runs: recorded = stored + spooled + queued (in the
        queue file, or read by the recorder and not yet written)."""
        state = self._read_state()
        out = dict.fromkeys(("stored", "spooled", "rejected"), 0)
        for counts in state.get("counts", {}).values():
            for k in out:
                out[k] += int(counts.get(k, 0))
        queue = self._queue
        appended = queue.appended if queue is not None else 0
        recorder_rejected = out["rejected"]
        done = state.get("final", False)
        out["queued"] = 0 if done else appended - out["stored"] - out["spooled"] - recorder_rejected
        out["recorded"] = out["stored"] + out["spooled"] + out["queued"]
        if queue is not None and not done:
            out["rejected"] += queue.rejected
        out["dropped"] = self._early + (queue.dropped if queue is not None else 0)
        return out


def _on_a_thread(call: Any) -> Any:
    """``call()`` on a thread of its own, its database connection closed after (Django refuses
    the ORM inside an event loop); raises what it raised."""
    out: dict[str, Any] = {}

    def run() -> None:
        from django.db import connections

        try:
            out["value"] = call()
        except BaseException as exc:
            out["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, name="abplat-live-recorder-db")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def _register(spool_id: str, worker: str) -> int:
    from gateway.models import LiveRun

    return LiveRun.register(spool_id, worker).run_id


def _final_counts(first: int, worker: str, spool_id: str) -> dict[str, Any]:
    """A drained file's counts, from its runs' LiveRun rows (the state file is gone): the run
    it opened and the ones the recorder went on with for it (registered for this process)."""
    from gateway.models import LIVE_RUN_ID_BASE, LiveRun

    rows = LiveRun.objects.filter(
        spool=spool_id, worker=worker, pid=os.getpid(), pk__gte=first - LIVE_RUN_ID_BASE
    ).order_by("pk")
    fields = ("recorded", "stored", "spooled", "rejected", "dropped")
    counts = {str(r.run_id): {k: getattr(r, k) for k in fields} for r in rows}
    return {"runs": [int(r) for r in counts], "counts": counts, "final": True}
